// `fusedmoe run`: one MoE layer of a HF model on given or random hidden states,
// optionally checked against a reference tensor (e.g. HF transformers' output).
#include <algorithm>
#include <cctype>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cli/bench_common.h"
#include "cli/cli.h"
#include "fusedmoe/core/thread_pool.h"
#include "fusedmoe/io/hf_config.h"
#include "fusedmoe/io/loader.h"
#include "fusedmoe/io/safetensors.h"
#include "fusedmoe/parallel/communicator.h"
#include "fusedmoe/parallel/expert_map.h"
#include "fusedmoe/runner/moe_runner.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/gemm_amx.h"
#ifdef FUSEDMOE_WITH_CUDA
#include <cuda_runtime_api.h>

#include "fusedmoe/kernels/cuda.h"
#endif

namespace fusedmoe::cli {
namespace {

// The token groups that split a run's T rows: the data-parallel ranks, else
// the expert-parallel ones (1 without parallelism).
int token_groups(const ParallelConfig& pc) {
  return pc.dp_size > 1 ? pc.dp_size : pc.ep_size;
}

std::string base_name(const std::string& p) {
  const auto slash = p.find_last_of('/');
  return slash == std::string::npos ? p : p.substr(slash + 1);
}

// `text` with each byte that is not UTF-8 replaced by U+FFFD: the output file's
// metadata is JSON text, and the model's path may be in another encoding.
std::string utf8_replaced(const std::string& text) {
  using nlohmann::json;
  return json::parse(json(text).dump(-1, ' ', false, json::error_handler_t::replace))
      .get<std::string>();
}

constexpr char kNpyMagic[] = "\x93NUMPY";

// The dtypes --input and --reference take (converted to f32): check_float_dtype
// checks them, and read_npy names the .npy codes of those a .npy file can hold.
constexpr DType kFloatDTypes[] = {DType::kF32, DType::kBF16, DType::kF16, DType::kF64};

// What a caller checks of a tensor file's dtype and shape (from its header) before
// anything is allocated for, or read of, its data.
using HeaderCheck = std::function<void(DType, std::span<const int64_t>)>;

// Minimal .npy reader (format versions 1-3, C order): floats f2/f4/f8, signed and
// unsigned integers, bool, of them those in `accepted` (another dtype is an error
// that lists the accepted ones); little- or big-endian (big-endian data is
// byte-swapped to the machine's order, as the Python API converts such arrays).
// `check` sees the header's dtype and shape before the data is read.
Tensor read_npy(const std::string& path, std::span<const DType> accepted,
                const HeaderCheck& check) {
  require_regular_file(path);
  std::ifstream f(path, std::ios::binary);
  if (!f) FUSEDMOE_THROW(kIo, path, ": cannot open: ", std::strerror(errno));
  f.seekg(0, std::ios::end);
  const auto size = static_cast<uint64_t>(f.tellg());
  f.seekg(0);
  // A file that ends before its header does: truncated, with what it lacks.
  const auto truncated = [&](uint64_t need, const std::string& what) {
    FUSEDMOE_THROW(kIo, path, ": truncated .npy file: ", size, " bytes, expected at least ", need,
                   " (", what, ")");
  };
  char magic[8];
  f.read(magic, 8);
  if (f.gcount() < 6 || std::memcmp(magic, kNpyMagic, 6) != 0)
    FUSEDMOE_THROW(kIo, path, ": not a .npy file (bad magic)");
  if (!f)
    truncated(10, std::string("the 6-byte magic, the 2-byte format version and the header's "
                              "length; ") +
                      (size == 6 ? "nothing follows the magic" : "the format version is cut"));
  // Versions 1.0 (2-byte header length), 2.0 and 3.0 (4-byte); another version's
  // layout is unknown, so it is not read as one of these.
  if (magic[6] < 1 || magic[6] > 3 || magic[7] != 0)
    FUSEDMOE_THROW(kIo, path, ": .npy format version ", static_cast<int>(magic[6]), ".",
                   static_cast<int>(magic[7]), " not supported (expected 1.0, 2.0 or 3.0)");
  uint32_t header_len = 0;
  const int len_bytes = magic[6] == 1 ? 2 : 4;
  unsigned char b[4] = {};
  f.read(reinterpret_cast<char*>(b), len_bytes);
  if (!f)
    truncated(8 + len_bytes, "the magic, the format version and the " + std::to_string(len_bytes) +
                                 "-byte header length of version " + std::to_string(magic[6]) +
                                 ".0");
  header_len = b[0] | (b[1] << 8) | (b[2] << 16) | (static_cast<uint32_t>(b[3]) << 24);
  std::string header(header_len, '\0');
  f.read(header.data(), header_len);
  if (!f)
    truncated(8 + len_bytes + uint64_t{header_len},
              "the " + std::to_string(8 + len_bytes) + "-byte preamble and the " +
                  std::to_string(header_len) + "-byte header it announces");
  // The header is a Python dict literal (padded with spaces, ended by a newline).
  {
    const size_t b = header.find_first_not_of(" \t\r\n"), e = header.find_last_not_of(" \t\r\n");
    const char* why = b == std::string::npos ? "it is empty"
                      : header[b] != '{'     ? "it does not begin with '{'"
                      : header[e] != '}'     ? "it has no closing '}'"
                                             : nullptr;
    if (why) {
      std::string shown =
          b == std::string::npos ? "" : header.substr(b, std::min<size_t>(e - b + 1, 80));
      for (char& c : shown)
        if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7f) c = '?';
      FUSEDMOE_THROW(kIo, path,
                     ": malformed .npy header: expected a dict {'descr': ..., 'fortran_order': "
                     "..., 'shape': (...)}, but ",
                     why, " (header: \"", shown, e - b + 1 > 80 ? "...\")" : "\")");
    }
  }
  // Its entries: 'descr' (a string), 'fortran_order' (True or False) and 'shape' (a
  // tuple), in any order, keys in either quote, as numpy's reader takes them; another
  // key is an error there too, and a key given twice (numpy would take its last value)
  // is one here.
  std::string descr, shape_text, fortran;
  {
    constexpr const char* kKeys[] = {"descr", "fortran_order", "shape"};
    bool seen[3] = {};
    size_t pos = header.find('{') + 1;
    auto at = [&] { return pos < header.size() ? header[pos] : '\0'; };
    auto skip_space = [&] {
      while (pos < header.size() && std::isspace(static_cast<unsigned char>(header[pos]))) ++pos;
    };
    auto malformed = [&](const std::string& what) {
      // Control and non-ASCII bytes as \xNN (a newline as \x0a), as everywhere.
      FUSEDMOE_THROW(kIo, path, ": malformed .npy header: expected ", what, " at byte ", pos,
                     " of the header, got \"", printable(header.substr(pos, 40)), "\"");
    };
    // A Python string literal in ' or " (no escapes: numpy writes none in these).
    auto quoted = [&](const char* what) {
      const char q = at();
      if (q != '\'' && q != '"') malformed(what);
      const size_t end = header.find(q, pos + 1);
      if (end == std::string::npos) malformed(what);
      std::string text = header.substr(pos + 1, end - pos - 1);
      pos = end + 1;
      return text;
    };
    for (skip_space(); at() != '}'; skip_space()) {
      const std::string key = quoted("a quoted key");
      const auto index = std::find(std::begin(kKeys), std::end(kKeys), key) - std::begin(kKeys);
      if (index == 3)
        FUSEDMOE_THROW(kIo, path, ": .npy header: unexpected key '", key,
                       "' (expected 'descr', 'fortran_order' and 'shape')");
      if (seen[index])
        FUSEDMOE_THROW(kIo, path, ": .npy header: key '", key, "' given more than once");
      skip_space();
      if (at() != ':') malformed("':' after '" + key + "'");
      ++pos;
      skip_space();
      seen[index] = true;
      if (index == 0) {
        if (at() == '[')
          FUSEDMOE_THROW(kIo, path, ": .npy structured dtypes (record arrays) are not supported");
        descr = quoted("a quoted dtype for 'descr'");
      } else if (index == 1) {
        for (const char* b : {"True", "False"})
          if (header.compare(pos, std::strlen(b), b) == 0) fortran = b;
        if (fortran.empty()) malformed("True or False for 'fortran_order'");
        pos += fortran.size();
      } else {
        const size_t close = header.find(')', pos);
        if (at() != '(' || close == std::string::npos) {
          // Up to 40 characters of what stands there, without the header's
          // trailing padding (spaces and the newline).
          std::string got = header.substr(pos, std::min<size_t>(40, header.size() - pos));
          got.erase(got.find_last_not_of(" \n") + 1);
          FUSEDMOE_THROW(kIo, path, ": .npy header: malformed shape ", got);
        }
        shape_text = header.substr(pos + 1, close - pos - 1);
        pos = close + 1;
      }
      skip_space();
      if (at() == ',')
        ++pos;
      else if (at() != '}')
        malformed("',' or '}' after the value of '" + key + "'");
    }
    for (int i = 0; i < 3; ++i)
      if (!seen[i]) FUSEDMOE_THROW(kIo, path, ": .npy header has no '", kKeys[i], "'");
  }
  struct NpyType {
    const char* code;  // without the byte-order character
    DType dtype;
  };
  static constexpr NpyType kTypes[] = {
      {"f2", DType::kF16}, {"f4", DType::kF32}, {"f8", DType::kF64},
      {"i1", DType::kI8},  {"i2", DType::kI16}, {"i4", DType::kI32},
      {"i8", DType::kI64}, {"u1", DType::kU8},  {"b1", DType::kBool}};
  // '<' little-endian, '>' big-endian, '|' not applicable (1 byte), '=' native;
  // none ('f4', as numpy also reads it): native.
  const bool has_order = !descr.empty() && std::strchr("<>|=", descr[0]) != nullptr;
  const char order = has_order ? descr[0] : '=';
  const auto is_accepted = [&](DType d) {
    return std::find(accepted.begin(), accepted.end(), d) != accepted.end();
  };
  const NpyType* type = nullptr;
  for (const NpyType& t : kTypes)
    if (is_accepted(t.dtype) && descr.compare(has_order ? 1 : 0, std::string::npos, t.code) == 0)
      type = &t;
  if (type == nullptr) {
    // The codes the caller takes ("f2, f4 or f8"), in the table's order.
    std::vector<std::string> codes;
    for (const NpyType& t : kTypes)
      if (is_accepted(t.dtype)) codes.push_back(t.code);
    std::string expected;
    for (size_t i = 0; i < codes.size(); ++i)
      expected += (i == 0 ? "" : i + 1 == codes.size() ? " or " : ", ") + codes[i];
    FUSEDMOE_THROW(kIo, path, ": .npy dtype '", printable(descr), "' not supported (expected ",
                   expected, ", little- or big-endian)");
  }
  const DType dtype = type->dtype;
  if (fortran == "True")
    FUSEDMOE_THROW(kIo, path,
                   ": Fortran-order .npy arrays are not supported (expected C order: "
                   "numpy.ascontiguousarray before numpy.save)");
  std::vector<int64_t> shape;
  uint64_t bytes = dtype_size(dtype);
  bool overflows = false;
  for (auto item : split_list(shape_text)) {
    // Python 2's longs ("(4L, 128L)"), which numpy still reads.
    if (item.size() > 1 && (item.back() == 'L' || item.back() == 'l')) item.pop_back();
    int64_t d = -1;  // split_list trimmed the item
    const char* e = item.data() + item.size();
    const auto r = std::from_chars(item.data(), e, d);
    if (r.ec == std::errc::result_out_of_range && r.ptr == e && item[0] != '-') {
      // Digits that int64 cannot hold: said so, not "expected non-negative".
      uint64_t u = 0;
      const bool fits_u64 = std::from_chars(item.data(), e, u).ec == std::errc();
      FUSEDMOE_THROW(kIo, path, ": .npy header: the size ", item, " in the shape (", shape_text,
                     ") is beyond ",
                     fits_u64 ? "the signed 64-bit range (expected at most 2^63 - 1)"
                              : "64 bits (2^64 or more)");
    }
    if (r.ec != std::errc() || r.ptr != e || d < 0)
      FUSEDMOE_THROW(kIo, path,
                     ": .npy header: expected the shape's sizes as non-negative decimal integers "
                     "(as numpy writes them), got (",
                     shape_text, ")");
    if (d != 0 && bytes > UINT64_MAX / static_cast<uint64_t>(d))
      overflows = true;
    else
      bytes *= static_cast<uint64_t>(d);
    shape.push_back(d);
  }
  // A zero size anywhere makes the array empty, whatever the other sizes.
  if (std::find(shape.begin(), shape.end(), 0) != shape.end()) overflows = false, bytes = 0;
  if (overflows)
    FUSEDMOE_THROW(kIo, path, ": .npy header: the shape (", shape_text,
                   ") overflows 64 bits (its size in bytes is 2^64 or more)");
  // The data must be there before anything is allocated for it.
  const std::streamoff data_at = f.tellg();
  f.seekg(0, std::ios::end);
  const uint64_t available = static_cast<uint64_t>(f.tellg() - data_at);
  f.seekg(data_at);
  std::string dims;
  for (size_t i = 0; i < shape.size(); ++i) dims += (i ? ", " : "") + std::to_string(shape[i]);
  if (bytes > available)
    FUSEDMOE_THROW(kIo, path, ": .npy data shorter than its shape [", dims, "]: ", available,
                   " bytes, expected ", bytes);
  // Bytes past the array (an appended or damaged file), as a safetensors file's are an error.
  if (bytes < available)
    FUSEDMOE_THROW(kIo, path, ": .npy data longer than its shape [", dims, "]: ", available,
                   " bytes, expected ", bytes, " (trailing bytes after the array)");
  check(dtype, shape);
  Tensor t = Tensor::empty(dtype, shape);
  f.read(static_cast<char*>(t.data()), static_cast<std::streamsize>(t.nbytes()));
  if (!f) FUSEDMOE_THROW(kIo, path, ": .npy data shorter than its shape ", t.shape_str());
  const size_t width = dtype_size(dtype);
  if (order == '>' && width > 1) {
    auto* p = static_cast<unsigned char*>(t.data());
    for (size_t i = 0; i < t.nbytes(); i += width) std::reverse(p + i, p + i + width);
  }
  return t;
}

// The tensor `key` of a .safetensors file, or the array of a .npy file (told
// apart by their content, whatever the name; a .npy file's dtype one of
// kFloatDTypes, which both callers take); `check` sees its dtype and shape
// before its data is read (a .safetensors file's is mapped, read as used).
Tensor read_tensor(const std::string& path, const std::string& key, const char* what,
                   const HeaderCheck& check) {
  const std::string flag = std::string("--") + what;
  // A directory, FIFO or device, a missing or unreadable file: named with the reason.
  try {
    require_regular_file(path);
  } catch (const Error& e) {
    throw Error(e.code(), flag + " " + e.what());
  }
  char magic[6] = {};
  {
    std::ifstream f(path, std::ios::binary);
    if (!f) FUSEDMOE_THROW(kIo, flag, " ", path, ": cannot open: ", std::strerror(errno));
    f.read(magic, sizeof magic);
  }
  if (std::memcmp(magic, kNpyMagic, 6) == 0) {
    // The command line's mistake (a usage error, exit 2), as is a missing key below.
    usage_check(key.empty(), flag, "-key '", key, "': ", path,
                " is a .npy file, which holds one array and takes no key");
    // read_npy's errors ("PATH: ...") named with the option whose file it is,
    // as those above; the caller's checks name it themselves.
    bool in_check = false;
    try {
      return read_npy(path, kFloatDTypes, [&](DType d, std::span<const int64_t> shape) {
        in_check = true;
        check(d, shape);
        in_check = false;
      });
    } catch (const Error& e) {
      if (in_check) throw;
      if (std::string_view(e.what()).rfind("Tensor::empty", 0) == 0)  // no memory for the data
        throw Error(e.code(), flag + " " + path + ": " + e.what());
      throw Error(e.code(), flag + " " + e.what());
    }
  }
  std::shared_ptr<SafetensorsFile> file;
  try {
    file = SafetensorsFile::open(path);
  } catch (const Error& e) {
    std::string why = e.what();  // "PATH: reason" (PATH as printable() writes it)
    const std::string shown = printable(path);
    if (why.rfind(shown + ": ", 0) == 0) why.erase(0, shown.size() + 2);
    // A file that starts as safetensors do (an 8-byte header length, then '{') is
    // one, damaged: said so, not "neither ... nor".
    std::ifstream in(path, std::ios::binary);
    unsigned char head[9] = {};
    uint64_t header_len = 0;
    std::error_code ec;
    const auto size = std::filesystem::file_size(path, ec);
    const bool read = static_cast<bool>(in.read(reinterpret_cast<char*>(head), 9));
    for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | head[i];  // little-endian
    // (a header length past the file's end is a cut file; past 100 MB, the format's
    // cap, it is text or something else)
    const bool looks_safetensors =
        read && !ec && head[8] == '{' && header_len >= 2 && header_len <= 100'000'000;
    // A zip archive (numpy.savez's .npz, or a torch.save file) holds several
    // arrays: named as such rather than by a "header length" its bytes make.
    if (read && head[0] == 'P' && head[1] == 'K' && head[2] == 3 && head[3] == 4)
      throw Error(e.code(), flag + " " + path +
                                ": a zip archive (numpy.savez's .npz or a torch.save file), "
                                "not a .npy or .safetensors file: save the one array with "
                                "numpy.save, or tensors with safetensors' save_file");
    throw Error(e.code(),
                flag + " " + path +
                    (looks_safetensors ? ": not a valid .safetensors file ("
                                       : ": neither a .npy file nor a valid .safetensors file (") +
                    why + ")");
  }
  const std::vector<std::string> names = file->names();  // sorted
  // What the file holds, for the messages below: the count and the first few
  // names (sorted), all of them through inspect.
  constexpr size_t kShown = 5;
  std::string some;
  for (size_t i = 0; i < names.size() && i < kShown; ++i)
    some += (i ? ", " : "") + std::string("'") + printable(names[i]) + "'";
  if (names.size() > kShown) some += ", ...";
  const std::string holds = count_of(static_cast<long long>(names.size()), "tensor") +
                            (names.empty() ? std::string() : ": " + some);
  usage_check(!key.empty(), flag, "-key is required with a .safetensors file (", path, " has ",
              holds, "; `fusedmoe inspect ", path, "` lists them)");
  if (!file->contains(key))
    FUSEDMOE_THROW(kIo, flag, "-key '", printable(key), "': ", printable(path),
                   " has no tensor of that name; it has ", holds, " (`fusedmoe inspect ",
                   printable(path), "` lists them)");
  // A dtype fusedmoe does not read (U32, F8_E8M0, ...): what an input takes,
  // as for any other dtype the option does not take.
  const SafetensorsFile::Info info = file->info(key);
  FUSEDMOE_CHECK(info.dtype.has_value(), flag, " '", printable(key), "' in ", printable(path),
                 ": expected dtype f32, bf16, f16 or f64, got ", info.dtype_name);
  Tensor t = file->get(key);
  check(t.dtype(), t.shape());
  return t;
}

// "[2, 128]"
std::string dims_str(std::span<const int64_t> shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

// An input file's tensor as its errors name it: "--input x.npy" (a .npy
// file), "--input 'x' in ref.safetensors"; with option = false, "input ..."
// (the reference a result differs from, no misuse of the option).
std::string describe(const std::string& path, const std::string& key, const char* what,
                     bool option = true) {
  const std::string name = (option ? "--" : "") + std::string(what);
  return key.empty() ? name + " " + path  // a .npy file
                     : name + " '" + key + "' in " + path;
}

// --input and --reference: f32, bf16, f16 or f64 (what the README lists; FP8
// is a weight format whose values need scales, not an activation file's).
void check_float_dtype(DType d, const std::string& what) {
  FUSEDMOE_CHECK(
      std::find(std::begin(kFloatDTypes), std::end(kFloatDTypes), d) != std::end(kFloatDTypes),
      what, ": expected dtype f32, bf16, f16 or f64, got ", dtype_name(d));
}

// The contents of a file as the ranks' options check compares them: its size
// and a 64-bit FNV-1a hash of its bytes ("(not given)" for ""; for a model
// folder, its config.json). Ranks on different nodes may read different files
// under one path: the same options must also mean the same data.
// A file this rank cannot read is this rank's own error (its option, the path
// and the reason; the other ranks then stop with "not run: rank R stopped with
// an error"), not a disagreement between the ranks.
std::string contents_fingerprint(const std::string& path, const char* flag) {
  if (path.empty()) return "(not given)";
  std::error_code ec;
  const bool folder = std::filesystem::is_directory(path, ec);
  const std::string file = folder ? (std::filesystem::path(path) / "config.json").string() : path;
  try {
    require_regular_file(file);
  } catch (const Error& e) {
    throw Error(e.code(), std::string(flag) + " " + e.what());
  }
  std::ifstream f(file, std::ios::binary);
  if (!f) FUSEDMOE_THROW(kIo, flag, " ", file, ": cannot open: ", std::strerror(errno));
  uint64_t h = 1469598103934665603ull, n = 0;
  char buf[1 << 16];
  while (f.read(buf, sizeof buf) || f.gcount() > 0) {
    for (std::streamsize i = 0; i < f.gcount(); ++i)
      h = (h ^ static_cast<unsigned char>(buf[i])) * 1099511628211ull;
    n += static_cast<uint64_t>(f.gcount());
  }
  char out[64];
  std::snprintf(out, sizeof out, "%llu bytes, FNV-1a %016llx", static_cast<unsigned long long>(n),
                static_cast<unsigned long long>(h));
  return out;
}

// 64-bit FNV-1a, fed piece by piece.
struct Fnv1a {
  uint64_t h = 1469598103934665603ull;
  void add(const void* data, size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  }
  void add(const std::string& s) { add(s.data(), s.size() + 1); }  // with its '\0'
};

// A cheap fingerprint of a loaded weight tensor: its dtype and shape, and a
// 64-bit FNV-1a hash over its name, dtype, shape and a sample of its bytes:
// the first and last 4 KiB and 16 blocks of 1 KiB evenly between (all of a
// tensor of at most 24 KiB). At most 24 KiB are read whatever its size (a
// tensor still mapped from the checkpoint: a few pages), so that it tells
// different checkpoints apart, not every single changed value.
std::string weight_fingerprint(const std::string& name, const Tensor& tensor) {
  constexpr size_t kEdge = 4096, kBlock = 1024, kBlocks = 16;
  Fnv1a f;
  f.add(name);
  f.add(dtype_name(tensor.dtype()));
  for (const int64_t d : tensor.shape()) f.add(&d, sizeof d);
  // The loader's tensors are contiguous host tensors (the routed and shared
  // experts must be); a strided one (a router view) is small: copied first.
  const Tensor t = tensor.view().is_contiguous() ? tensor : Tensor::copy_of(tensor.view());
  const auto* p = static_cast<const unsigned char*>(t.data());
  const size_t n = t.nbytes();
  f.add(&n, sizeof n);
  if (n <= 2 * kEdge + kBlocks * kBlock) {
    f.add(p, n);
  } else {
    f.add(p, kEdge);
    for (size_t i = 1; i <= kBlocks; ++i)
      f.add(p + kEdge + (n - 2 * kEdge - kBlock) * i / (kBlocks + 1), kBlock);
    f.add(p + n - kEdge, kEdge);
  }
  char hash[32];
  std::snprintf(hash, sizeof hash, "%016llx", static_cast<unsigned long long>(f.h));
  return std::string(dtype_name(t.dtype())) + " " + t.shape_str() + ", sampled FNV-1a " + hash;
}

// Under mpirun the ranks compared --model's path and config.json before
// loading (make_parallel_world); ranks on different nodes may still read
// different checkpoints of the same shapes under that path, and ran silently.
// After loading (a collective, every rank), this compares a fingerprint of
// each tensor of the layer that every rank loads whole and alike: the router
// (gate weight and bias, e_score_correction_bias, hash table, shared-expert
// gate), the shared experts unless --tp-size > 1 slices them, and the routed
// experts only with neither --ep-size nor --tp-size > 1 (each rank otherwise
// loads its own experts, or slices of them, which no other rank holds).
// CollectiveError (exit 2) on every rank naming the first tensor that differs
// and each rank's dtype, shape and hash; `whose`: "--model PATH" (or the
// bundled model's).
void check_same_weights(Communicator& world, const MoELayerWeights& w, const ParallelConfig& pc,
                        const std::string& whose, int64_t layer) {
  std::vector<std::pair<std::string, std::string>> entries;
  const auto add = [&](const std::string& name, const Tensor& t) {
    if (t.defined())
      entries.emplace_back("the weights of layer " + std::to_string(layer) + " as loaded, " + name,
                           weight_fingerprint(name, t));
  };
  const auto add_experts = [&](const std::string& what, const ExpertWeights& e) {
    add(what + ".w13", e.w13);
    add(what + ".w2", e.w2);
    if (e.w13_bias) add(what + ".w13_bias", *e.w13_bias);
    if (e.w2_bias) add(what + ".w2_bias", *e.w2_bias);
  };
  add("gate_weight (the router)", w.gate_weight);
  if (w.gate_bias) add("gate_bias", *w.gate_bias);
  if (w.router_params.e_score_correction_bias)
    add("e_score_correction_bias", *w.router_params.e_score_correction_bias);
  if (w.router_params.hash_table) add("hash_table", *w.router_params.hash_table);
  if (w.shared_expert_gate) add("shared_expert_gate", *w.shared_expert_gate);
  if (w.shared_experts && pc.tp_size == 1) add_experts("shared_experts", *w.shared_experts);
  if (pc.ep_size == 1 && pc.tp_size == 1) add_experts("experts", w.experts);
  try {
    check_same_on_all_ranks(world, entries, "fusedmoe run");
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kInvalidArgument) throw;  // a lost rank
    throw CollectiveError(
        std::string(e.what()) + "; the ranks read different checkpoints under " + whose +
            " (with the same config.json): give every rank the same files (compared: the "
            "tensors every rank loads whole, the router, the shared experts without --tp-size "
            "and the routed experts without --ep-size or --tp-size, each by a sample of its "
            "bytes)",
        2);
  }
}

// Values of a floating tensor as doubles (f64 kept exactly).
std::vector<double> to_f64(const Tensor& t) {
  std::vector<double> out(static_cast<size_t>(t.numel()));
  if (t.dtype() == DType::kF64) {
    const Tensor c = t.view().is_contiguous() ? t : Tensor::copy_of(t);
    std::memcpy(out.data(), c.data(), out.size() * sizeof(double));
  } else {
    const Tensor f = to_f32(t);
    const float* p = f.data_as<float>();
    for (size_t i = 0; i < out.size(); ++i) out[i] = p[i];
  }
  return out;
}

// An error of a rank's forward names its tokens by their index among the
// rank's rows [first, first + n) of the T input tokens ("at token 1", "(of 4
// tokens"): the index in the whole input instead, as one rank would name it.
std::string with_global_tokens(const std::string& what, int64_t first, int64_t n, int64_t T) {
  const std::string at = "at token ", of = "(of " + std::to_string(n) + " tokens";
  std::string out;
  size_t pos = 0;
  for (;;) {
    const size_t a = what.find(at, pos), b = what.find(of, pos);
    if (a == std::string::npos && b == std::string::npos) break;
    if (b < a) {
      out += what.substr(pos, b - pos) + "(of " + std::to_string(T) + " tokens";
      pos = b + of.size();
      continue;
    }
    size_t end = a + at.size();
    while (end < what.size() && std::isdigit(static_cast<unsigned char>(what[end]))) ++end;
    out += what.substr(pos, a + at.size() - pos);
    if (end > a + at.size())
      out += std::to_string(std::stoll(what.substr(a + at.size(), end - a - at.size())) + first);
    pos = end;
  }
  return out + what.substr(pos);
}

// The files a run reads for the model `model` (a folder, its config.json, a
// checkpoint file or a sharded checkpoint's index), each with what it is: the config.json, then the
// checkpoint (one .safetensors file, or the index and each shard it lists). What cannot be found or
// opened is left out: loading the model reports it.
std::vector<std::pair<std::string, std::string>> model_files(const std::string& model) {
  std::vector<std::pair<std::string, std::string>> out;
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path p(model);
  const bool dir = fs::is_directory(p, ec);
  // A folder's, a checkpoint file's or an index's config.json, or the config.json given.
  if (dir || p.extension() != ".json" || p.filename().string().ends_with(".safetensors.index.json"))
    out.push_back({((dir                   ? p
                     : p.has_parent_path() ? p.parent_path()
                                           : fs::path(".")) /
                    "config.json")
                       .string(),
                   "config.json"});
  else
    out.push_back({model, "config.json"});
  try {
    const Checkpoint checkpoint = Checkpoint::open(model);
    for (const std::string& file : checkpoint.files())
      out.push_back({file, checkpoint.index_path().empty()   ? "checkpoint"
                           : file == checkpoint.index_path() ? "index"
                                                             : "shard"});
  } catch (const Error&) {
  }
  return out;
}

void print_histogram(const std::vector<int64_t>& counts, int64_t routed) {
  const int64_t E = static_cast<int64_t>(counts.size());
  const int64_t max_count = std::max<int64_t>(1, *std::max_element(counts.begin(), counts.end()));
  int64_t used = 0;
  for (int64_t c : counts) used += c > 0;
  std::printf("expert load    %lld routed slots over %lld experts (%lld used, max %lld)\n",
              static_cast<long long>(routed), static_cast<long long>(E),
              static_cast<long long>(used), static_cast<long long>(max_count));
  constexpr int kWidth = 40;
  std::vector<int64_t> order(E);
  for (int64_t e = 0; e < E; ++e) order[e] = e;
  if (E > 64) {  // only the busiest experts
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return counts[a] > counts[b]; });
    order.resize(32);
    std::printf("               (the 32 busiest experts)\n");
  }
  for (int64_t e : order) {
    const int bar = static_cast<int>((counts[e] * kWidth + max_count - 1) / max_count);
    std::printf("  expert %4lld %6lld |%s%*s|\n", static_cast<long long>(e),
                static_cast<long long>(counts[e]), std::string(bar, '#').c_str(), kWidth - bar, "");
  }
}

}  // namespace

CLI::App* add_run_command(CLI::App& app, RunOptions& o) {
  CLI::App* cmd = app.add_subcommand("run", "Run one MoE layer forward on CPU or CUDA");
  cmd->add_option("--model", o.model,
                  "HF model directory, its config.json, its .safetensors file or its "
                  "*.safetensors.index.json (default: the bundled tiny DeepSeek-V3 model)")
      ->check(kNonEmpty);
  cmd->add_option("--layer", o.layer, "MoE layer index (default: the first MoE layer)")
      ->transform(integer_at_least(0));
  auto* input = cmd->add_option("--input", o.input,
                                "Hidden states: .safetensors file (with --input-key) or .npy; "
                                "f32/bf16/f16/f64 [T, H]")
                    ->check(kNonEmpty);
  cmd->add_option("--input-key", o.input_key, "Tensor name in the --input safetensors file")
      ->check(kNonEmptyKey)
      ->needs(input);
  auto* tokens = cmd->add_option("--tokens", o.tokens, "Use T random N(0,1) tokens as input")
                     ->transform(integer_at_least(0));
  input->excludes(tokens);
  tokens->excludes(input);
  auto* seed = cmd->add_option("--seed", o.seed, "Seed of the random input (default: random)")
                   ->transform(kSeed);
  seed->needs(tokens);
  cmd->add_option("--output", o.output,
                  "Write output, topk_ids, topk_weights, router_logits to this .safetensors file "
                  "(a file path: not - for the standard output, which carries the summary)")
      ->check(output_path("the output is a binary .safetensors file"));
  auto* cdt = cmd->add_option("--compute-dtype", o.compute_dtype,
                              "f32 or bf16; with --backend cuda bf16 or f16: the experts' type on "
                              "the GPU (weights converted; default: f16 for an f16 checkpoint, "
                              "else bf16)")
                  ->check(one_of({"f32", "bf16", "f16"}));
  cmd->add_option("--backend", o.backend,
                  "cpu, or cuda: the layer on the GPU (bf16 or f16 compute, f32 accumulation; the "
                  "time is the forward plus a device synchronisation, copies excluded)")
      ->check(one_of({"cpu", "cuda"}))
      ->capture_default_str();
  cmd->add_option("--threads", o.threads, "Worker threads, at most 1024 (default: all cores)")
      ->transform(kThreads);
  auto* ref = cmd->add_option("--reference", o.reference,
                              "File with the expected output (.safetensors with "
                              "--reference-key, or .npy)")
                  ->check(kNonEmpty);
  cmd->add_option("--reference-key", o.reference_key, "Tensor name in the --reference file")
      ->check(kNonEmptyKey)
      ->needs(ref);
  cmd->add_option("--tolerance", o.tolerance,
                  "Largest relative L2 error accepted (default: 1e-5 f32, 1e-2 bf16 / f16; at "
                  "least 1e-2 with --dispatch-dtype bf16 on the CPU, 1e-1 with fp8)")
      ->transform(number_at_least(0))
      ->needs(ref);
  cmd->add_option("--repeat", o.repeat, "Run the forward N times; the median time is reported")
      ->transform(kPositiveInt);
  cmd->add_option("--warmup", o.warmup,
                  "Untimed forward calls before the timed ones (default 1: the first call "
                  "allocates the workspace and brings the weights in)")
      ->transform(integer_in(0, 1000000));
  add_bool_flag(*cmd, "--quiet", o.quiet, "Leave out the expert load histogram");
  cmd->add_option("--ep-size", o.ep_size,
                  "Expert parallelism over ranks (mpirun -np N ... --ep-size N): each EP rank "
                  "runs a share of the tokens and holds a share of the experts; rank 0 writes")
      ->transform(kPositiveInt);
  cmd->add_option("--tp-size", o.tp_size,
                  "Tensor parallelism inside experts (ranks = ep or dp size x tp size)")
      ->transform(kPositiveInt);
  cmd->add_option("--dp-size", o.dp_size,
                  "Data-parallel token groups; with --ep-size equal to it, experts are spread "
                  "over them (all-gather / reduce-scatter)")
      ->transform(kPositiveInt);
  add_expert_placement_option(*cmd, o.expert_placement);
  add_ep_payload_options(*cmd, o.dispatch_dtype, o.combine_dtype);
  cmd->callback([&o, seed, cdt, input, tokens] {
    // A command line that lacks its input does not parse (exit code 2).
    if (input->count() == 0 && tokens->count() == 0)
      throw CLI::RequiredError("no input: give --input FILE [--input-key KEY], or --tokens T",
                               CLI::ExitCodes::RequiredError);
    o.seed_given = seed->count() > 0;
    o.compute_dtype_given = cdt->count() > 0;
  });
  return cmd;
}

namespace {
int run_run_body(const RunOptions& o);

// The forward's errors about values its arithmetic made non-finite (a finite
// input can overflow f32: |x| ~ 1e20 and beyond) name the input the run read, not
// the library's argument names (hidden_states, gate_weight, check_finite; session
// 31's trial).
std::string name_the_input(const std::string& what, const RunOptions& o) {
  const std::string input = o.input.empty()
                                ? "the generated input (--tokens " + std::to_string(o.tokens) + ")"
                                : "--input " + printable(o.input);
  static constexpr std::string_view kLogits =
      "the router logits computed from hidden_states and gate_weight (no router_logits given): ";
  static constexpr std::string_view kLogitsWhy = " (a non-finite gate_weight / gate_bias";
  static constexpr std::string_view kOutput = "output: non-finite value at ";
  if (what.rfind(kLogits, 0) == 0) {
    std::string rest = what.substr(kLogits.size());
    if (const size_t at = rest.rfind(kLogitsWhy); at != std::string::npos) rest.erase(at);
    return input + ": the router logits computed from it and the model's gate weights: " + rest +
           " (its values overflow f32 in the router's product, or the gate weights hold NaN or "
           "Inf)";
  }
  if (what.rfind(kOutput, 0) == 0)
    return input + ": the layer's output has a non-finite value at " + what.substr(kOutput.size());
  return what;
}
}  // namespace

int run_run(const RunOptions& o) {
  try {
    return run_run_body(o);
  } catch (const Error& e) {
    std::string what = name_the_input(e.what(), o);
    if (what == e.what()) throw;  // as it was (its type too: a usage error stays one)
    throw Error(e.code(), what);
  }
}

namespace {
int run_run_body(const RunOptions& o) {
  usage_check(!o.input.empty() || o.tokens >= 0,
              "no input: give --input FILE [--input-key KEY], or --tokens T");
  // The output is written over an existing file only if it is none of the
  // files the run reads: --input, --reference, and the model's config.json,
  // checkpoint, index and every shard the index lists (compared as files: a
  // link or another path to one of them is the same file).
  if (!o.output.empty()) {
    const auto same = [&](const std::string& path) {
      std::error_code ec;
      return !path.empty() && std::filesystem::equivalent(o.output, path, ec);
    };
    for (const auto& [path, flag] : {std::pair{o.input, "--input"}, {o.reference, "--reference"}})
      usage_check(!same(path), "--output ", o.output, ": is the same file as ", flag, " ", path,
                  " (it would be overwritten)");
    const std::string model = o.model.empty() ? bundled_model_dir() : o.model;
    const std::string whose = (o.model.empty() ? "the bundled model " : "--model ") + model;
    const std::vector<std::pair<std::string, std::string>> files = model_files(model);
    for (const auto& [path, what] : files)
      usage_check(!same(path), "--output ", o.output, ": is the same file as ", path, " (the ",
                  what, " of ", whose, "; it would be overwritten)");
    // Nor any other file in the model's folder (the bundled model's
    // reference.safetensors, a file of the checkpoint not yet read), nor in the
    // bundled model's folder with another --model (its reference.safetensors is
    // what the README's checks compare against): the output, resolved, lies
    // outside each folder, resolved.
    refuse_output_in_model_folder("--output", o.output, files.front().first, whose);
    // Nor in a folder the model's files are links into (a Hugging Face cache
    // snapshot's files point into its blobs/ folder).
    for (const auto& [path, what] : files) {
      std::error_code ec;
      const std::filesystem::path real = std::filesystem::canonical(path, ec);
      if (!ec)
        refuse_output_in_model_folder("--output", o.output, real,
                                      "the " + what + " of " + whose + " (" + path + ")");
    }
    if (!o.model.empty())
      refuse_output_in_model_folder("--output", o.output,
                                    std::filesystem::path(bundled_model_dir()) / "config.json",
                                    "the bundled model " + bundled_model_dir());
  }
  // A NumPy name, in any case (.NPY was written as safetensors under it).
  const std::string ext = lower_extension(o.output);
  usage_check(ext != ".npy" && ext != ".npz", "--output ", o.output,
              ": the output is a .safetensors file (output, topk_ids, topk_weights, "
              "router_logits), not .npy / .npz; name it *.safetensors");
  if (o.threads > 0) ThreadPool::set_global_num_threads(o.threads);
  if (o.backend == "cpu" && o.threads > usable_cpus())
    std::fprintf(stderr,
                 "fusedmoe: warning: --threads %d is more than the %s this process may use: "
                 "the threads share them, which is slower than one each\n",
                 o.threads, count_of(usable_cpus(), "CPU").c_str());
  const bool on_cuda = o.backend == "cuda";
  usage_check(
      !on_cuda || !o.compute_dtype_given || o.compute_dtype == "bf16" || o.compute_dtype == "f16",
      "--backend cuda computes in bf16 or f16 (f32 accumulation); got --compute-dtype ",
      o.compute_dtype);
  usage_check(on_cuda || o.compute_dtype != "f16",
              "--compute-dtype f16: needs --backend cuda (the CPU backend computes in f32 or "
              "bf16)");
  DType compute_dtype = o.compute_dtype == "f16"               ? DType::kF16
                        : on_cuda || o.compute_dtype == "bf16" ? DType::kBF16
                                                               : DType::kF32;

  // Parallel layout: every rank loads its share and runs its token group's
  // rows; the results are gathered and rank 0 reports and writes.
  const bool parallel = o.ep_size > 1 || o.tp_size > 1 || o.dp_size > 1;
  check_ep_options(o.ep_size, o.dp_size, o.dispatch_dtype, o.combine_dtype, o.expert_placement,
                   on_cuda);
  // What --backend cuda takes is decided by the command line alone: checked
  // here, before the rank count and long before any device is looked for, so
  // that a machine without a GPU (or a build without CUDA) reports the misuse,
  // not the missing device.
  usage_check(!on_cuda || (o.tp_size == 1 && o.dp_size == 1),
              "--backend cuda: --ep-size only (GPU expert parallelism); got --tp-size ", o.tp_size,
              " --dp-size ", o.dp_size, " (--tp-size / --dp-size run on the CPU backend)");
  // The GPU experts take f16 inputs with f16 compute: bf16 records would be
  // refused by the runner, after the device is set up.
  usage_check(!on_cuda || o.dispatch_dtype != "bf16" || compute_dtype != DType::kF16,
              "--dispatch-dtype bf16 with --compute-dtype f16: with --backend cuda the experts "
              "take f16 inputs; expected --dispatch-dtype auto (f16 records) or fp8, or "
              "--compute-dtype bf16");
  // Under mpirun the sizes must account for every rank .
  check_launch_size(o.ep_size, o.tp_size, o.dp_size);
  // The output's temporary, created now by the rank that writes (rank 0): a
  // path that cannot be written fails before the work, naming --output.
  std::unique_ptr<AtomicFile> output_file;
  if (!o.output.empty() && (!launch_world() || launch_world()->rank() == 0)) {
    output_file = naming_option("--output", [&] { return std::make_unique<AtomicFile>(o.output); });
  }
  std::shared_ptr<Communicator> world;
  if (parallel) {
    // Every option that decides what a rank computes or sends, or what rank 0
    // writes (--threads and --quiet are the rank's own).
    world = make_parallel_world(
        o.ep_size, o.tp_size, o.dp_size,
        {{"--model", o.model.empty() ? "(the bundled model)" : o.model},
         {"--layer", o.layer >= 0 ? std::to_string(o.layer) : "(the first MoE layer)"},
         {"--input", or_not_given(o.input)},
         {"--input-key", or_not_given(o.input_key)},
         {"--tokens", o.tokens >= 0 ? std::to_string(o.tokens) : "(not given)"},
         {"--seed", o.seed_given ? std::to_string(o.seed) : "(random)"},
         {"--compute-dtype", dtype_name(compute_dtype)},
         {"--backend", o.backend},
         {"--ep-size", std::to_string(o.ep_size)},
         {"--tp-size", std::to_string(o.tp_size)},
         {"--dp-size", std::to_string(o.dp_size)},
         {"--expert-placement", o.expert_placement},
         {"--dispatch-dtype", o.dispatch_dtype},
         {"--combine-dtype", o.combine_dtype},
         {"--repeat", std::to_string(o.repeat)},
         {"--warmup", std::to_string(o.warmup)},
         {"--output", or_not_given(o.output)},
         {"--reference", or_not_given(o.reference)},
         {"--reference-key", or_not_given(o.reference_key)},
         {"--tolerance", o.tolerance >= 0 ? exact_number(o.tolerance) : "(default)"},
         // The same paths, the same data (node-local files may differ).
         {"--model contents (config.json)", contents_fingerprint(o.model, "--model")},
         {"--input contents", contents_fingerprint(o.input, "--input")},
         {"--reference contents", contents_fingerprint(o.reference, "--reference")}},
        "fusedmoe run");
  }
  const bool root = !world || world->rank() == 0;
  // Up to the runner, this rank's own work (the model, the input, the
  // reference, its weights): an error there, such as more tokens than the
  // memory fits, is told to the other ranks at rank_local_done(), not MPI_Abort.
  rank_local_begin();

  // Model and layer. The errors of --model's files (no such folder, no
  // config.json, a damaged checkpoint) name the option first, as --output's do.
  const std::string model_dir = o.model.empty() ? bundled_model_dir() : o.model;
  const std::string model_flag = o.model.empty() ? "" : "--model: ";
  const auto model_error = [&](const Error& e) { return Error(e.code(), model_flag + e.what()); };
  const ModelInfo info = [&] {
    try {
      return load_model_info(model_dir);
    } catch (const Error& e) {
      throw model_error(e);
    }
  }();
  require_moe_layer(info, model_flag + printable(model_dir));
  const int64_t layer = o.layer >= 0 ? o.layer : info.moe_layers.front();
  MoEConfig config = [&] {
    try {
      return info.layer_config(layer);
    } catch (const Error& e) {  // its only errors: a layer out of range or not MoE
      throw Error(e.code(), std::string("run --layer: ") + e.what());
    }
  }();
  // Every expert-parallel rank holds an expert: name the option here (ExpertMap
  // would name its own ep_size).
  usage_check(o.ep_size <= config.num_experts, "--ep-size ", o.ep_size,
              ": expected at most num_experts = ", config.num_experts, " (the routed experts of ",
              model_dir, " layer ", layer, ")");
  // Every tensor-parallel rank holds a slice of each expert's intermediate
  // columns (and of the shared expert's): named as the option, as --ep-size.
  usage_check(o.tp_size <= config.intermediate_size, "--tp-size ", o.tp_size,
              ": expected at most intermediate_size = ", config.intermediate_size,
              " (the routed experts of ", model_dir, " layer ", layer, ")");
  usage_check(!config.has_shared_expert() || o.tp_size <= config.shared_intermediate_size,
              "--tp-size ", o.tp_size,
              ": expected at most shared_intermediate_size = ", config.shared_intermediate_size,
              " (the shared expert of ", model_dir, " layer ", layer, ")");
  // On the GPU an f16 checkpoint stays f16 unless --compute-dtype says otherwise.
  if (on_cuda && !o.compute_dtype_given && info.dtype == DType::kF16) compute_dtype = DType::kF16;
  // As above, for the f16 compute an f16 checkpoint brings (before the device).
  usage_check(!on_cuda || o.dispatch_dtype != "bf16" || compute_dtype != DType::kF16,
              "--dispatch-dtype bf16: with --backend cuda the experts of ", model_dir,
              " compute in f16 (an f16 checkpoint, no --compute-dtype given); expected "
              "--dispatch-dtype auto (f16 records) or fp8, or --compute-dtype bf16");
  if (parallel) {
    config.parallel = parallel_config_for_rank(world->rank(), o.ep_size, o.tp_size, o.dp_size);
    config.parallel.expert_placement = parse_expert_placement(o.expert_placement);
  }
  const int64_t H = config.hidden_size, k = config.top_k;
  const int64_t num_logits = config.num_router_logits();

  // The memory T tokens take on this rank, as bench budgets its tokens
  // (bench_common.h): every rank holds the whole input, output and routing
  // [T, ...]; its token group's rows run through the routed experts, budgeted
  // for the most they can receive (rank_token_bytes: under expert parallelism
  // every group's tokens), and the shared expert. Beside this rank's weights,
  // the ranks on this machine must fit its available memory (MemAvailable: not
  // what other processes hold, which the physical memory counted; a run over
  // it swaps or is ended by the OOM killer): T over that is an error naming
  // what gave T (--tokens before anything is allocated for it).
  const auto check_tokens_fit = [&](int64_t T, const std::string& what) {
    const ParallelConfig& pc = config.parallel;
    const int64_t E_local = ExpertMap(config.num_experts, pc.ep_size, pc.expert_placement)
                                .num_local_experts(pc.ep_rank);
    const int64_t I_local = tp_slice(config.intermediate_size, pc.tp_size, pc.tp_rank).second;
    const int64_t S_local =
        config.has_shared_expert()
            ? tp_slice(config.shared_intermediate_size, pc.tp_size, pc.tp_rank).second
            : 0;
    const size_t es = info.dtype == DType::kBF16 ? 2 : 4, f = sizeof(float);
    const size_t weights =
        es * static_cast<size_t>(3 * H * (E_local * I_local + S_local) + num_logits * H);
    // Every rank: input, output, topk ids and weights, router logits [T, ...];
    // the reference and its f64 copy.
    const size_t whole = f * static_cast<size_t>(2 * H + 2 * k + num_logits) +
                         (o.reference.empty() ? 0 : 16 * static_cast<size_t>(H));
    const int groups = token_groups(pc);
    const size_t rows =
        on_cuda ? 0
                : bench::rank_token_bytes(H, I_local, k, E_local, pc.ep_size > 1 ? groups : 1) +
                      (S_local > 0 ? f * static_cast<size_t>(2 * H + 1 + S_local) : 0);
    // This group's ceil(T / groups) rows: one group's rows beside, the rest a share.
    const size_t per_token = whole + (rows + groups - 1) / groups;
    const int ranks = world ? local_size(world->size()) : 1;
    const size_t available = bench::available_memory_bytes();
    const size_t budget = available / static_cast<size_t>(ranks);
    const int64_t most = bench::most_tokens_within(budget, weights + rows, per_token);
    if (T <= most) return;
    throw Error(
        ErrorCode::kInvalidArgument,
        detail::concat(what, ": expected at most ", most, " tokens for this machine's memory, got ",
                       T, " (", format_bytes(static_cast<double>(per_token)),
                       " a token for the hidden states, routing and output and the experts' "
                       "routed rows and intermediates, beside ",
                       format_bytes(static_cast<double>(weights)), " of weights, within ",
                       format_bytes(static_cast<double>(available)), " available memory",
                       ranks > 1 ? " shared by the " + std::to_string(ranks) + " ranks on it" : "",
                       "); give fewer tokens"));
  };

  // The checkpoint against config.json first, from the headers alone: a layer
  // whose tensors do not fit the config is the model's error, not an input's
  // (an input of the checkpoint's H was said to be the wrong size).
  const Checkpoint checkpoint = [&] {
    try {
      return Checkpoint::open(model_dir);
    } catch (const Error& e) {
      throw model_error(e);
    }
  }();
  try {
    check_moe_layer(checkpoint, info, layer);
  } catch (const Error& e) {
    throw model_error(e);
  }

  // Input.
  Tensor input;
  std::string input_desc;
  if (!o.input.empty()) {
    const std::string what = describe(o.input, o.input_key, "input");
    // Shape, dtype and memory from the file's header, before its data is read.
    const Tensor raw =
        read_tensor(o.input, o.input_key, "input", [&](DType d, std::span<const int64_t> shape) {
          if (shape.size() != 2 || shape[1] != H)
            FUSEDMOE_THROW(kInvalidArgument, what, ": expected [T, ", H, "], got ",
                           dims_str(shape));
          check_float_dtype(d, what);
          check_tokens_fit(shape[0], what);
        });
    // A NaN or Inf in the file, or an f64 value that f32 cannot hold: named in
    // the file, before the f32 copy the experts read.
    check_finite_rows(raw.view(), what.c_str(), "token");
    if (raw.dtype() == DType::kF64) {
      const Tensor c = raw.view().is_contiguous() ? raw : Tensor::copy_of(raw);
      if (const int64_t i = find_beyond_f32(c.data(), static_cast<size_t>(c.numel())); i >= 0)
        FUSEDMOE_THROW(kInvalidArgument, what, ": element [", i / H, ", ", i % H,
                       "] is beyond the f32 range once converted from f64 (its value ",
                       c.data_as<double>()[i], ")");
    }
    input = raw.dtype() == DType::kF32 ? raw : to_f32(raw);
    input_desc = o.input_key.empty() ? base_name(o.input) : base_name(o.input) + ":" + o.input_key;
  } else {
    // Drawn once the ranks agree on the seed (after rank_local_done, a collective).
    check_tokens_fit(o.tokens, "--tokens");
  }
  const int64_t T = o.input.empty() ? o.tokens : input.size(0);

  // Reference (read and checked before anything runs).
  Tensor reference;
  std::string ref_what;
  if (!o.reference.empty()) {
    ref_what = describe(o.reference, o.reference_key, "reference");
    reference = read_tensor(o.reference, o.reference_key, "reference",
                            [&](DType d, std::span<const int64_t> shape) {
                              if (shape.size() != 2 || shape[0] != T || shape[1] != H)
                                FUSEDMOE_THROW(kInvalidArgument, ref_what, ": expected [", T, ", ",
                                               H, "], got ", dims_str(shape));
                              check_float_dtype(d, ref_what);
                            });
    // A NaN or Inf in the reference makes the relative error meaningless (NaN,
    // or inf that an infinite --tolerance would accept): refused, named.
    check_finite_rows(reference.view(), ref_what.c_str(), "row");
  }

  // Weights and runner.
  LoadOptions lopts;
  lopts.progress = root;
  lopts.parallel = config.parallel;  // this rank's share only
  MoELayerWeights weights = [&] {
    try {
      return load_moe_layer(checkpoint, info, layer, lopts);
    } catch (const Error& e) {
      // The library's way past its value checks is no option of the CLI's: not named here.
      std::string what = e.what();
      const std::string hint = "; LoadOptions::check_finite = false skips this check";
      for (size_t at; (at = what.find(hint)) != std::string::npos;) what.erase(at, hint.size());
      throw Error(e.code(), model_flag + what);
    }
  }();
  const size_t weight_bytes = weights.nbytes();
  const bool weights_bf16 = weights.experts.w13.dtype() == DType::kBF16;
  // The device is this rank's own too: looked for before rank_local_done(), so
  // that under mpirun a machine (or build) without one is an error each rank
  // reports and exits with (exit 1), told to the others there, not an
  // MPI_Abort after the collectives started.
  if (on_cuda) {
#ifdef FUSEDMOE_WITH_CUDA
    FUSEDMOE_CHECK(cuda::device_count() > 0, "--backend cuda: no CUDA device found");
#else
    FUSEDMOE_THROW(kUnsupported, "--backend cuda: this build of fusedmoe has no CUDA backend");
#endif
  }
  rank_local_done();  // every rank's own work done: the collectives start
  if (world)
    check_same_weights(*world, weights, config.parallel,
                       (o.model.empty() ? "the bundled model " : "--model ") + model_dir, layer);
  if (o.input.empty()) {
    uint64_t seed = o.seed;
    if (!o.seed_given)
      seed = (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
    if (world) world->broadcast(&seed, sizeof seed, 0);  // the same tokens on every rank
    try {
      input = Tensor::empty(DType::kF32, {o.tokens, H});
    } catch (const Error& e) {  // too many tokens for the memory: the option that asked
      throw Error(e.code(), "--tokens " + std::to_string(o.tokens) + ": " + e.what());
    }
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    float* p = input.data_as<float>();
    for (int64_t i = 0; i < input.numel(); ++i) p[i] = normal(rng);
    input_desc = "random N(0,1), seed " + std::to_string(seed);
  }
  RunnerOptions ropts;
  ropts.compute_dtype = compute_dtype;
  ropts.communicator = world;
  ropts.dispatch_dtype = parse_dispatch_dtype(o.dispatch_dtype);
  ropts.combine_dtype = o.combine_dtype == "bf16" ? DType::kBF16 : DType::kF32;
  int cuda_device = 0;
  if (on_cuda) {
#ifdef FUSEDMOE_WITH_CUDA
    if (parallel) {
      // One GPU per rank (local rank % device count); NCCL over the GPUs, its
      // unique id shared through the MPI world.
      cuda_device = local_rank(world->rank()) % cuda::device_count();
      FUSEDMOE_CHECK(cudaSetDevice(cuda_device) == cudaSuccess, "cudaSetDevice(", cuda_device,
                     ") failed");
      ropts.communicator = make_nccl_communicator(world, cuda_device);
    }
    ropts.device = Device{DeviceType::kCUDA, cuda_device};
    // Expert parallelism: each token group's share of the T rows (below); the
    // peer transport's experts run on ep_size * max_num_tokens rows.
    const int64_t groups = token_groups(config.parallel);
    ropts.max_num_tokens = std::max<int64_t>((T + groups - 1) / groups, 1);
#endif
  }
  MoERunner runner(config, std::move(weights), ropts);

  Tensor output = Tensor::empty(DType::kF32, {T, H});
  Tensor topk_ids = Tensor::empty(DType::kI32, {T, k});
  Tensor topk_weights = Tensor::empty(DType::kF32, {T, k});
  Tensor router_logits = Tensor::empty(DType::kF32, {T, num_logits});
  ForwardOutputs outs{router_logits, topk_ids, topk_weights};

  std::vector<double> times;
  if (parallel) {
    // Token group g (EP or DP rank) runs rows [T g / G, T (g + 1) / G).
    const ParallelConfig& pc = config.parallel;
    const int G = token_groups(pc), P = world->size();
    auto row0 = [&](int g) { return T * g / G; };
    const int g = world->rank() / pc.tp_size;
    const int64_t r0 = row0(g), n = row0(g + 1) - row0(g);
    ForwardOutputs mine{router_logits.view().narrow(0, r0, n), topk_ids.view().narrow(0, r0, n),
                        topk_weights.view().narrow(0, r0, n)};
    const auto forward_rows = [&](TensorView x, TensorView out, ForwardOutputs* outs) {
      try {
        runner.forward(x, out, nullptr, nullptr, outs);
      } catch (const Error& e) {
        throw Error(e.code(), with_global_tokens(e.what(), r0, n, T));
      }
    };
    if (!on_cuda) {
      for (int r = 0; r < o.warmup + o.repeat; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        forward_rows(input.view().narrow(0, r0, n), output.view().narrow(0, r0, n), &mine);
        const auto t1 = std::chrono::steady_clock::now();
        if (r >= o.warmup) times.push_back(std::chrono::duration<double>(t1 - t0).count());
      }
    } else {
#ifdef FUSEDMOE_WITH_CUDA
      // This rank's rows on its GPU; the timed region is the forward plus a
      // device synchronisation (copies excluded).
      const Device dev{DeviceType::kCUDA, cuda_device};
      const int64_t n1 = std::max<int64_t>(n, 1);
      cuda::DeviceBuffer x_d(n1 * H * 4), out_d(n1 * H * 4), ids_d(n1 * k * 4), w_d(n1 * k * 4),
          lg_d(n1 * num_logits * 4);
      if (n > 0) x_d.upload(input.view().narrow(0, r0, n).data(), n * H * 4);
      ForwardOutputs douts{TensorView(lg_d.data(), DType::kF32, {n, num_logits}, dev),
                           TensorView(ids_d.data(), DType::kI32, {n, k}, dev),
                           TensorView(w_d.data(), DType::kF32, {n, k}, dev)};
      for (int r = 0; r < o.warmup + o.repeat; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        forward_rows(TensorView(x_d.data(), DType::kF32, {n, H}, dev),
                     TensorView(out_d.data(), DType::kF32, {n, H}, dev), &douts);
        cuda::synchronize();
        const auto t1 = std::chrono::steady_clock::now();
        if (r >= o.warmup) times.push_back(std::chrono::duration<double>(t1 - t0).count());
      }
      if (n > 0) {
        out_d.download(output.view().narrow(0, r0, n).data(), n * H * 4);
        ids_d.download(mine.topk_ids.data(), n * k * 4);
        w_d.download(mine.topk_weights.data(), n * k * 4);
        lg_d.download(mine.router_logits.data(), n * num_logits * 4);
      }
#endif
    }
    // Every group's rows from its tp_rank 0 rank, in place.
    for (const Tensor* t : {&output, &topk_ids, &topk_weights, &router_logits}) {
      const int64_t row_bytes = t->size(1) * static_cast<int64_t>(dtype_size(t->dtype()));
      std::vector<int64_t> counts(P), displs(P);
      for (int p = 0; p < P; ++p) {
        const int pg = p / pc.tp_size;
        counts[p] = p % pc.tp_size == 0 ? (row0(pg + 1) - row0(pg)) * row_bytes : 0;
        displs[p] = row0(pg) * row_bytes;
      }
      world->all_gather_v(static_cast<char*>(t->data()) + displs[world->rank()],
                          counts[world->rank()], t->data(), counts, displs);
    }
    parallel_world_done();  // no collective left: an error below is rank 0's alone
    if (!root) return 0;    // rank 0 compares, writes and reports
  } else if (!on_cuda) {
    for (int r = 0; r < o.warmup + o.repeat; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      runner.forward(input, output, nullptr, nullptr, &outs);
      const auto t1 = std::chrono::steady_clock::now();
      if (r >= o.warmup) times.push_back(std::chrono::duration<double>(t1 - t0).count());
    }
  } else {
#ifdef FUSEDMOE_WITH_CUDA
    // Device copies of the input and of every output; the timed region is the
    // forward plus a device synchronisation (copies excluded).
    const Device dev{DeviceType::kCUDA, 0};
    cuda::DeviceBuffer x_d(input.nbytes()), out_d(output.nbytes()), ids_d(topk_ids.nbytes()),
        w_d(topk_weights.nbytes()), lg_d(router_logits.nbytes());
    // The device kernels do not check their input (that needs a host sync):
    // a NaN or Inf hidden state is named here, as the CPU runner does.
    if (const int64_t bad =
            find_non_finite(input.data(), DType::kF32, static_cast<size_t>(input.numel()));
        bad >= 0)
      FUSEDMOE_THROW(kInvalidArgument, "hidden_states: expected finite values, got ",
                     std::isnan(input.data_as<float>()[bad]) ? "NaN" : "Inf", " at token ", bad / H,
                     ", column ", bad % H);
    x_d.upload(input.data(), input.nbytes());
    const TensorView xv(x_d.data(), DType::kF32, {T, H}, dev);
    const TensorView ov(out_d.data(), DType::kF32, {T, H}, dev);
    ForwardOutputs douts{TensorView(lg_d.data(), DType::kF32, {T, num_logits}, dev),
                         TensorView(ids_d.data(), DType::kI32, {T, k}, dev),
                         TensorView(w_d.data(), DType::kF32, {T, k}, dev)};
    for (int r = 0; r < o.warmup + o.repeat; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      runner.forward(xv, ov, nullptr, nullptr, &douts);
      cuda::synchronize();
      const auto t1 = std::chrono::steady_clock::now();
      if (r >= o.warmup) times.push_back(std::chrono::duration<double>(t1 - t0).count());
    }
    runner.check_errors();  // NaN router logits, recorded on the device
    out_d.download(output.data(), output.nbytes());
    ids_d.download(topk_ids.data(), topk_ids.nbytes());
    w_d.download(topk_weights.data(), topk_weights.nbytes());
    lg_d.download(router_logits.data(), router_logits.nbytes());
#endif
  }
  std::sort(times.begin(), times.end());
  const double median = times[times.size() / 2];

  // Compare with the reference.
  bool failed = false, ref_all_zero = false;
  std::string tol_note;
  double rel = 0.0, tol = 0.0;
  if (reference.defined()) {
    const std::vector<double> ref = to_f64(reference);
    const float* out = output.data_as<float>();
    // Scaled norms: right for a reference of any magnitude. An all-zero
    // reference: equal (0) or infinitely far, never ||out|| as if relative.
    rel = bench::rel_l2(out, ref.data(), ref.size());
    if (find_non_finite(out, DType::kF32, ref.size()) >= 0)
      rel = std::numeric_limits<double>::infinity();
    ref_all_zero = std::all_of(ref.begin(), ref.end(), [](double v) { return v == 0.0; });
    // The default allows for the compute dtype and for a lossy dispatch
    // payload, which rounds the hidden states the experts see (on the HF
    // fixtures: bf16 ~3e-3 with f32 compute, fp8 e4m3 with 1x128 scales
    // 2e-2 to 4e-2; auto is lossless).
    const double compute_tol = compute_dtype == DType::kF32 ? 1e-5 : 1e-2;
    // The payload is used only by the EP all-to-all (check_ep_options
    // refuses it elsewhere); only there may it loosen the default. On the
    // GPUs bf16 is what the experts take anyway (lossless).
    const bool lossy_dispatch = o.ep_size > 1 && o.dp_size == 1;
    const double dispatch_tol = !lossy_dispatch                          ? 0.0
                                : o.dispatch_dtype == "fp8"              ? 1e-1
                                : o.dispatch_dtype == "bf16" && !on_cuda ? 1e-2
                                                                         : 0.0;
    tol = o.tolerance >= 0.0 ? o.tolerance : std::max(compute_tol, dispatch_tol);
    if (o.tolerance < 0.0 && dispatch_tol > compute_tol)
      tol_note = ", the default for --dispatch-dtype " + o.dispatch_dtype;
    // NaN never passes, nor an infinite error (an all-zero reference and a
    // non-zero output), even under --tolerance inf.
    failed = !(rel <= tol) || std::isinf(rel);
  }

  // A finite input can still overflow f32 inside the experts (|x| ~ 1e38):
  // report it rather than write NaN/Inf rows.
  if (const int64_t bad =
          find_non_finite(output.data(), DType::kF32, static_cast<size_t>(output.numel()));
      bad >= 0)
    FUSEDMOE_THROW(kInvalidArgument, "output: non-finite value at token ", bad / H, ", column ",
                   bad % H,
                   " (the input or the weights overflow f32 arithmetic, or with bf16 compute an "
                   "input beyond bf16's largest value, 3.39e38, rounded to Inf); no output "
                   "written");

  // The EP payloads as run (auto resolved): what rounded the hidden states the
  // experts saw, and the rows summed back, named in the report and the file.
  std::string payloads;
  if (parallel && o.ep_size > 1 && o.dp_size == 1) {
    const std::string dispatch =
        o.dispatch_dtype == "fp8"    ? "fp8 e4m3 (1x128 scales)"
        : o.dispatch_dtype != "auto" ? o.dispatch_dtype
        : on_cuda                    ? dtype_name(compute_dtype)
        : compute_dtype == DType::kBF16 && !config.apply_router_weight_on_input ? "bf16"
                                                                                : "f32";
    payloads = "dispatch " + dispatch + ", combine " + (on_cuda ? o.combine_dtype : "f32");
  }
  const std::string layout =
      parallel ? "ep " + std::to_string(o.ep_size) + ", tp " + std::to_string(o.tp_size) + ", dp " +
                     std::to_string(o.dp_size) +
                     (o.ep_size > 1 ? ", experts " + o.expert_placement : "") +
                     (payloads.empty() ? "" : "; " + payloads)
               : "";

  // Output file: written into its temporary now, renamed into place only after
  // the report below reached the standard output (a run that fails there, a
  // full disk or a closed pipe, leaves no file). A write that fails (a full
  // disk) drops the file, not the report: the summary is printed, then the
  // error names --output (as bench --csv).
  std::string output_error;
  if (output_file) {
    std::map<std::string, std::string> meta{{"model", utf8_replaced(model_dir)},
                                            {"model_type", info.model_type},
                                            {"layer", std::to_string(layer)},
                                            {"compute_dtype", dtype_name(compute_dtype)},
                                            {"backend", o.backend},
                                            {"producer", "fusedmoe run"}};
    if (parallel) meta["parallel"] = layout;
    try {
      naming_option("--output", [&] {
        write_safetensors(*output_file,
                          {{"output", output.view()},
                           {"topk_ids", topk_ids.view()},
                           {"topk_weights", topk_weights.view()},
                           {"router_logits", router_logits.view()}},
                          meta);
      });
    } catch (const Error& e) {
      output_error = e.what();
      output_file.reset();  // its temporary removed
    }
  }

  // Summary.
  std::printf("model          %s (%s)\n", printable(model_dir).c_str(),
              printable(info.model_type).c_str());
  std::printf("layer          %lld: %lld experts, top-%lld, H %lld, I %lld, weights %s\n",
              static_cast<long long>(layer), static_cast<long long>(config.num_experts),
              static_cast<long long>(k), static_cast<long long>(H),
              static_cast<long long>(config.intermediate_size),
              format_bytes(static_cast<double>(weight_bytes)).c_str());
  std::printf("input          %s, T = %lld\n", printable(input_desc).c_str(),
              static_cast<long long>(T));
  std::printf("compute dtype  %s\n", dtype_name(compute_dtype));
  if (parallel)
    std::printf("parallel       %d ranks (%s): %s; weights above are rank 0's share\n",
                world->size(), world->backend().c_str(), layout.c_str());
  if (on_cuda)
    std::printf("backend        cuda (device %d%s)\n", cuda_device,
                parallel ? ", NCCL one GPU per rank" : "");
  else
    std::printf("threads        %d (GEMM %s%s)\n", ThreadPool::global().num_threads(),
                cpu::cpu_isa_name(cpu::gemm_isa()),
                compute_dtype == DType::kBF16 && weights_bf16 && cpu::amx_ready()
                    ? ", bf16 experts on AMX"
                    : "");
  std::printf("time           %.3f ms (median of %d, after %d untimed)\n", median * 1e3, o.repeat,
              o.warmup);
  std::printf("throughput     %.0f tokens/s\n", median > 0 ? static_cast<double>(T) / median : 0.0);
  if (reference.defined())
    std::printf("reference      %s: relative L2 error %.3e (tolerance %.6g%s)%s: %s\n",
                printable(o.reference_key.empty() ? o.reference : o.reference_key).c_str(), rel,
                tol, tol_note.c_str(),
                T == 0         ? " (T = 0: no elements to compare)"
                : ref_all_zero ? " (the reference is all zeros)"
                               : "",
                failed ? "FAIL" : "ok");
  if (output_file)
    std::printf("output         %s (output, topk_ids, topk_weights, router_logits)\n",
                printable(o.output).c_str());
  if (!o.quiet && T > 0) {
    std::vector<int64_t> counts(static_cast<size_t>(config.num_experts), 0);
    int64_t routed = 0;
    const int32_t* ids = topk_ids.data_as<int32_t>();
    for (int64_t i = 0; i < T * k; ++i)
      if (ids[i] >= 0 && ids[i] < config.num_experts) ++counts[ids[i]], ++routed;
    print_histogram(counts, routed);
  }
  check_stdout();
  if (!output_error.empty())
    throw Error(ErrorCode::kIo, output_error + " (the report above is complete)");
  // A failed --reference check still writes the complete output (README).
  if (output_file) naming_option("--output", [&] { output_file->commit(); });
  if (failed) {
    // The tolerance is --tolerance's ("given") or the default chosen above.
    const std::string tol_source = o.tolerance >= 0.0 ? "given"
                                   : tol_note.empty() ? "(the default)"
                                                      : "(" + tol_note.substr(2) + ")";
    char buf[160];
    if (std::isinf(rel))
      std::snprintf(buf, sizeof buf, "%.3e (fails under any tolerance, %.6g %s)", rel, tol,
                    tol_source.c_str());
    else
      std::snprintf(buf, sizeof buf, "%.3e > tolerance %.6g", rel, tol);
    FUSEDMOE_THROW(kInvalidArgument, "output differs from ",
                   describe(o.reference, o.reference_key, "reference", false),
                   ": relative L2 error ", buf);
  }
  return 0;
}

}  // namespace

}  // namespace fusedmoe::cli
