// fusedmoe tests: locating test data and reading reference tensors.
//
// Fixtures live in tests/data (FUSEDMOE_TEST_DATA_DIR), see
// tests/data/hf/<arch>/{config.json, model.safetensors, reference.safetensors}
// and the fixtures README. Reference tensors are named
// "layers.<L>.T<T>.<what>" (what = input, output, output_f64, router_logits,
// topk_weights, topk_ids, router_scores, output_dequant_f64).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fusedmoe/core/tensor.h"
#include "fusedmoe/io/safetensors.h"

namespace fusedmoe::test {

// Absolute path of tests/data.
std::string test_data_dir();
// tests/data/hf/<arch> (arch as in hf_fixture_archs()).
std::string hf_fixture_dir(const std::string& arch);
// The seven HF fixture architectures: deepseek_v3, gpt_oss, llama4, mixtral,
// olmoe, qwen2_moe, qwen3_moe.
std::vector<std::string> hf_fixture_archs();
// Opens tests/data/hf/<arch>/reference.safetensors.
std::shared_ptr<SafetensorsFile> open_reference(const std::string& arch);

// "layers.<layer>.T<tokens>.<what>", the reference tensor naming.
std::string reference_name(int64_t layer, int64_t tokens, const std::string& what);
// Token counts T present for `layer` in a reference file (sorted, from the
// names "layers.<layer>.T<T>.input").
std::vector<int64_t> reference_token_counts(const SafetensorsFile& file, int64_t layer);

// Contiguous host copies of tensor `name`, converted from any floating dtype
// (f64/f32/f16/bf16/f8) to kF64 / kF32, or from i32/i64 to kI32.
// Throw Error(kIo) when the tensor is absent, Error(kInvalidArgument) when its
// dtype cannot be converted.
Tensor load_tensor_f64(const SafetensorsFile& file, const std::string& name);
Tensor load_tensor_f32(const SafetensorsFile& file, const std::string& name);
Tensor load_tensor_i32(const SafetensorsFile& file, const std::string& name);

// Converts any floating or integer host view to a contiguous kF64 tensor.
Tensor to_f64(const TensorView& t);

// A fresh empty directory under $TMPDIR (or /tmp), removed with its contents
// when the object is destroyed.
class TempDir {
 public:
  explicit TempDir(const std::string& tag = "fusedmoe");
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  // path() + "/" + name
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

}  // namespace fusedmoe::test
