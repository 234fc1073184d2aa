#include "fixtures.h"

#include <stdlib.h>

#include <algorithm>
#include <filesystem>
#include <vector>

#include "fusedmoe/core/error.h"

namespace fusedmoe::test {

namespace fs = std::filesystem;

std::string test_data_dir() {
  return FUSEDMOE_TEST_DATA_DIR;
}

std::string hf_fixture_dir(const std::string& arch) {
  return test_data_dir() + "/hf/" + arch;
}

std::vector<std::string> hf_fixture_archs() {
  return {"deepseek_v3", "gpt_oss", "llama4", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe"};
}

std::shared_ptr<SafetensorsFile> open_reference(const std::string& arch) {
  return SafetensorsFile::open(hf_fixture_dir(arch) + "/reference.safetensors");
}

std::string reference_name(int64_t layer, int64_t tokens, const std::string& what) {
  return "layers." + std::to_string(layer) + ".T" + std::to_string(tokens) + "." + what;
}

std::vector<int64_t> reference_token_counts(const SafetensorsFile& file, int64_t layer) {
  const std::string pre = "layers." + std::to_string(layer) + ".T";
  std::vector<int64_t> out;
  for (const std::string& n : file.names()) {
    if (n.rfind(pre, 0) != 0) continue;
    const size_t dot = n.find('.', pre.size());
    if (dot == std::string::npos || n.substr(dot + 1) != "input") continue;
    out.push_back(std::stoll(n.substr(pre.size(), dot - pre.size())));
  }
  std::sort(out.begin(), out.end());
  return out;
}

Tensor to_f64(const TensorView& t) {
  Tensor src = t.is_contiguous() ? Tensor(t, nullptr) : Tensor::copy_of(t);
  Tensor out = Tensor::empty(DType::kF64, src.shape());
  double* o = out.data_as<double>();
  const size_t n = static_cast<size_t>(src.numel());
  switch (src.dtype()) {
    case DType::kF64:
      std::copy_n(src.data_as<double>(), n, o);
      break;
    case DType::kI64:
      for (size_t i = 0; i < n; ++i) o[i] = static_cast<double>(src.data_as<int64_t>()[i]);
      break;
    case DType::kI32:
      for (size_t i = 0; i < n; ++i) o[i] = src.data_as<int32_t>()[i];
      break;
    case DType::kBool:
      FUSEDMOE_THROW(kInvalidArgument, "to_f64: bool tensors are not converted");
    default: {
      std::vector<float> tmp(n);
      convert_to_f32(src.data(), src.dtype(), tmp.data(), n);
      std::copy(tmp.begin(), tmp.end(), o);
    }
  }
  return out;
}

Tensor load_tensor_f64(const SafetensorsFile& file, const std::string& name) {
  return to_f64(file.get(name));
}

Tensor load_tensor_f32(const SafetensorsFile& file, const std::string& name) {
  Tensor t = file.get(name);
  FUSEDMOE_CHECK(is_floating(t.dtype()), file.path(), ": tensor '", name,
                 "': expected a floating dtype, got ", dtype_name(t.dtype()));
  if (t.dtype() == DType::kF32) return Tensor::copy_of(t);
  if (t.dtype() == DType::kF64) {
    Tensor out = Tensor::empty(DType::kF32, t.shape());
    const double* s = t.data_as<double>();
    for (int64_t i = 0; i < t.numel(); ++i) out.data_as<float>()[i] = static_cast<float>(s[i]);
    return out;
  }
  return to_f32(t);
}

Tensor load_tensor_i32(const SafetensorsFile& file, const std::string& name) {
  Tensor t = file.get(name);
  if (t.dtype() == DType::kI32) return Tensor::copy_of(t);
  FUSEDMOE_CHECK(t.dtype() == DType::kI64, file.path(), ": tensor '", name,
                 "': expected i32 or i64, got ", dtype_name(t.dtype()));
  Tensor out = Tensor::empty(DType::kI32, t.shape());
  for (int64_t i = 0; i < t.numel(); ++i)
    out.data_as<int32_t>()[i] = static_cast<int32_t>(t.data_as<int64_t>()[i]);
  return out;
}

TempDir::TempDir(const std::string& tag) {
  const char* base = std::getenv("TMPDIR");
  std::string tmpl = std::string(base && *base ? base : "/tmp") + "/" + tag + ".XXXXXX";
  if (!::mkdtemp(tmpl.data())) FUSEDMOE_THROW(kIo, "mkdtemp failed for ", tmpl);
  path_ = tmpl;
}

TempDir::~TempDir() {
  std::error_code ec;
  fs::remove_all(path_, ec);
}

}  // namespace fusedmoe::test
