// The environment's tuning switches (core/env.h): env_choice's indices and
// errors, and the CUDA backend's switches checked on every backend (the CPU
// runner refuses a bad FUSEDMOE_CUDA_* value rather than ignoring it).
#include <gtest/gtest.h>

#include <cstdlib>
#include <random>
#include <string>

#include "fusedmoe/core/env.h"
#include "fusedmoe/core/error.h"
#include "fusedmoe/runner/moe_runner.h"
#include "random_layer.h"
#include "test_util.h"

namespace fusedmoe {
namespace {

// Sets one variable for a scope.
struct ScopedEnv {
  ScopedEnv(const char* name, const char* value) : name_(name) { setenv(name, value, 1); }
  ~ScopedEnv() { unsetenv(name_); }
  const char* name_;
};

std::string error_of(void (*f)()) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    return e.what();
  }
  return "";
}

TEST(EnvChoice, IndexOfTheValueOrMinusOneWhenUnsetOrEmpty) {
  unsetenv("FUSEDMOE_TEST_SWITCH");
  EXPECT_EQ(env_choice("FUSEDMOE_TEST_SWITCH", {"a", "bb", "c"}), -1);
  {
    const ScopedEnv e("FUSEDMOE_TEST_SWITCH", "");
    EXPECT_EQ(env_choice("FUSEDMOE_TEST_SWITCH", {"a", "bb", "c"}), -1);
  }
  {
    const ScopedEnv e("FUSEDMOE_TEST_SWITCH", "bb");
    EXPECT_EQ(env_choice("FUSEDMOE_TEST_SWITCH", {"a", "bb", "c"}), 1);
  }
  {
    const ScopedEnv e("FUSEDMOE_TEST_SWITCH", "c");
    EXPECT_EQ(env_choice("FUSEDMOE_TEST_SWITCH", {"a", "bb", "c"}), 2);
  }
}

TEST(EnvChoice, OtherValuesNameTheVariableAndTheValues) {
  {
    const ScopedEnv e("FUSEDMOE_TEST_SWITCH", "B");  // case matters
    EXPECT_EQ(error_of([] {
                env_choice("FUSEDMOE_TEST_SWITCH", {"a", "b", "c"});
              }),
              "FUSEDMOE_TEST_SWITCH: expected a, b or c, got 'B'");
  }
  {
    const ScopedEnv e("FUSEDMOE_TEST_SWITCH", "on\x01");
    EXPECT_EQ(error_of([] {
                env_choice("FUSEDMOE_TEST_SWITCH", {"on", "off"});
              }),
              "FUSEDMOE_TEST_SWITCH: expected on or off, got 'on\\x01'");
  }
}

TEST(CudaSwitches, EveryValueDocumentedIsTakenAndOthersThrow) {
  const struct {
    const char* name;
    const char* good;
    const char* bad;
  } cases[] = {{"FUSEDMOE_CUDA_EXPERTS", "mma", "wgmma"},
               {"FUSEDMOE_CUDA_SM90_TILE", "m128", "m256"},
               {"FUSEDMOE_CUDA_SM90_CONTIG", "off", "maybe"},
               {"FUSEDMOE_CUDA_SM90_GLU", "pass", "fused"},
               {"FUSEDMOE_CUDA_W13_LAYOUT", "standard", "hf"},
               {"FUSEDMOE_CUDA_M16_STAGES", "3", "5"},
               {"FUSEDMOE_CUDA_ALIGN", "grid", "blocks"},
               {"FUSEDMOE_CUDA_DECODE", "0", "no"},
               {"FUSEDMOE_CUDA_PDL", "1", "7"},
               {"FUSEDMOE_CUDA_MMA_SCHEDULE", "static", "greedy"}};
  check_cuda_switches();  // none set
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    {
      const ScopedEnv e(c.name, c.good);
      EXPECT_NO_THROW(check_cuda_switches());
    }
    const ScopedEnv e(c.name, c.bad);
    const std::string msg = error_of([] { check_cuda_switches(); });
    EXPECT_EQ(msg.rfind(std::string(c.name) + ": expected ", 0), 0u) << msg;
    EXPECT_NE(msg.find(std::string("got '") + c.bad + "'"), std::string::npos) << msg;
  }
}

TEST(CudaSwitches, TheCpuRunnerRefusesABadValue) {
  std::mt19937_64 rng(7);
  const MoEConfig c = test::base_config(8, 2, 32, 16);
  const MoELayerWeights w = test::random_layer(rng, c, DType::kF32);
  EXPECT_NO_THROW(MoERunner(c, w, RunnerOptions{}));
  const ScopedEnv e("FUSEDMOE_CUDA_SM90_CONTIG", "maybe");
  try {
    MoERunner runner(c, w, RunnerOptions{});
    ADD_FAILURE() << "FUSEDMOE_CUDA_SM90_CONTIG=maybe accepted on the CPU backend";
  } catch (const Error& err) {
    EXPECT_EQ(std::string(err.what()),
              "FUSEDMOE_CUDA_SM90_CONTIG: expected on or off, got 'maybe'");
  }
}

}  // namespace
}  // namespace fusedmoe
