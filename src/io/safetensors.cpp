// fusedmoe: safetensors reader (mmap, validated) and atomic writer.
//
// Format (huggingface/safetensors, docs "Format"): u64 little-endian header
// length N, N bytes of JSON {name: {dtype, shape, data_offsets: [begin, end]},
// "__metadata__": {str: str}}, then the data section; offsets are relative to
// the start of the data section.
#include "fusedmoe/io/safetensors.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <unordered_set>

#include "core/json_error.h"
#include "fusedmoe/core/error.h"
#include "io/python_json.h"

namespace fusedmoe {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {
// SAX handler: the first key that repeats at the top level of a JSON object
// (linear time; the values are not kept). Syntax errors throw as json::parse does.
struct TopLevelKeys : nlohmann::json_sax<json> {
  int depth = 0;
  std::unordered_set<std::string> names;
  std::string duplicate;
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override { return ++depth, true; }
  bool end_object() override { return --depth, true; }
  bool start_array(std::size_t) override { return ++depth, true; }
  bool end_array() override { return --depth, true; }
  bool key(string_t& k) override {
    if (depth == 1 && duplicate.empty() && !names.insert(k).second) duplicate = k;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    throw e;
  }
};
}  // namespace

namespace {

struct DTypeName {
  DType dtype;
  const char* name;
};
constexpr DTypeName kDTypeNames[] = {
    {DType::kF64, "F64"},
    {DType::kF32, "F32"},
    {DType::kF16, "F16"},
    {DType::kBF16, "BF16"},
    {DType::kF8E4M3FN, "F8_E4M3"},
    {DType::kF8E5M2, "F8_E5M2"},
    {DType::kI64, "I64"},
    {DType::kI32, "I32"},
    {DType::kI16, "I16"},
    {DType::kI8, "I8"},
    {DType::kU8, "U8"},
    {DType::kBool, "BOOL"},
};

// Every dtype of HF's safetensors 0.8 (its Dtype enum, in its order) and the
// bits of one element: a file holding one of those fusedmoe has no DType for
// opens (their tensors are listed, their offsets checked), only get() refuses them.
struct DTypeBits {
  const char* name;
  int bits;
};
constexpr DTypeBits kHfDTypes[] = {
    {"BOOL", 8},        {"F4", 4},      {"F6_E2M3", 6}, {"F6_E3M2", 6}, {"U8", 8},
    {"I8", 8},          {"F8_E5M2", 8}, {"F8_E4M3", 8}, {"F8_E8M0", 8}, {"F8_E4M3FNUZ", 8},
    {"F8_E5M2FNUZ", 8}, {"I16", 16},    {"U16", 16},    {"F16", 16},    {"BF16", 16},
    {"I32", 32},        {"U32", 32},    {"F32", 32},    {"C64", 64},    {"F64", 64},
    {"I64", 64},        {"U64", 64},
};

std::string hf_dtype_list() {
  std::string out;
  for (const auto& d : kHfDTypes) out += (out.empty() ? "" : " ") + std::string(d.name);
  return out;
}

std::string errno_str() {
  return std::strerror(errno);
}

std::string offsets_str(size_t b, size_t e) {
  return detail::concat("[", b, ", ", e, "]");
}

// Writes all of buf to fd; false on error.
bool write_all(int fd, const void* buf, size_t n) {
  const char* p = static_cast<const char*>(buf);
  while (n > 0) {
    ssize_t w = ::write(fd, p, std::min<size_t>(n, size_t{1} << 30));
    if (w < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

}  // namespace

DType parse_safetensors_dtype(const std::string& s) {
  for (const auto& d : kDTypeNames)
    if (s == d.name) return d.dtype;
  FUSEDMOE_THROW(kIo, "unknown safetensors dtype '", s, "' (known: ", kSupportedSafetensorsDTypes,
                 ")");
}

int safetensors_dtype_bits(std::string_view s) {
  for (const auto& d : kHfDTypes)
    if (s == d.name) return d.bits;
  return 0;
}

const char* safetensors_dtype_name(DType dtype) {
  for (const auto& d : kDTypeNames)
    if (d.dtype == dtype) return d.name;
  return "?";
}

// ---- SafetensorsFile -------------------------------------------------------

void require_regular_file(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return;
  if (!S_ISREG(st.st_mode))
    FUSEDMOE_THROW(kIo, printable(path), ": not a regular file (",
                   S_ISFIFO(st.st_mode)  ? "a FIFO"
                   : S_ISDIR(st.st_mode) ? "a directory"
                                         : "a device or socket",
                   ")");
}

bool looks_like_safetensors(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode) || st.st_size < 9) return false;
  // O_NONBLOCK: a FIFO swapped in after the check cannot block open().
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return false;
  // The header length, then the JSON's first bytes: '{', after any JSON
  // whitespace (HF's reader takes it) and UTF-8 byte-order marks (which open()
  // then refuses by name), so that a damaged header is reported as such.
  unsigned char head[8 + 64];
  const ssize_t got = ::pread(fd, head, sizeof head, 0);
  ::close(fd);
  if (got < 9) return false;
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | head[i];
  if (n < 2 || n > static_cast<uint64_t>(st.st_size) - 8) return false;
  const size_t end = 8 + static_cast<size_t>(std::min<uint64_t>(n, static_cast<uint64_t>(got) - 8));
  for (size_t i = 8; i < end;) {
    const unsigned char c = head[i];
    if (c == '{') return true;
    if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
      ++i;
    } else if (c == 0xef && i + 2 < end && head[i + 1] == 0xbb && head[i + 2] == 0xbf) {
      i += 3;
    } else {
      return false;
    }
  }
  return false;
}

std::shared_ptr<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  require_regular_file(path);
  // O_NONBLOCK: a FIFO swapped in after the check still cannot block open().
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) FUSEDMOE_THROW(kIo, printable(path), ": cannot open: ", errno_str());
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    std::string e = errno_str();
    ::close(fd);
    FUSEDMOE_THROW(kIo, printable(path), ": cannot stat: ", e);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    FUSEDMOE_THROW(kIo, printable(path), ": not a regular file");
  }
  const size_t file_size = static_cast<size_t>(st.st_size);
  if (file_size < 8) {
    ::close(fd);
    FUSEDMOE_THROW(kIo, printable(path), ": file too short (", file_size,
                   " bytes; a safetensors file starts with an 8-byte header length)");
  }
  // Read-only mapping: views returned by get() must not be written to.
  void* addr = ::mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, fd, 0);
  std::string map_err = addr == MAP_FAILED ? errno_str() : std::string();
  ::close(fd);
  if (addr == MAP_FAILED) FUSEDMOE_THROW(kIo, printable(path), ": mmap failed: ", map_err);

  std::shared_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  f->file_size_ = file_size;
  f->mapping_ = std::shared_ptr<void>(addr, [file_size](void* p) { ::munmap(p, file_size); });

  const auto* bytes = static_cast<const unsigned char*>(addr);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | bytes[i];
  if (header_len > file_size - 8)
    FUSEDMOE_THROW(kIo, printable(path), ": header length ", header_len,
                   " runs past the end of the file (", file_size, " bytes)");
  // HF's safetensors refuses a header over 100 MB (MAX_HEADER_SIZE, "HeaderTooLarge"):
  // a file that library cannot open is not taken here either.
  constexpr uint64_t kMaxHeaderBytes = 100'000'000;
  if (header_len > kMaxHeaderBytes)
    FUSEDMOE_THROW(kIo, printable(path), ": header length ", header_len,
                   " bytes is over the format's limit of ", kMaxHeaderBytes,
                   " (HF's safetensors refuses such a file: HeaderTooLarge)");
  f->data_start_ = 8 + static_cast<size_t>(header_len);
  const size_t data_size = file_size - f->data_start_;

  const char* const text = reinterpret_cast<const char*>(bytes + 8);
  // The header is JSON, which whitespace may surround (HF's writer pads it with
  // spaces). HF's safetensors parses the whole header with serde_json, so it
  // rejects a NUL byte anywhere in it ("trailing characters"), and so does this
  // reader: json reads a NUL as the end of its input and would take whatever
  // follows one (NUL padding, a cut-off header) without a word.
  // A UTF-8 byte-order mark is no JSON whitespace: serde_json, so HF's
  // safetensors, refuses a header starting with one ("expected value at line
  // 1 column 1"); json would skip it without a word.
  if (header_len >= 3 && std::memcmp(text, "\xEF\xBB\xBF", 3) == 0)
    FUSEDMOE_THROW(kIo, printable(path),
                   ": header starts with a UTF-8 byte-order mark (bytes EF BB BF at byte 8 of the "
                   "file; a header is JSON text, whitespace around it at most)");
  if (const void* nul = std::memchr(text, '\0', static_cast<size_t>(header_len)))
    FUSEDMOE_THROW(kIo, printable(path), ": header holds a NUL byte at byte ",
                   8 + (static_cast<const char*>(nul) - text),
                   " of the file (a header is JSON text, whitespace around it at most)");
  json header;
  // JSON lets a key repeat (the last one wins); a header that names a tensor
  // twice is corrupt, so a SAX pass checks the top-level keys first. (json's
  // callback parser did it in the same pass, but takes time quadratic in the
  // number of tensors: 30000 took 12 s.)
  TopLevelKeys keys;
  try {
    json::sax_parse(text, text + header_len, &keys);
    header = json::parse(text, text + header_len);
  } catch (const json::exception& e) {
    FUSEDMOE_THROW(kIo, printable(path),
                   ": header is not valid JSON: ", printable_json_error(e.what()));
  }
  const std::string& duplicate = keys.duplicate;
  if (!duplicate.empty())
    FUSEDMOE_THROW(kIo, printable(path), ": header names tensor '", duplicate,
                   "' more than once (a corrupt file: which entry is meant is unknown)");
  if (!header.is_object())
    FUSEDMOE_THROW(kIo, printable(path), ": header is not a JSON object (got ", header.type_name(),
                   ")");

  struct Span {
    size_t begin, end;
    const std::string* name;
  };
  std::vector<Span> spans;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      if (v.is_null()) continue;  // HF's reader: no metadata (Option<HashMap>)
      if (!v.is_object())
        FUSEDMOE_THROW(kIo, printable(path), ": __metadata__ is not a JSON object (got ",
                       v.type_name(), ")");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string())
          FUSEDMOE_THROW(kIo, printable(path), ": __metadata__ value of '", m.key(),
                         "' is not a string (got ", m.value().type_name(), ")");
        f->metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    auto bad = [&](const std::string& what) -> Error {
      return Error(ErrorCode::kIo,
                   detail::concat(printable(path), ": tensor '", name, "': ", what));
    };
    if (!v.is_object())
      throw bad(detail::concat("entry is not a JSON object (got ", v.type_name(), ")"));
    if (!v.contains("dtype") || !v["dtype"].is_string()) throw bad("missing or non-string 'dtype'");
    if (!v.contains("shape") || !v["shape"].is_array()) throw bad("missing or non-list 'shape'");
    if (!v.contains("data_offsets") || !v["data_offsets"].is_array() ||
        v["data_offsets"].size() != 2)
      throw bad("missing 'data_offsets' or not a list of 2 integers");
    Entry e{};
    e.dtype_name = v["dtype"].get<std::string>();
    const int bits = safetensors_dtype_bits(e.dtype_name);
    if (bits == 0)
      throw bad(detail::concat("unknown safetensors dtype '", e.dtype_name,
                               "' (known: ", hf_dtype_list(), ")"));
    for (const auto& d : kDTypeNames)
      if (e.dtype_name == d.name) e.dtype = d.dtype;
    // numel (saturating at 2^64 - 1: the shape overflows), then its bits.
    unsigned __int128 numel = 1;
    bool overflows = false;
    for (const json& d : v["shape"]) {
      if (d.is_number_unsigned() && d.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
        throw bad(detail::concat("shape ", v["shape"].dump(),
                                 " has a dimension of 2^63 or more (fusedmoe's shapes are "
                                 "signed 64-bit)"));
      if (!d.is_number_integer() || d.get<int64_t>() < 0)
        throw bad(
            detail::concat("shape ", v["shape"].dump(), " is not a list of non-negative integers"));
      e.shape.push_back(d.get<int64_t>());
      numel *= static_cast<uint64_t>(e.shape.back());
      if (numel > std::numeric_limits<uint64_t>::max())
        overflows = true, numel = std::numeric_limits<uint64_t>::max();
    }
    // As HF's reader: the element count multiplied out in order, an overflow
    // on the way refused even when a later dimension is 0 ([2^62, 8, 0]; but
    // [0, 2^62, 8] and [2^63, 0] open), then its bits, refused past 64 bits.
    const unsigned __int128 nbits = numel * static_cast<unsigned>(bits);
    const unsigned __int128 nbytes = nbits / 8;
    if (nbits > std::numeric_limits<uint64_t>::max()) overflows = true;
    const json& off = v["data_offsets"];
    for (const json& o : off) {
      // nlohmann reads an integer past 64 bits as a double.
      if (o.is_number_float() && o.get<double>() >= 18446744073709551616.0)
        throw bad(detail::concat("data_offsets ", off.dump(),
                                 " hold an offset of 2^64 or more (expected 64-bit offsets)"));
      if (!o.is_number_unsigned() && !(o.is_number_integer() && o.get<int64_t>() >= 0))
        throw bad(detail::concat("data_offsets ", off.dump(), " are not non-negative integers"));
    }
    const uint64_t b = off[0].get<uint64_t>(), en = off[1].get<uint64_t>();
    if (b > en) throw bad(detail::concat("data_offsets ", offsets_str(b, en), " has begin > end"));
    if (en > data_size)
      throw bad(detail::concat("data_offsets ", offsets_str(b, en), " end past the data section (",
                               data_size, " bytes)"));
    if (overflows)
      throw bad(detail::concat("shape ", v["shape"].dump(), " of ", e.dtype_name,
                               " overflows 64 bits (2^64 elements or bytes or more; data_offsets ",
                               offsets_str(b, en), " hold ", en - b, " bytes)"));
    // Sub-byte elements (F4, F6_*) are packed: HF's safetensors refuses a
    // tensor whose bits do not end on a byte boundary.
    if (nbits % 8 != 0)
      throw bad(detail::concat("shape ", v["shape"].dump(), " of ", e.dtype_name, " (", bits,
                               " bits an element) holds ", static_cast<uint64_t>(nbits),
                               " bits, not a whole number of bytes"));
    if (static_cast<unsigned __int128>(en - b) != nbytes)
      throw bad(detail::concat("data_offsets ", offsets_str(b, en), " hold ", en - b, " bytes but ",
                               e.dtype_name, " ", v["shape"].dump(), " needs ",
                               static_cast<uint64_t>(nbytes), " bytes (size mismatch)"));
    e.begin = static_cast<size_t>(b);
    e.end = static_cast<size_t>(en);
    auto [pos, inserted] = f->entries_.emplace(name, std::move(e));
    (void)inserted;  // JSON object keys are unique after parsing
    spans.push_back({pos->second.begin, pos->second.end, &pos->first});
  }
  // No two tensors may share bytes, and no byte between them may be left
  // unused: the tensors follow one another from offset 0 (as HF's safetensors
  // requires: "invalid offset" otherwise; a gap is damage or a bad writer, not
  // padding to skip). Empty tensors occupy nothing, but sit where the bytes
  // before them end, as HF's check has them (not inside another tensor).
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  const Span* prev = nullptr;
  for (const Span& s : spans) {
    if (s.begin == s.end) {
      const size_t at = prev ? prev->end : 0;
      if (s.begin != at)
        FUSEDMOE_THROW(kIo, printable(path), ": empty tensor '", *s.name, "': data_offsets ",
                       offsets_str(s.begin, s.end), " expected [", at, ", ", at,
                       "], where the bytes before it end (a safetensors file's tensors follow "
                       "one another from offset 0)");
      continue;
    }
    if (prev && s.begin < prev->end)
      FUSEDMOE_THROW(kIo, printable(path), ": tensor '", *s.name, "': data_offsets ",
                     offsets_str(s.begin, s.end), " overlap tensor '", *prev->name, "' ",
                     offsets_str(prev->begin, prev->end));
    const size_t covered = prev ? prev->end : 0;
    if (s.begin > covered)
      FUSEDMOE_THROW(kIo, printable(path), ": tensor '", *s.name, "': data_offsets ",
                     offsets_str(s.begin, s.end), " leave the bytes ",
                     offsets_str(covered, s.begin), " of the data section unused (",
                     prev ? "expected begin " + std::to_string(covered) + ", where tensor '" +
                                *prev->name + "' " + offsets_str(prev->begin, prev->end) + " ends"
                          : std::string("expected begin 0, the first tensor's"),
                     "); a safetensors file's tensors follow one another from offset 0");
    prev = &s;
  }
  // The data section ends with the last tensor's bytes (as HF's safetensors
  // requires: "incomplete buffer" otherwise): bytes past it are damage
  // (two files joined, a bad write), not data to ignore.
  const size_t data_end = prev ? prev->end : 0;
  if (data_end != data_size)
    FUSEDMOE_THROW(kIo, printable(path), ": ", data_size - data_end,
                   data_size - data_end == 1 ? " byte" : " bytes",
                   " after the last tensor's data (the data section holds ", data_size,
                   " bytes, the tensors end at ", data_end,
                   "); a safetensors file ends with its last tensor's bytes");
  return f;
}

SafetensorsFile::~SafetensorsFile() = default;

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(entries_.size());
  for (const auto& [name, e] : entries_) out.push_back(name);
  return out;
}

bool SafetensorsFile::contains(const std::string& name) const {
  return entries_.count(name) != 0;
}

SafetensorsFile::Info SafetensorsFile::info(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) FUSEDMOE_THROW(kIo, printable(path_), ": no tensor named '", name, "'");
  const Entry& e = it->second;
  return Info{e.dtype_name, e.dtype, e.shape, e.end - e.begin};
}

Tensor SafetensorsFile::get(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) FUSEDMOE_THROW(kIo, printable(path_), ": no tensor named '", name, "'");
  const Entry& e = it->second;
  if (!e.dtype)
    FUSEDMOE_THROW(kUnsupported, printable(path_), ": tensor '", name, "': dtype ", e.dtype_name,
                   " is not supported by fusedmoe (supported: ", kSupportedSafetensorsDTypes, ")");
  if (e.shape.size() > static_cast<size_t>(kMaxDims))
    FUSEDMOE_THROW(kUnsupported, printable(path_), ": tensor '", name, "' has ", e.shape.size(),
                   " dimensions; at most ", kMaxDims, " are supported");
  char* base = static_cast<char*>(mapping_.get()) + data_start_ + e.begin;
  TensorView view(base, *e.dtype, std::span<const int64_t>(e.shape.data(), e.shape.size()));
  return Tensor(view, mapping_);
}

// ---- Checkpoint ------------------------------------------------------------

Checkpoint Checkpoint::open(const std::string& path) {
  if (path.empty())
    FUSEDMOE_THROW(kIo,
                   "Checkpoint::open: the path is empty (expected a .safetensors file, a "
                   "sharded index or a model folder)");
  Checkpoint c;
  c.path_ = path;
  std::error_code ec;
  fs::path p(path);
  fs::path index;
  // A model's config.json stands for its directory (as load_model_info takes it).
  if (p.filename() == "config.json" && fs::is_regular_file(p, ec))
    p = p.has_parent_path() ? p.parent_path() : fs::path(".");
  if (fs::is_directory(p, ec)) {
    // model.safetensors first, then the index: transformers' from_pretrained
    // order. A name that is there (a dangling link too) is taken: opening it
    // then says what is wrong with it, not that it is missing.
    const auto there = [&](const fs::path& q) {
      return fs::symlink_status(q, ec).type() != fs::file_type::not_found &&
             fs::symlink_status(q, ec).type() != fs::file_type::none;
    };
    if (there(p / "model.safetensors")) {
      p = p / "model.safetensors";
    } else if (there(p / "model.safetensors.index.json")) {
      index = p / "model.safetensors.index.json";
    } else {
      FUSEDMOE_THROW(kIo, printable(path),
                     ": checkpoint directory has neither model.safetensors nor "
                     "model.safetensors.index.json");
    }
  } else if (p.extension() == ".json" && !looks_like_safetensors(p.string())) {
    index = p;  // (a .safetensors file is told by content, whatever its name)
  }
  if (index.empty()) {
    auto file = SafetensorsFile::open(p.string());
    for (const auto& n : file->names()) c.weight_map_[n] = file->path();
    c.shards_[file->path()] = file;
    return c;
  }
  c.index_ = index.string();
  // Sharded: {"metadata": {...}, "weight_map": {"tensor": "shard file", ...}}.
  std::string text;
  {
    require_regular_file(index.string());
    FILE* fp = std::fopen(index.c_str(), "rb");
    if (!fp) FUSEDMOE_THROW(kIo, printable(index.string()), ": cannot open: ", errno_str());
    char buf[65536];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, fp)) > 0) text.append(buf, n);
    bool err = std::ferror(fp);
    std::fclose(fp);
    if (err) FUSEDMOE_THROW(kIo, printable(index.string()), ": read error");
  }
  // As Python's json reads it (transformers' sharded loading): a BOM refused, NaN in metadata
  // taken.
  json j =
      detail::parse_python_json(text, printable(index.string()), "a model.safetensors.index.json");
  if (!j.is_object())
    FUSEDMOE_THROW(kIo, printable(index.string()),
                   ": expected a JSON object with a 'weight_map' object, got a JSON ",
                   j.type_name());
  if (!j.contains("weight_map"))
    FUSEDMOE_THROW(kIo, printable(index.string()), ": no 'weight_map' object");
  if (!j["weight_map"].is_object())
    FUSEDMOE_THROW(kIo, printable(index.string()),
                   ": 'weight_map' must be an object (tensor name -> shard file), got a JSON ",
                   j["weight_map"].type_name());
  const fs::path dir = index.parent_path();
  for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
    if (!it.value().is_string())
      FUSEDMOE_THROW(kIo, printable(index.string()), ": weight_map entry '", printable(it.key()),
                     "' is not a string");
    // A shard lies in the model's folder (or below it): an index must not
    // lead the reader to any other file (lexically: symbolic links in the
    // folder, as a Hugging Face cache has, are followed; a ".." is checked
    // against the folders the OS finds when a tensor is read).
    const std::string shard = it.value().get<std::string>();
    // A NUL ends the name the OS sees: the file opened would be another
    // (Python's open() refuses such a path: "embedded null byte").
    if (const size_t nul = shard.find('\0'); nul != std::string::npos)
      FUSEDMOE_THROW(kIo, printable(index.string()), ": weight_map entry '", printable(it.key()),
                     "': \"", printable(shard), "\" holds a NUL byte (at ", nul,
                     "), which no file name can; expected a shard file name");
    const fs::path rel = fs::path(shard).lexically_normal();
    if (shard.empty() || rel.is_absolute() || rel.has_root_name() || rel.begin() == rel.end() ||
        *rel.begin() == ".." || rel == ".")
      FUSEDMOE_THROW(kIo, printable(index.string()), ": weight_map entry '", it.key(), "\': \"",
                     printable(shard), "\" is not a file inside the model folder ",
                     dir.empty() ? std::string(".") : printable(dir.string()),
                     " (expected a shard file name relative to it)");
    c.weight_map_[it.key()] = (dir / rel).string();
    // A ".." is resolved by the OS, not lexically: shard_of() checks that it
    // steps out of a folder that is there (see check_dotdot).
    const fs::path given(shard);
    if (std::find(given.begin(), given.end(), fs::path("..")) != given.end())
      c.dotdot_[it.key()] = shard;
  }
  return c;
}

std::vector<std::string> Checkpoint::files() const {
  std::vector<std::string> out;
  if (!index_.empty()) out.push_back(index_);
  std::set<std::string> seen;
  for (const auto& [name, shard] : weight_map_)
    if (seen.insert(shard).second) out.push_back(shard);
  return out;
}

bool Checkpoint::contains(const std::string& name) const {
  return weight_map_.count(name) != 0;
}

namespace {
// `shard` (a weight_map entry, relative to `dir`, holding ".." and inside the
// folder lexically) as the OS resolves it must be the file its lexically
// normal form names, which the reader opens: every folder a ".." steps out
// of exists, is a directory (else opening the path fails: ENOENT, ENOTDIR, as
// it does for HF's reader), and its ".." is the folder its name says (not
// another, through a symbolic link). Throws Error(kIo) naming the path.
void check_dotdot(const fs::path& dir, const std::string& shard) {
  const std::string path = printable((dir / shard).string());
  fs::path at = dir;
  for (const fs::path& c : fs::path(shard)) {
    if (c == "..") {
      const fs::path folder = at.empty() ? fs::path(".") : at;
      struct stat st {};
      const int err = ::stat(folder.c_str(), &st) != 0 ? errno : !S_ISDIR(st.st_mode) ? ENOTDIR : 0;
      if (err != 0)
        FUSEDMOE_THROW(kIo, path, ": cannot open: ", std::strerror(err), " (",
                       printable(folder.string()), ", which '..' steps out of, ",
                       err == ENOENT ? "does not exist" : "is no directory", ")");
      // The folder `folder/..` names (lexically_normal leaves "a/" of "a/b/.."
      // or "a/b/./..": its trailing separator dropped).
      std::string named_s = (folder / "..").lexically_normal().string();
      while (named_s.size() > 1 && named_s.back() == '/') named_s.pop_back();
      const fs::path named = named_s.empty() ? fs::path(".") : fs::path(named_s);
      std::error_code ec;
      if (!fs::equivalent(folder / "..", named, ec) || ec)
        FUSEDMOE_THROW(kIo, path, ": ", printable((folder / "..").string()), " is not ",
                       printable(named.string()), " as the OS resolves it (",
                       printable(folder.string()),
                       " is a symbolic link); expected a shard path whose '..' steps back out "
                       "of a folder of the model");
    }
    at /= c;
  }
}
}  // namespace

const SafetensorsFile& Checkpoint::shard_of(const std::string& name) const {
  auto it = weight_map_.find(name);
  if (it == weight_map_.end())
    FUSEDMOE_THROW(kIo, printable(path_), ": no tensor named '", name, "'");
  const auto dotdot = dotdot_.find(name);
  auto& shard = shards_[it->second];
  if (!shard || dotdot != dotdot_.end()) {
    try {
      if (dotdot != dotdot_.end()) check_dotdot(fs::path(index_).parent_path(), dotdot->second);
      if (!shard) shard = SafetensorsFile::open(it->second);
    } catch (const Error& e) {
      // A shard of an index: which one the index names, and for what tensor.
      if (index_.empty()) throw;
      throw Error(e.code(),
                  printable(index_) + ": the shard of tensor '" + name + "': " + e.what());
    }
  }
  if (!shard->contains(name))
    FUSEDMOE_THROW(kIo, printable(path_), ": the index maps tensor '", name, "\' to ",
                   printable(it->second), ", which has no tensor of that name");
  return *shard;
}

Tensor Checkpoint::get(const std::string& name) const {
  return shard_of(name).get(name);
}

SafetensorsFile::Info Checkpoint::info(const std::string& name) const {
  return shard_of(name).info(name);
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  out.reserve(weight_map_.size());
  for (const auto& [n, s] : weight_map_) out.push_back(n);
  return out;
}

// ---- writer ----------------------------------------------------------------

namespace {

// The header and the tensors' order of a safetensors file, after checking the
// names and inputs (before anything touches the disk).
struct SafetensorsLayout {
  std::vector<size_t> order;
  std::string header;
};
// The header is JSON, which is UTF-8 text: a name or metadata string that is not
// (bytes of a path in another encoding, say) is named, as nlohmann's dump() refuses it.
void check_utf8(const std::string& text, const char* what) {
  try {
    (void)json(text).dump();
  } catch (const json::type_error&) {
    FUSEDMOE_THROW(kInvalidArgument, "save_safetensors: ", what, " \"", text,
                   "\" is not valid UTF-8 (a safetensors header is JSON text)");
  }
}

SafetensorsLayout safetensors_layout(const std::vector<std::pair<std::string, TensorView>>& tensors,
                                     const std::map<std::string, std::string>& metadata) {
  // Validate names and inputs before touching the disk.
  for (const auto& [k, v] : metadata) {
    check_utf8(k, "metadata key");
    check_utf8(v, ("metadata value of '" + k + "'").c_str());
  }
  std::set<std::string> seen;
  for (const auto& [name, t] : tensors) {
    check_utf8(name, "tensor name");
    FUSEDMOE_CHECK(name != "__metadata__",
                   "save_safetensors: '__metadata__' is not a valid tensor name");
    FUSEDMOE_CHECK(seen.insert(name).second, "save_safetensors: duplicate tensor name '", name,
                   "'");
    FUSEDMOE_CHECK(t.device().is_cpu(), "save_safetensors: tensor '", name, "' is not on the CPU");
    FUSEDMOE_CHECK(t.numel() == 0 || t.data() != nullptr, "save_safetensors: tensor '", name,
                   "' is undefined");
  }
  // Order as the reference writer does: larger alignment first, then by name.
  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    size_t sa = dtype_size(tensors[a].second.dtype()), sb = dtype_size(tensors[b].second.dtype());
    if (sa != sb) return sa > sb;
    return tensors[a].first < tensors[b].first;
  });
  json header = json::object();
  if (!metadata.empty()) {
    json m = json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    header["__metadata__"] = m;
  }
  size_t offset = 0;
  for (size_t i : order) {
    const auto& [name, t] = tensors[i];
    json shape = json::array();
    for (int64_t d : t.shape()) shape.push_back(d);
    header[name] = {{"dtype", safetensors_dtype_name(t.dtype())},
                    {"shape", shape},
                    {"data_offsets", {offset, offset + t.nbytes()}}};
    offset += t.nbytes();
  }
  std::string h = header.dump();
  while (h.size() % 8 != 0) h.push_back(' ');  // data section 8-byte aligned
  return {std::move(order), std::move(h)};
}

void write_layout(AtomicFile& file, const SafetensorsLayout& layout,
                  const std::vector<std::pair<std::string, TensorView>>& tensors) {
  const std::string& h = layout.header;
  const std::vector<size_t>& order = layout.order;
  unsigned char len_le[8];
  uint64_t hl = h.size();
  for (int i = 0; i < 8; ++i) len_le[i] = static_cast<unsigned char>(hl >> (8 * i));
  file.write(len_le, 8);
  file.write(h);
  for (size_t i : order) {
    const TensorView& t = tensors[i].second;
    if (t.numel() == 0) continue;
    if (t.is_contiguous()) {
      file.write(t.data(), t.nbytes());
    } else {
      const Tensor c = Tensor::copy_of(t);
      file.write(c.data(), c.nbytes());
    }
  }
}

}  // namespace

void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, TensorView>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  const SafetensorsLayout layout = safetensors_layout(tensors, metadata);
  AtomicFile file(path);
  write_layout(file, layout, tensors);
  file.commit();
}

void write_safetensors(AtomicFile& file,
                       const std::vector<std::pair<std::string, TensorView>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  write_layout(file, safetensors_layout(tensors, metadata), tensors);
}

// ---- AtomicFile --------------------------------------------------------------

namespace {
// The temporaries of live AtomicFiles, for remove_pending_temporaries() from a
// signal handler: fixed storage, slot states 0 free, 1 being written, 2 set.
constexpr int kTempSlots = 16;
struct TempSlot {
  std::atomic<int> state{0};
  char path[4096];
};
TempSlot g_temps[kTempSlots];

int register_temp(const std::string& path) {
  if (path.size() >= sizeof(TempSlot::path)) return -1;
  for (int i = 0; i < kTempSlots; ++i) {
    int expected = 0;
    if (g_temps[i].state.compare_exchange_strong(expected, 1)) {
      std::memcpy(g_temps[i].path, path.c_str(), path.size() + 1);
      g_temps[i].state.store(2);
      return i;
    }
  }
  return -1;  // more than kTempSlots at once: that one is not removed on a signal
}
void unregister_temp(int slot) {
  if (slot >= 0) g_temps[slot].state.store(0);
}
}  // namespace

void AtomicFile::remove_pending_temporaries() noexcept {
  for (TempSlot& t : g_temps)
    if (t.state.load() == 2) ::unlink(t.path);
}

namespace {
// mkstemp's template, the end of every temporary's name: replaced by as many
// letters or digits.
constexpr std::string_view kTempSuffix = "XXXXXX";
// ".<name>.fusedmoe-tmp.": the start of every temporary of a target named <name>.
std::string temp_prefix(const fs::path& target) {
  // Appended piece by piece: "." + name + "..." made GCC 12 warn (-Wrestrict,
  // a false positive in its inlined string concatenation) in Release builds.
  static constexpr std::string_view kTag = ".fusedmoe-tmp.";
  const std::string name = target.filename().string();
  std::string prefix;
  prefix.reserve(1 + name.size() + kTag.size());
  prefix.push_back('.');
  prefix.append(name);
  prefix.append(kTag);
  return prefix;
}
}  // namespace

std::vector<std::string> AtomicFile::remove_stale_temporaries(const std::string& target) {
  std::vector<std::string> removed;
  const fs::path t(target);
  if (t.filename().empty()) return removed;
  fs::path dir = t.parent_path();
  if (dir.empty()) dir = ".";
  const std::string prefix = temp_prefix(t);
  std::error_code ec;
  fs::directory_iterator it(dir, ec), end;
  for (; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    // <pid>.<suffix>: decimal digits, a dot, then mkstemp's letters or digits, as
    // many as kTempSuffix has (a longer or other suffix is not ours: left alone).
    size_t at = prefix.size();
    long long pid = 0;
    while (at < name.size() && name[at] >= '0' && name[at] <= '9' && pid <= INT_MAX)
      pid = pid * 10 + (name[at++] - '0');
    if (at == prefix.size() || pid <= 0 || pid > INT_MAX ||
        name.size() != at + 1 + kTempSuffix.size() || name[at] != '.' ||
        !std::all_of(name.begin() + static_cast<std::ptrdiff_t>(at) + 1, name.end(),
                     [](char ch) { return std::isalnum(static_cast<unsigned char>(ch)) != 0; }))
      continue;
    if (static_cast<pid_t>(pid) == ::getpid()) continue;  // ours: a live AtomicFile
    // Another process's: kept unless that process is gone (EPERM: it runs, as
    // another user).
    if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;
    struct stat st {};
    if (::lstat(it->path().c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    if (::unlink(it->path().c_str()) == 0) removed.push_back(it->path().string());
  }
  return removed;
}

AtomicFile::AtomicFile(const std::string& path) : path_(path) {
  FUSEDMOE_CHECK(!path.empty(), "output file: expected a path, got an empty string");
  // The file is replaced by a rename, so only a regular file (or nothing) may be
  // there: a device, FIFO or directory is refused, a symbolic link is written
  // through (its target is replaced), never replaced itself.
  fs::path target(path);
  std::error_code ec;
  if (fs::is_symlink(fs::symlink_status(target, ec))) {
    const fs::path resolved = fs::canonical(target, ec);
    if (!ec)
      target = resolved;
    else if (!fs::exists(fs::status(target, ec)))
      FUSEDMOE_THROW(kIo, printable(path), ": symbolic link to a missing file (", ec.message(),
                     ")");
    // else a link the kernel follows but that names no path (/dev/stdout to a pipe):
    // what it leads to is judged below.
  }
  const fs::file_status st = fs::status(target, ec);
  if (fs::exists(st) && !fs::is_regular_file(st))
    FUSEDMOE_THROW(kIo, printable(path), ": exists and is not a regular file (",
                   fs::is_directory(st) ? "a directory" : "a device, FIFO or socket",
                   "; will not replace it)");
  replaces_ = fs::exists(st);
  fs::path dir = target.parent_path();
  if (dir.empty()) dir = ".";
  if (replaces_) {
    mode_ = static_cast<unsigned>(st.permissions()) & 07777;
    struct stat fst {};
    const bool have_owner = ::stat(target.c_str(), &fst) == 0;
    const uid_t me = ::geteuid();
    // The rename would replace a file its mode says may not be written: a file
    // without any write bit (root may write it, and passes access()) or one
    // this user may not write.
    const bool no_write_bit = (mode_ & 0222) == 0;
    if (no_write_bit || (::access(target.c_str(), W_OK) != 0 && errno == EACCES)) {
      char mode[8];
      std::snprintf(mode, sizeof mode, "%04o", mode_ & 07777u);
      if (no_write_bit)
        FUSEDMOE_THROW(kIo, printable(path), ": is read-only (mode ", mode,
                       "); will not replace it (make it writable, or give another path)");
      FUSEDMOE_THROW(kIo, printable(path), ": is not writable by this user (uid ",
                     static_cast<long>(me), "; the file's owner uid ",
                     have_owner ? static_cast<long>(fst.st_uid) : -1L, ", mode ", mode,
                     "); will not replace it (give another path)");
    }
    // In a sticky directory (/tmp) only the file's or the directory's owner
    // (or root) may replace a file: the rename would fail after the work.
    struct stat dst {};
    if (me != 0 && have_owner && ::stat(dir.c_str(), &dst) == 0 && (dst.st_mode & S_ISVTX) != 0 &&
        fst.st_uid != me && dst.st_uid != me)
      FUSEDMOE_THROW(kIo, printable(path), ": belongs to another user (uid ",
                     static_cast<long>(fst.st_uid), ") in a sticky directory (",
                     printable(dir.string()),
                     ": only a file's owner may replace it); will not replace it (give another "
                     "path)");
  } else {
    const mode_t mask = ::umask(0);
    ::umask(mask);
    mode_ = 0666 & ~mask;
  }
  target_ = target.string();
  // Those a killed process left (SIGKILL runs no handler), then ours.
  removed_stale_ = remove_stale_temporaries(target_);
  tmp_ = (dir / (temp_prefix(target) + std::to_string(::getpid()) + "." + std::string(kTempSuffix)))
             .string();
  fd_ = ::mkstemp(tmp_.data());
  if (fd_ < 0) {
    const int err = errno;
    const std::string why = errno_str();
    const std::string tmp_name = fs::path(tmp_).filename().string();
    FUSEDMOE_THROW(kIo, printable(path), ": cannot create a temporary file in ",
                   printable(dir.string()), ": ", why,
                   err == ENAMETOOLONG
                       ? " (the temporary's name is " + std::to_string(tmp_name.size()) +
                             " bytes: the output's " +
                             std::to_string(target.filename().string().size()) + " and " +
                             std::to_string(tmp_name.size() - target.filename().string().size()) +
                             " more; give a shorter name)"
                       : std::string());
  }
  slot_ = register_temp(tmp_);
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(tmp_.c_str());
  }
  unregister_temp(slot_);
}

void AtomicFile::fail(const char* what) {
  const std::string e = errno_str();
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  ::unlink(tmp_.c_str());
  unregister_temp(slot_);
  slot_ = -1;
  FUSEDMOE_THROW(kIo, printable(path_), ": ", what, ": ", e);
}

void AtomicFile::write(const void* data, size_t bytes) {
  FUSEDMOE_CHECK(fd_ >= 0, printable(path_), ": AtomicFile::write after commit");
  if (!write_all(fd_, data, bytes)) fail("write failed");
}

void AtomicFile::commit() {
  FUSEDMOE_CHECK(fd_ >= 0, printable(path_), ": AtomicFile::commit called twice");
  // mkstemp made the temporary 0600.
  if (::fchmod(fd_, static_cast<mode_t>(mode_)) != 0) fail("chmod failed");
  if (::fsync(fd_) != 0) fail("fsync failed");
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) {
    const std::string e = errno_str();
    ::unlink(tmp_.c_str());
    FUSEDMOE_THROW(kIo, printable(path_), ": close failed: ", e);
  }
  if (::rename(tmp_.c_str(), target_.c_str()) != 0) {
    const std::string e = errno_str();
    ::unlink(tmp_.c_str());
    FUSEDMOE_THROW(kIo, printable(path_), ": rename failed: ", e);
  }
  unregister_temp(slot_);
  slot_ = -1;
}

}  // namespace fusedmoe
