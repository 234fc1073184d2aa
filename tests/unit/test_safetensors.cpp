// Tests of the safetensors reader/writer and Checkpoint (io/safetensors.h).
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <tuple>

#include "expect_error.h"
#include "fixtures.h"
#include "fusedmoe/io/safetensors.h"
#include "test_util.h"

namespace fusedmoe {
namespace {

namespace fs = std::filesystem;
using test::TempDir;

using test::error_of;

// Writes an 8-byte LE length, the header text and `data` bytes.
void write_raw(const std::string& path, const std::string& header, size_t data_bytes,
               std::optional<uint64_t> len_override = std::nullopt) {
  std::ofstream out(path, std::ios::binary);
  uint64_t n = len_override.value_or(header.size());
  unsigned char le[8];
  for (int i = 0; i < 8; ++i) le[i] = static_cast<unsigned char>(n >> (8 * i));
  out.write(reinterpret_cast<const char*>(le), 8);
  out << header;
  std::string data(data_bytes, '\x5a');
  out << data;
}

Tensor random_bytes_tensor(std::mt19937_64& rng, DType dt, std::initializer_list<int64_t> shape) {
  Tensor t = Tensor::empty(dt, shape);
  auto* p = static_cast<unsigned char*>(t.data());
  for (size_t i = 0; i < t.nbytes(); ++i) p[i] = static_cast<unsigned char>(rng());
  if (dt == DType::kBool)
    for (size_t i = 0; i < t.nbytes(); ++i) p[i] &= 1;
  return t;
}

TEST(Safetensors, DtypeNamesRoundTrip) {
  const DType all[] = {DType::kF64,      DType::kF32,    DType::kF16, DType::kBF16,
                       DType::kF8E4M3FN, DType::kF8E5M2, DType::kI64, DType::kI32,
                       DType::kI16,      DType::kI8,     DType::kU8,  DType::kBool};
  for (DType d : all) EXPECT_EQ(parse_safetensors_dtype(safetensors_dtype_name(d)), d);
  EXPECT_STREQ(safetensors_dtype_name(DType::kBF16), "BF16");
  EXPECT_STREQ(safetensors_dtype_name(DType::kF8E4M3FN), "F8_E4M3");
  EXPECT_HAS(error_of([] { parse_safetensors_dtype("F7"); }), "'F7'");
  // kSupportedSafetensorsDTypes (the list messages give) is exactly these names.
  std::istringstream listed(kSupportedSafetensorsDTypes);
  std::vector<std::string> names;
  for (std::string n; listed >> n;) names.push_back(n);
  ASSERT_EQ(names.size(), std::size(all));
  for (size_t i = 0; i < std::size(all); ++i) EXPECT_EQ(names[i], safetensors_dtype_name(all[i]));
}

TEST(Safetensors, RoundTripAllDtypesAndMetadata) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  TempDir dir("st_roundtrip");
  const DType all[] = {DType::kF64,      DType::kF32,    DType::kF16, DType::kBF16,
                       DType::kF8E4M3FN, DType::kF8E5M2, DType::kI64, DType::kI32,
                       DType::kI16,      DType::kI8,     DType::kU8,  DType::kBool};
  std::vector<Tensor> keep;
  std::vector<std::pair<std::string, TensorView>> tensors;
  int i = 0;
  for (DType d : all) {
    keep.push_back(random_bytes_tensor(rng, d, {3, 5 + i % 3, 2}));
    tensors.emplace_back(std::string("t.") + dtype_name(d), keep.back());
    ++i;
  }
  // A 0-d scalar, an empty tensor and a non-contiguous (transposed) view.
  keep.push_back(random_bytes_tensor(rng, DType::kF32, {1}));
  tensors.emplace_back("scalar",
                       TensorView(keep.back().data(), DType::kF32, std::span<const int64_t>()));
  keep.push_back(Tensor::empty(DType::kF32, {0, 7}));
  tensors.emplace_back("empty", keep.back());
  keep.push_back(random_bytes_tensor(rng, DType::kF32, {4, 6}));
  const int64_t tshape[] = {6, 4}, tstrides[] = {1, 6};
  const TensorView transposed(keep.back().data(), DType::kF32, tshape, tstrides);
  tensors.emplace_back("transposed", transposed);

  const std::map<std::string, std::string> meta = {{"format", "pt"},
                                                   {"seed", std::to_string(seed)}};
  const std::string path = dir.file("x.safetensors");
  save_safetensors(path, tensors, meta);

  // Header length is a multiple of 8 (data section aligned), like the reference writer.
  {
    std::ifstream in(path, std::ios::binary);
    unsigned char le[8];
    in.read(reinterpret_cast<char*>(le), 8);
    uint64_t n = 0;
    for (int b = 7; b >= 0; --b) n = (n << 8) | le[b];
    EXPECT_EQ(n % 8, 0u);
  }

  auto f = SafetensorsFile::open(path);
  EXPECT_EQ(f->metadata(), meta);
  std::vector<std::string> expected_names;
  for (const auto& [n, t] : tensors) expected_names.push_back(n);
  std::sort(expected_names.begin(), expected_names.end());
  EXPECT_EQ(f->names(), expected_names);
  for (size_t k = 0; k + 1 < tensors.size(); ++k) {  // the transposed one is checked below
    const auto& [name, src] = tensors[k];
    SCOPED_TRACE(name);
    ASSERT_TRUE(f->contains(name));
    Tensor t = f->get(name);
    EXPECT_EQ(t.dtype(), src.dtype());
    EXPECT_EQ(t.shape_str(), src.shape_str());
    EXPECT_TRUE(t.view().is_contiguous());
    ASSERT_EQ(t.nbytes(), src.nbytes());
    if (src.nbytes() > 0) EXPECT_EQ(std::memcmp(t.data(), src.data(), src.nbytes()), 0);
  }
  Tensor tr = f->get("transposed");
  ASSERT_EQ(tr.shape_str(), "[6, 4]");
  for (int64_t r = 0; r < 6; ++r)
    for (int64_t c = 0; c < 4; ++c)
      EXPECT_EQ(float_bits(tr.data_as<float>()[r * 4 + c]),
                float_bits(keep.back().data_as<float>()[c * 6 + r]));

  // Zero copy: the data lies inside the file mapping, which the tensor keeps alive.
  Tensor a = f->get("t.f32");
  const auto* base = static_cast<const char*>(a.storage().get());
  const auto size = fs::file_size(path);
  const auto* p = static_cast<const char*>(a.data());
  EXPECT_GE(p, base + 8);
  EXPECT_LE(p + a.nbytes(), base + size);
  EXPECT_EQ(f->get("t.bf16").storage().get(), a.storage().get());
  std::vector<char> copy(p, p + a.nbytes());
  f.reset();  // the file object goes away; the tensor still reads the mapping
  EXPECT_EQ(std::memcmp(a.data(), copy.data(), copy.size()), 0);
  EXPECT_EQ(std::memcmp(a.data(), keep[1].data(), keep[1].nbytes()), 0);
}

TEST(Safetensors, OpensFixture) {
  auto f = SafetensorsFile::open(test::hf_fixture_dir("mixtral") + "/model.safetensors");
  Tensor g = f->get("model.layers.0.block_sparse_moe.gate.weight");
  EXPECT_EQ(g.view().str(), "bf16 [8, 128]");
  EXPECT_EQ(f->metadata().at("format"), "pt");
}

TEST(Safetensors, MissingTensorNamed) {
  TempDir dir("st_missing");
  Tensor t = Tensor::zeros(DType::kF32, {2});
  const std::string path = dir.file("a.safetensors");
  save_safetensors(path, {{"a", t}});
  auto f = SafetensorsFile::open(path);
  EXPECT_FALSE(f->contains("b"));
  const std::string msg = error_of([&] { f->get("b.weight"); });
  EXPECT_EQ(msg.rfind(path, 0), 0u) << msg;
  EXPECT_HAS(msg, "no tensor named 'b.weight'");
}

struct BadCase {
  const char* what;
  std::string header;
  size_t data_bytes;
  std::optional<uint64_t> len_override;
  std::vector<std::string> substrings;
};

// Told by content, whatever the name (inspect and run --model take a checkpoint so).
TEST(Safetensors, LooksLikeSafetensorsByContent) {
  TempDir dir("st_sniff");
  const std::string fixture = test::hf_fixture_dir("mixtral");
  EXPECT_TRUE(looks_like_safetensors(fixture + "/model.safetensors"));
  EXPECT_FALSE(looks_like_safetensors(fixture + "/config.json"));
  fs::copy_file(fixture + "/model.safetensors", dir.path() + "/weights.st");
  EXPECT_TRUE(looks_like_safetensors(dir.path() + "/weights.st"));
  // Named .json, a checkpoint is still opened as the file it is, not as an
  // index (run --model took it by name; session 27's second trial).
  fs::copy_file(fixture + "/model.safetensors", dir.path() + "/weights.json");
  EXPECT_EQ(Checkpoint::open(dir.path() + "/weights.json").names(),
            Checkpoint::open(fixture + "/model.safetensors").names());
  write_raw(dir.path() + "/empty-header.bin", "{}", 0);
  EXPECT_TRUE(looks_like_safetensors(dir.path() + "/empty-header.bin"));
  // A header length past the end, a header that is no JSON object, too short a file.
  write_raw(dir.path() + "/long.bin", "{}", 0, 1000);
  EXPECT_FALSE(looks_like_safetensors(dir.path() + "/long.bin"));
  write_raw(dir.path() + "/array.bin", "[1, 2]", 0);
  EXPECT_FALSE(looks_like_safetensors(dir.path() + "/array.bin"));
  write_raw(dir.path() + "/short.bin", "", 0);
  EXPECT_FALSE(looks_like_safetensors(dir.path() + "/short.bin"));
  EXPECT_FALSE(looks_like_safetensors(dir.path() + "/missing.st"));
  EXPECT_FALSE(looks_like_safetensors(dir.path()));  // a directory
  // JSON whitespace before the object (HF's reader takes it), and a UTF-8
  // byte-order mark (open() refuses it by name: inspect and run --model report
  // that, not "expected a model directory"; session 27's trial).
  write_raw(dir.path() + "/space.bin", " \n\t{}", 0);
  EXPECT_TRUE(looks_like_safetensors(dir.path() + "/space.bin"));
  EXPECT_NO_THROW(SafetensorsFile::open(dir.path() + "/space.bin"));
  write_raw(dir.path() + "/bom.bin", "\xEF\xBB\xBF{}", 0);
  EXPECT_TRUE(looks_like_safetensors(dir.path() + "/bom.bin"));
  EXPECT_HAS(error_of([&] { SafetensorsFile::open(dir.path() + "/bom.bin"); }, ErrorCode::kIo),
             "header starts with a UTF-8 byte-order mark");
  write_raw(dir.path() + "/space-text.bin", "  x{}", 0);
  EXPECT_FALSE(looks_like_safetensors(dir.path() + "/space-text.bin"));
}

// A header over 100 MB is refused as HF's safetensors refuses it (HeaderTooLarge;
// session 30's trial: it was read). The file is sparse: no 100 MB written.
TEST(Safetensors, HeaderOverTheFormatsLimitIsRefused) {
  TempDir dir("st_huge_header");
  const std::string path = dir.file("huge.safetensors");
  write_raw(path, "{}", 0, 100'000'001);
  std::filesystem::resize_file(path, 100'000'100);
  EXPECT_HAS(error_of([&] { SafetensorsFile::open(path); }, ErrorCode::kIo),
             "header length 100000001 bytes is over the format's limit of 100000000");
  write_raw(path, "{}", 0, 100'000'000);  // at the limit: read (here NUL bytes follow the {})
  std::filesystem::resize_file(path, 100'000'100);
  EXPECT_HAS(error_of([&] { SafetensorsFile::open(path); }, ErrorCode::kIo),
             "header holds a NUL byte at byte 10 of the file");
}

// Zero-element shapes open where HF's reader opens them (the 0 before the
// large dimensions). A dimension of 2^63 or more (HF takes [2^63, 0]) is
// beyond fusedmoe's signed 64-bit shapes: said so.
TEST(Safetensors, ZeroElementShapesOpenAsHfOpensThem) {
  TempDir dir("st_zero");
  write_raw(dir.file("z.safetensors"),
            R"({"a":{"dtype":"F32","shape":[0,4611686018427387904,8],"data_offsets":[0,0]}})", 0);
  EXPECT_EQ(SafetensorsFile::open(dir.file("z.safetensors"))->info("a").nbytes, 0u);
  write_raw(dir.file("b.safetensors"),
            R"({"b":{"dtype":"F32","shape":[9223372036854775808,0],"data_offsets":[0,0]}})", 0);
  EXPECT_HAS(error_of([&] { SafetensorsFile::open(dir.file("b.safetensors")); }, ErrorCode::kIo),
             "tensor 'b': shape [9223372036854775808,0] has a dimension of 2^63 or more");
}

TEST(Safetensors, RejectsBadFiles) {
  TempDir dir("st_bad");
  const std::vector<BadCase> cases = {
      {"header length past end",
       R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
       8,
       1000,
       {"header length 1000", "past the end of the file"}},
      {"invalid json", R"({"a":{"dtype":"F32",)", 8, std::nullopt, {"not valid JSON"}},
      // A control byte in a name, quoted as every message quotes one (the JSON
      // library wrote it "<U+0010>").
      {"control byte in a name",
       "{\"a\x10"
       "b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}",
       4,
       std::nullopt,
       {"header is not valid JSON", "control character U+0010", "must be escaped to \\u0010;",
        "last read: '\"a\\x10'"}},
      {"not an object", R"([1, 2, 3])", 0, std::nullopt, {"not a JSON object"}},
      {"unknown dtype",
       R"({"w.a":{"dtype":"F7","shape":[2],"data_offsets":[0,8]}})",
       8,
       std::nullopt,
       {"tensor 'w.a'", "unknown safetensors dtype 'F7'"}},
      // A dtype HF's safetensors does not know either (it refuses the file).
      {"dtype nobody knows",
       R"({"w.x":{"dtype":"X9","shape":[2],"data_offsets":[0,8]}})",
       8,
       std::nullopt,
       {"tensor 'w.x'", "unknown safetensors dtype 'X9' (known: BOOL F4 F6_E2M3"}},
      // Those fusedmoe does not read are checked as any other (as HF's reader does).
      {"size mismatch of a dtype fusedmoe does not read",
       R"({"w.u":{"dtype":"U32","shape":[3],"data_offsets":[0,8]}})",
       8,
       std::nullopt,
       {"tensor 'w.u'", "hold 8 bytes but U32 [3] needs 12 bytes (size mismatch)"}},
      {"sub-byte elements that end inside a byte",
       R"({"w.f4":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}})",
       2,
       std::nullopt,
       {"tensor 'w.f4'",
        "shape [3] of F4 (4 bits an element) holds 12 bits, not a whole number "
        "of bytes"}},
      {"F6 elements that end inside a byte",
       R"({"w.f6":{"dtype":"F6_E3M2","shape":[2,3],"data_offsets":[0,5]}})",
       5,
       std::nullopt,
       {"tensor 'w.f6'", "holds 36 bits, not a whole number of bytes"}},
      {"overlap with a tensor of a dtype fusedmoe does not read",
       R"({"w.s":{"dtype":"F8_E8M0","shape":[8],"data_offsets":[0,8]},"w.t":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
       12,
       std::nullopt,
       {"tensor 'w.t'", "overlap tensor 'w.s'"}},
      {"offsets outside",
       R"({"w.b":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})",
       8,
       std::nullopt,
       {"tensor 'w.b'", "[0, 16]", "end past the data section (8 bytes)"}},
      {"begin > end",
       R"({"w.c":{"dtype":"F32","shape":[0],"data_offsets":[8,4]}})",
       8,
       std::nullopt,
       {"tensor 'w.c'", "begin > end"}},
      {"size mismatch",
       R"({"w.d":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,8]}})",
       16,
       std::nullopt,
       {"tensor 'w.d'", "size mismatch", "needs 12 bytes"}},
      // 2^62 x 2^62 elements: said to overflow, not "needs 18446744073709551615 bytes".
      {"shape overflowing 64 bits",
       R"({"w.o":{"dtype":"F32","shape":[4611686018427387904,4611686018427387904],"data_offsets":[0,8]}})",
       8,
       std::nullopt,
       {"tensor 'w.o'", "overflows 64 bits", "[0, 8]"}},
      // HF's reader multiplies the shape out in order: an overflow before the 0 is refused.
      {"shape overflowing 64 bits, then a 0",
       R"({"w.z":{"dtype":"F32","shape":[4611686018427387904,8,0],"data_offsets":[0,0]}})",
       0,
       std::nullopt,
       {"tensor 'w.z'", "overflows 64 bits"}},
      {"bits overflowing 64 bits",
       R"({"w.y":{"dtype":"F32","shape":[1152921504606846976],"data_offsets":[0,0]}})",
       0,
       std::nullopt,
       {"tensor 'w.y'", "overflows 64 bits"}},
      {"offset past 64 bits",
       R"({"w.g":{"dtype":"F32","shape":[2],"data_offsets":[0,18446744073709551616]}})",
       8,
       std::nullopt,
       {"tensor 'w.g'", "hold an offset of 2^64 or more"}},
      {"negative shape",
       R"({"w.e":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})",
       8,
       std::nullopt,
       {"tensor 'w.e'", "non-negative"}},
      {"missing offsets",
       R"({"w.f":{"dtype":"F32","shape":[1]}})",
       8,
       std::nullopt,
       {"tensor 'w.f'", "data_offsets"}},
      {"overlap",
       R"({"w.g":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"w.h":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
       16,
       std::nullopt,
       {"tensor 'w.h'", "overlap tensor 'w.g'"}},
      // Bytes no tensor holds, between two tensors or before the first (HF's
      // safetensors: "invalid offset"); empty tensors occupy nothing anywhere.
      {"gap between tensors",
       R"({"w.j":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"w.k":{"dtype":"F32","shape":[2],"data_offsets":[12,20]}})",
       20,
       std::nullopt,
       {"tensor 'w.k': data_offsets [12, 20] leave the bytes [8, 12] of the data section unused "
        "(expected begin 8, where tensor 'w.j' [0, 8] ends)"}},
      {"gap before the first tensor",
       R"({"w.l":{"dtype":"F32","shape":[2],"data_offsets":[4,12]},"w.m":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}})",
       12,
       std::nullopt,
       {"tensor 'w.l': data_offsets [4, 12] leave the bytes [0, 4] of the data section unused "
        "(expected begin 0, the first tensor's)"}},
      {"empty tensor inside another",
       R"({"w.n":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"w.o":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})",
       8,
       std::nullopt,
       {"empty tensor 'w.o': data_offsets [4, 4] expected [8, 8]"}},
      {"duplicate tensor name",
       R"({"w.i":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"w.i":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
       8,
       std::nullopt,
       {"tensor 'w.i' more than once"}},
      // Around the header's JSON only whitespace (HF's reader parses all of it
      // as JSON): NUL padding, which json alone would read as the end.
      {"NUL padding",
       std::string(R"({"w.p":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})") +
           std::string(4, '\0'),
       4,
       std::nullopt,
       {"header holds a NUL byte at byte 64 of the file"}},
      // A UTF-8 byte-order mark before the JSON (json alone would skip it; HF's
      // reader refuses it: "expected value at line 1 column 1"), or after
      // whitespace.
      {"UTF-8 byte-order mark",
       "\xEF\xBB\xBF"
       R"({"w.q":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
       4,
       std::nullopt,
       {"header starts with a UTF-8 byte-order mark (bytes EF BB BF at byte 8 of the file"}},
      {"UTF-8 byte-order mark after a space",
       " \xEF\xBB\xBF"
       R"({"w.q":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
       4,
       std::nullopt,
       {"header is not valid JSON"}},
      {"metadata not strings",
       R"({"__metadata__":{"seed":3}})",
       0,
       std::nullopt,
       {"__metadata__", "'seed'"}},
  };
  for (const BadCase& c : cases) {
    SCOPED_TRACE(c.what);
    const std::string path =
        dir.file(std::string("bad_") + std::to_string(&c - cases.data()) + ".safetensors");
    write_raw(path, c.header, c.data_bytes, c.len_override);
    const std::string msg = error_of([&] { SafetensorsFile::open(path); });
    EXPECT_EQ(msg.rfind(path + ": ", 0), 0u) << msg;
    for (const auto& s : c.substrings) EXPECT_HAS(msg, s);
  }
}

// Builds a header (tensors one after another in the order given) and writes the
// file with that many data bytes; returns the data bytes.
size_t write_entries(const std::string& path,
                     const std::vector<std::tuple<std::string, std::string, std::string, size_t>>&
                         entries /* name, dtype, shape JSON, bytes */) {
  std::string header = "{";
  size_t at = 0;
  for (const auto& [name, dtype, shape, bytes] : entries) {
    header += (header.size() > 1 ? "," : "") + std::string("\"") + name + "\":{\"dtype\":\"" +
              dtype + "\",\"shape\":" + shape + ",\"data_offsets\":[" + std::to_string(at) + "," +
              std::to_string(at + bytes) + "]}";
    at += bytes;
  }
  write_raw(path, header + "}", at);
  return at;
}

// A file with tensors of dtypes HF's safetensors (0.8.0 checked) knows and
// fusedmoe does not read (an MXFP4 checkpoint's F8_E8M0 scales, U32 indices):
// opens, lists them, checks their sizes (sub-byte F4 and F6_* packed), and only
// get() of one of them is refused, naming the file, the tensor and the dtype.
TEST(Safetensors, DtypesFusedmoeDoesNotReadOpenAndAreListed) {
  TempDir dir("st_dtypes");
  const std::string path = dir.file("mixed.safetensors");
  const std::vector<std::tuple<std::string, std::string, std::string, size_t>> entries = {
      {"w.f32", "F32", "[2]", 8},
      {"w.u32", "U32", "[3]", 12},
      {"w.u16", "U16", "[2]", 4},
      {"w.u64", "U64", "[1]", 8},
      {"w.c64", "C64", "[1]", 8},
      {"w.e8m0", "F8_E8M0", "[2,2]", 4},
      {"w.fnuz", "F8_E4M3FNUZ", "[3]", 3},
      {"w.fnuz2", "F8_E5M2FNUZ", "[1]", 1},
      {"w.f4", "F4", "[3,2]", 3},
      {"w.f6a", "F6_E2M3", "[4]", 3},
      {"w.f6b", "F6_E3M2", "[2,4]", 6},
      {"w.f4empty", "F4", "[0,3]", 0},
      {"w.u8", "U8", "[2]", 2},
  };
  write_entries(path, entries);
  auto f = SafetensorsFile::open(path);
  std::vector<std::string> names;
  for (const auto& e : entries) names.push_back(std::get<0>(e));
  std::sort(names.begin(), names.end());
  EXPECT_EQ(f->names(), names);
  for (const auto& [name, dtype, shape, bytes] : entries) {
    SCOPED_TRACE(name);
    EXPECT_TRUE(f->contains(name));
    const SafetensorsFile::Info info = f->info(name);
    EXPECT_EQ(info.dtype_name, dtype);
    EXPECT_EQ(info.nbytes, bytes);
    std::string shown = "[";
    for (size_t i = 0; i < info.shape.size(); ++i)
      shown += (i ? "," : "") + std::to_string(info.shape[i]);
    EXPECT_EQ(shown + "]", shape);
    EXPECT_EQ(info.dtype.has_value(), dtype == "F32" || dtype == "U8");
    if (info.dtype) {
      EXPECT_EQ(f->get(name).nbytes(), bytes);
      continue;
    }
    const std::string msg = error_of([&] { f->get(name); }, ErrorCode::kUnsupported);
    EXPECT_EQ(msg, path + ": tensor '" + name + "': dtype " + dtype +
                       " is not supported by fusedmoe (supported: F64 F32 F16 BF16 F8_E4M3 "
                       "F8_E5M2 I64 I32 I16 I8 U8 BOOL)");
  }
  EXPECT_EQ(f->get("w.f32").view().str(), "f32 [2]");
  EXPECT_HAS(error_of([&] { f->info("w.none"); }), "no tensor named 'w.none'");
  // The bits of each of HF's dtypes; 0 (unknown) for others.
  EXPECT_EQ(safetensors_dtype_bits("F4"), 4);
  EXPECT_EQ(safetensors_dtype_bits("F6_E2M3"), 6);
  EXPECT_EQ(safetensors_dtype_bits("F8_E8M0"), 8);
  EXPECT_EQ(safetensors_dtype_bits("U16"), 16);
  EXPECT_EQ(safetensors_dtype_bits("C64"), 64);
  EXPECT_EQ(safetensors_dtype_bits("X9"), 0);
  EXPECT_EQ(safetensors_dtype_bits("f32"), 0);
  // parse_safetensors_dtype still takes only those fusedmoe reads.
  EXPECT_HAS(error_of([] { parse_safetensors_dtype("U32"); }), "unknown safetensors dtype 'U32'");
  // Through a checkpoint: listed, described, refused by get() alone.
  fs::create_directory(dir.file("model"));
  fs::copy_file(path, dir.file("model/model.safetensors"));
  const Checkpoint ck = Checkpoint::open(dir.file("model"));
  EXPECT_EQ(ck.names(), names);
  EXPECT_EQ(ck.info("w.e8m0").dtype_name, "F8_E8M0");
  EXPECT_EQ(ck.info("w.e8m0").nbytes, 4u);
  EXPECT_HAS(error_of([&] { ck.get("w.e8m0"); }, ErrorCode::kUnsupported),
             "tensor 'w.e8m0': dtype F8_E8M0 is not supported by fusedmoe");
  EXPECT_EQ(ck.get("w.u8").view().str(), "u8 [2]");
}

// What HF's reader (serde_json over the whole header; safetensors 0.8.0 checked)
// accepts: whitespace around the JSON (its writer pads with spaces), fields of a
// tensor entry beyond dtype / shape / data_offsets, which it ignores, and a null
// __metadata__ (none).
TEST(Safetensors, WhitespaceExtraEntryFieldsAndNullMetadataOpen) {
  TempDir dir("st_pad");
  const std::string entry = R"("w":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"note":"x"})";
  for (const std::string& header :
       {"{" + entry + "}" + std::string(7, ' '), " \n{" + entry + "}\t\r\n",
        R"({"__metadata__":null,)" + entry + "}"}) {
    SCOPED_TRACE(header);
    const std::string path = dir.file("padded.safetensors");
    write_raw(path, header, 4);
    const auto f = SafetensorsFile::open(path);
    const Tensor w = f->get("w");
    ASSERT_EQ(w.ndim(), 1);
    EXPECT_EQ(w.shape()[0], 1);
  }
}

TEST(Safetensors, RejectsTruncatedFiles) {
  TempDir dir("st_trunc");
  // Shorter than the 8-byte length prefix.
  const std::string tiny = dir.file("tiny.safetensors");
  { std::ofstream(tiny, std::ios::binary) << "abc"; }
  std::string msg = error_of([&] { SafetensorsFile::open(tiny); });
  EXPECT_HAS(msg, tiny);
  EXPECT_HAS(msg, "too short (3 bytes");

  // A valid file whose data section was cut short.
  Tensor t = Tensor::zeros(DType::kF32, {16});
  const std::string path = dir.file("cut.safetensors");
  save_safetensors(path, {{"layer.weight", t}});
  fs::resize_file(path, fs::file_size(path) - 10);
  msg = error_of([&] { SafetensorsFile::open(path); });
  EXPECT_HAS(msg, path);
  EXPECT_HAS(msg, "tensor 'layer.weight'");
  EXPECT_HAS(msg, "end past the data section (54 bytes)");

  // Not there at all.
  msg = error_of([&] { SafetensorsFile::open(dir.file("nope.safetensors")); });
  EXPECT_HAS(msg, "nope.safetensors: cannot open");
}

// Bytes after the last tensor's data (two files joined, a report appended):
// damage, as HF's safetensors says ("incomplete buffer"), not data to ignore.
TEST(Safetensors, RejectsBytesAfterTheLastTensor) {
  TempDir dir("st_tail");
  Tensor t = Tensor::zeros(DType::kF32, {16});
  const std::string path = dir.file("tail.safetensors");
  save_safetensors(path, {{"layer.weight", t}});
  EXPECT_NO_THROW(SafetensorsFile::open(path));
  { std::ofstream(path, std::ios::binary | std::ios::app) << "report\n"; }
  std::string msg = error_of([&] { SafetensorsFile::open(path); });
  EXPECT_HAS(msg, path);
  EXPECT_HAS(msg,
             ": 7 bytes after the last tensor's data (the data section holds 71 bytes, "
             "the tensors end at 64)");
  // No tensors: the data section must be empty.
  const std::string none = dir.file("none.safetensors");
  save_safetensors(none, {});
  EXPECT_NO_THROW(SafetensorsFile::open(none));
  { std::ofstream(none, std::ios::binary | std::ios::app) << "x"; }
  EXPECT_HAS(error_of([&] { SafetensorsFile::open(none); }), ": 1 byte after the last tensor");
  // An empty tensor's offsets past the last tensor's bytes do not cover the
  // bytes between (HF's safetensors: "invalid offset").
  const std::string empty_last = dir.file("empty_last.safetensors");
  write_raw(empty_last,
            R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
            R"("b":{"dtype":"F32","shape":[0],"data_offsets":[8,8]}})",
            8);
  EXPECT_HAS(error_of([&] { SafetensorsFile::open(empty_last); }),
             ": empty tensor 'b': data_offsets [8, 8] expected [4, 4], where the bytes before "
             "it end");
}

// Tensors that follow one another from offset 0 load, in any header order,
// empty tensors among them (they occupy no bytes).
TEST(Safetensors, ContiguousTensorsInAnyOrderLoad) {
  TempDir dir("st_contig");
  const std::string path = dir.file("contig.safetensors");
  write_raw(path,
            R"({"c":{"dtype":"U8","shape":[4],"data_offsets":[8,12]},)"
            R"("e":{"dtype":"F32","shape":[0,3],"data_offsets":[8,8]},)"
            R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
            R"("z":{"dtype":"U8","shape":[0],"data_offsets":[12,12]}})",
            12);
  const auto f = SafetensorsFile::open(path);
  EXPECT_EQ(f->names().size(), 4u);
  EXPECT_EQ(f->get("c").numel(), 4);
}

TEST(Safetensors, SaveIsAtomicAndChecksNames) {
  TempDir dir("st_save");
  Tensor t = Tensor::zeros(DType::kF32, {4});
  const std::string path = dir.file("m.safetensors");
  save_safetensors(path, {{"keep", t}});
  // Duplicate names: rejected before anything is written; the old file stays.
  std::string msg = error_of(
      [&] {
        save_safetensors(path, {{"x", t}, {"x", t}});
      },
      ErrorCode::kInvalidArgument);
  EXPECT_HAS(msg, "duplicate tensor name 'x'");
  EXPECT_TRUE(SafetensorsFile::open(path)->contains("keep"));
  // Unwritable folder: Error(kIo), no file, no temporary left behind.
  msg = error_of([&] { save_safetensors(dir.file("no/such/dir/m.safetensors"), {{"x", t}}); });
  EXPECT_HAS(msg, "no/such/dir/m.safetensors");
  size_t entries = 0;
  for (const auto& e : fs::directory_iterator(dir.path())) {
    ++entries;
    EXPECT_EQ(e.path().filename(), "m.safetensors");
  }
  EXPECT_EQ(entries, 1u);
}

// A path quoted in an error message is written as printable() writes it: a
// newline in a file or folder name as \x0a (the CLI did so, the Python module
// showed the raw newline), so the message stays on one line.
// A header of many tensors (one file of a large model): read in linear time
// (json's callback parser, used for the duplicate check before, took 0.6 / 3.3 /
// 12 s at 10000 / 20000 / 30000 tensors); a name repeated as the very last
// entry is still found.
TEST(Safetensors, ManyTensorsAndALateDuplicate) {
  TempDir dir("st_many");
  constexpr int kN = 30000;
  std::string header = "{";
  for (int i = 0; i < kN; ++i)
    header += (i ? "," : "") + std::string("\"t") + std::to_string(i) +
              "\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[" + std::to_string(i) + "," +
              std::to_string(i + 1) + "]}";
  const std::string good = dir.file("many.safetensors");
  write_raw(good, header + "}", kN);
  const auto f = SafetensorsFile::open(good);
  EXPECT_EQ(f->names().size(), static_cast<size_t>(kN));
  const std::string bad = dir.file("many_dup.safetensors");
  write_raw(bad, header + ",\"t7\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", kN);
  EXPECT_HAS(error_of([&] { SafetensorsFile::open(bad); }), "tensor 't7' more than once");
}

// printable(): text is kept, UTF-8 included, but control characters, bytes
// that are no UTF-8, backslashes and the invisible format characters that reorder or hide
// text on a terminal (a tensor named with U+202E, right-to-left override, showed
// reversed in `inspect`; session 28's trial) are escaped.
TEST(Printable, EscapesControlsBadBytesAndInvisibleFormatCharacters) {
  EXPECT_EQ(printable("w13 caf\xc3\xa9 \xe4\xb8\x93\xe5\xae\xb6"),
            "w13 caf\xc3\xa9 \xe4\xb8\x93\xe5\xae\xb6");
  EXPECT_EQ(printable("a\nb\x7f\xc2\x85"), "a\\x0ab\\x7f\\xc2\\x85");
  EXPECT_EQ(printable("x\xff\xe2\x80"), "x\\xff\\xe2\\x80");
  EXPECT_EQ(printable("ab\xe2\x80\xae"
                      "cd"),
            "ab\\u202ecd");                                                 // RLO
  EXPECT_EQ(printable("\xe2\x80\x8b\xe2\x80\x8f\xe2\x81\xa6\xef\xbb\xbf"),  // ZWSP, RLM, LRI, BOM
            "\\u200b\\u200f\\u2066\\ufeff");
  // Soft hyphen, Arabic letter mark, line separator, a tag character.
  EXPECT_EQ(printable("\xc2\xad\xd8\x9c\xe2\x80\xa8\xf3\xa0\x81\x81"),
            "\\u00ad\\u061c\\u2028\\U000e0041");
  EXPECT_EQ(printable("\xe2\x80\x94 \xe2\x80\xa6"),
            "\xe2\x80\x94 \xe2\x80\xa6");  // em dash, ellipsis kept
  // A backslash is escaped too, so that a name typed as "a\u200bb" does not
  // read like one holding the zero-width space (session 28's focused trial).
  EXPECT_EQ(printable("a\\u200bb"), "a\\\\u200bb");
  EXPECT_EQ(printable("a\xe2\x80\x8b"
                      "b"),
            "a\\u200bb");
  EXPECT_EQ(printable("C:\\x\n"), "C:\\\\x\\x0a");
}

TEST(Safetensors, PathsInErrorsEscapeControlCharacters) {
  TempDir dir("st_ctrl");
  const std::string sub = dir.file("a\nb"), shown = dir.path() + "/a\\x0ab";
  fs::create_directory(sub);
  const auto expect_escaped = [&](const std::string& msg, const std::string& part) {
    EXPECT_HAS(msg, shown + part);
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  };
  expect_escaped(error_of([&] { SafetensorsFile::open(sub + "/none.safetensors"); }),
                 "/none.safetensors: cannot open");
  { std::ofstream(sub + "/short.safetensors") << "abc"; }
  expect_escaped(error_of([&] { SafetensorsFile::open(sub + "/short.safetensors"); }),
                 "/short.safetensors: file too short");
  write_raw(sub + "/bad.safetensors", "{\"x\": 1}", 0);
  expect_escaped(error_of([&] { SafetensorsFile::open(sub + "/bad.safetensors"); }),
                 "/bad.safetensors: tensor 'x'");
  save_safetensors(sub + "/m.safetensors", {{"a", Tensor::zeros(DType::kF32, {2})}});
  const auto file = SafetensorsFile::open(sub + "/m.safetensors");
  expect_escaped(error_of([&] { file->get("b"); }), "/m.safetensors: no tensor named 'b'");
  // A folder without a checkpoint; an index whose shard (a name with a newline) is missing.
  expect_escaped(error_of([&] { Checkpoint::open(sub); }), ": checkpoint directory has neither");
  { std::ofstream(sub + "/model.safetensors.index.json") << R"({"weight_map": {"a": "x\ny"}})"; }
  const Checkpoint ck = Checkpoint::open(sub);
  expect_escaped(error_of([&] { ck.get("a"); }),
                 "/model.safetensors.index.json: the shard of "
                 "tensor 'a': " +
                     shown + "/x\\x0ay: cannot open");
}

// The header is JSON (UTF-8 text): a name or metadata string that is not UTF-8 is an
// error naming it, before anything is written (nlohmann's dump() threw its own
// "[json.exception.type_error.316] invalid UTF-8 byte" once the tensors were ready).
TEST(Safetensors, SaveRefusesTextThatIsNotUtf8) {
  TempDir dir("st_utf8");
  Tensor t = Tensor::zeros(DType::kF32, {4});
  const std::string path = dir.file("m.safetensors");
  std::string msg = error_of(
      [&] {
        save_safetensors(path, {{"w\xff", t}});
      },
      ErrorCode::kInvalidArgument);
  EXPECT_HAS(msg, "save_safetensors: tensor name \"w\xff\" is not valid UTF-8");
  msg = error_of(
      [&] {
        save_safetensors(path, {{"w", t}}, {{"model", "/m\xe9/x"}});
      },
      ErrorCode::kInvalidArgument);
  EXPECT_HAS(msg, "save_safetensors: metadata value of 'model' \"/m\xe9/x\" is not valid UTF-8");
  msg = error_of(
      [&] {
        save_safetensors(path, {{"w", t}}, {{"k\xc3", "v"}});
      },
      ErrorCode::kInvalidArgument);
  EXPECT_HAS(msg, "save_safetensors: metadata key \"k\xc3\" is not valid UTF-8");
  EXPECT_TRUE(fs::is_empty(dir.path()));
  // UTF-8 beyond ASCII is text like any other.
  save_safetensors(path, {{"w\xc3\xa9", t}}, {{"model", "/m\xc3\xa9"}});
  EXPECT_TRUE(SafetensorsFile::open(path)->contains("w\xc3\xa9"));
}

TEST(Safetensors, AtomicFileAllOrNothing) {
  TempDir dir("atomic");
  const std::string path = dir.file("t.csv");
  const auto entries = [&] {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir.path()))
      names.push_back(e.path().filename().string());
    return names;
  };
  {  // Destroyed before commit() (an error on the way): nothing is left.
    AtomicFile f(path);
    f.write("a,b\n");
    EXPECT_EQ(entries().size(), 1u);  // the temporary only
  }
  EXPECT_TRUE(entries().empty());
  {  // Committed: the file, and no temporary.
    AtomicFile f(path);
    f.write("a,b\n");
    f.write("1,2\n");
    f.commit();
  }
  EXPECT_EQ(entries(), std::vector<std::string>{"t.csv"});
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, "a,b\n1,2\n");
  // Unwritable targets: named with the OS reason, before anything is written.
  EXPECT_HAS(error_of([&] { AtomicFile f(dir.path()); }, ErrorCode::kIo), "a directory");
  EXPECT_HAS(error_of([&] { AtomicFile f(dir.file("no/such/t.csv")); }, ErrorCode::kIo),
             "No such file or directory");
  EXPECT_HAS(error_of([&] { AtomicFile f(""); }, ErrorCode::kInvalidArgument), "empty");
}

// A process killed by SIGKILL leaves its temporary `.<name>.fusedmoe-tmp.<pid>.XXXXXX`;
// the next AtomicFile for the same target removes it once that process is gone,
// and leaves every other file (a live process's temporary, another target's, a
// name not of the pattern, another suffix than mkstemp's six letters or digits) alone.
TEST(Safetensors, AtomicFileRemovesStaleTemporaries) {
  TempDir dir("atomic_stale");
  const std::string path = dir.file("out.safetensors");
  const pid_t dead = ::fork();  // a pid that no longer runs: a child, waited for
  ASSERT_GE(dead, 0);
  if (dead == 0) ::_exit(0);
  ASSERT_EQ(::waitpid(dead, nullptr, 0), dead);
  const std::string d = std::to_string(dead), live = std::to_string(::getppid());
  const std::vector<std::string> stale = {".out.safetensors.fusedmoe-tmp." + d + ".a1B2c3",
                                          ".out.safetensors.fusedmoe-tmp." + d + ".zzzzzz"};
  const std::vector<std::string> kept = {
      ".out.safetensors.fusedmoe-tmp." + live + ".a1B2c3",      // its process runs
      ".other.safetensors.fusedmoe-tmp." + d + ".a1B2c3",       // another target's
      ".out.safetensors.fusedmoe-tmp.x" + d + ".a1B2c3",        // no pid
      ".out.safetensors.fusedmoe-tmp." + d,                     // no suffix
      ".out.safetensors.fusedmoe-tmp." + d + ".toolongsuffix",  // not mkstemp's six
      ".out.safetensors.fusedmoe-tmp." + d + ".a1B2c",          // characters (trial)
      ".out.safetensors.fusedmoe-tmp." + d + ".a1B-c3",         // a letter or digit each
      ".out.safetensors.tmp.a1B2c3"};                           // not of the pattern
  for (const auto& n : stale) std::ofstream(dir.file(n)).put('x');
  for (const auto& n : kept) std::ofstream(dir.file(n)).put('x');
  {
    AtomicFile f(path);
    std::vector<std::string> removed = f.removed_stale();
    std::sort(removed.begin(), removed.end());
    EXPECT_EQ(removed, (std::vector<std::string>{dir.file(stale[0]), dir.file(stale[1])}));
    // Its own temporary is named by the pattern, with this process's pid.
    const std::string own = ".out.safetensors.fusedmoe-tmp." + std::to_string(::getpid()) + ".";
    int own_count = 0;
    for (const auto& e : fs::directory_iterator(dir.path()))
      own_count += e.path().filename().string().rfind(own, 0) == 0;
    EXPECT_EQ(own_count, 1);
    f.write("x");
    f.commit();
  }
  for (const auto& n : stale) EXPECT_FALSE(fs::exists(dir.file(n))) << n;
  for (const auto& n : kept) EXPECT_TRUE(fs::exists(dir.file(n))) << n;
  EXPECT_TRUE(fs::exists(path));
}

TEST(Checkpoint, SingleFileDirectoryAndPath) {
  TempDir dir("ckpt_single");
  Tensor t = Tensor::zeros(DType::kBF16, {2, 3});
  save_safetensors(dir.file("model.safetensors"), {{"a.weight", t}, {"b.weight", t}});
  { std::ofstream(dir.file("config.json")) << "{}"; }  // the model's config stands for its dir
  for (const std::string& p :
       {dir.path(), dir.file("model.safetensors"), dir.file("config.json")}) {
    Checkpoint c = Checkpoint::open(p);
    EXPECT_EQ(c.names(), (std::vector<std::string>{"a.weight", "b.weight"}));
    EXPECT_TRUE(c.contains("a.weight"));
    EXPECT_EQ(c.get("b.weight").view().str(), "bf16 [2, 3]");
    const std::string msg = error_of([&] { c.get("c.weight"); });
    EXPECT_HAS(msg, p);
    EXPECT_HAS(msg, "'c.weight'");
  }
  TempDir empty("ckpt_empty");
  EXPECT_HAS(error_of([&] { Checkpoint::open(empty.path()); }), "model.safetensors");
  EXPECT_HAS(error_of([&] { Checkpoint::open(""); }), "the path is empty");  // (trial)
}

TEST(Checkpoint, ShardedThroughIndex) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  TempDir dir("ckpt_sharded");
  Tensor a = test::random_f32(rng, {4, 3});
  Tensor b = test::random_f32(rng, {5});
  Tensor c = test::random_f32(rng, {2, 2});
  save_safetensors(dir.file("model-00001-of-00002.safetensors"), {{"x.a", a}, {"x.b", b}});
  save_safetensors(dir.file("model-00002-of-00002.safetensors"), {{"y.c", c}});
  {
    std::ofstream idx(dir.file("model.safetensors.index.json"));
    idx << R"({"metadata": {"total_size": 124}, "weight_map": {
      "x.a": "model-00001-of-00002.safetensors", "x.b": "model-00001-of-00002.safetensors",
      "y.c": "model-00002-of-00002.safetensors", "y.ghost": "model-00002-of-00002.safetensors"}})";
  }
  Checkpoint ck = Checkpoint::open(dir.path());
  EXPECT_EQ(ck.names(), (std::vector<std::string>{"x.a", "x.b", "y.c", "y.ghost"}));
  for (const auto& [name, src] :
       std::vector<std::pair<std::string, Tensor>>{{"x.a", a}, {"x.b", b}, {"y.c", c}}) {
    Tensor t = ck.get(name);
    ASSERT_EQ(t.view().str(), src.view().str());
    EXPECT_EQ(std::memcmp(t.data(), src.data(), src.nbytes()), 0) << name;
  }
  // The index names a tensor the shard does not have.
  std::string msg = error_of([&] { ck.get("y.ghost"); });
  EXPECT_HAS(msg, "'y.ghost'");
  EXPECT_HAS(msg, "model-00002-of-00002.safetensors");
  msg = error_of([&] { ck.get("z"); });
  EXPECT_HAS(msg, "no tensor named 'z'");
  // A directory with model.safetensors beside the index loads model.safetensors,
  // as transformers' from_pretrained does; the index stays reachable by its path.
  {
    TempDir both("ckpt_both");
    save_safetensors(both.file("model.safetensors"), {{"s.only", c}});
    save_safetensors(both.file("model-00001-of-00002.safetensors"), {{"x.a", a}, {"x.b", b}});
    save_safetensors(both.file("model-00002-of-00002.safetensors"), {{"y.c", c}});
    fs::copy_file(dir.file("model.safetensors.index.json"),
                  both.file("model.safetensors.index.json"));
    EXPECT_EQ(Checkpoint::open(both.path()).names(), (std::vector<std::string>{"s.only"}));
    EXPECT_TRUE(Checkpoint::open(both.file("model.safetensors.index.json")).contains("x.a"));
  }
  // The index file itself can be given; a broken index is an Error(kIo).
  EXPECT_TRUE(Checkpoint::open(dir.file("model.safetensors.index.json")).contains("x.b"));
  {
    std::ofstream idx(dir.file("bad.index.json"));
    idx << R"({"weight_map": [1, 2]})";
  }
  EXPECT_HAS(error_of([&] { Checkpoint::open(dir.file("bad.index.json")); }),
             "bad.index.json: 'weight_map' must be an object (tensor name -> shard file), got a "
             "JSON array");
  // Each way an index lacks its map is named as what it is.
  const std::vector<std::pair<std::string, std::string>> no_map = {
      {R"([1])", "expected a JSON object with a 'weight_map' object, got a JSON array"},
      {R"({"metadata": {}})", "no 'weight_map' object"},
      {R"({"weight_map": "model.safetensors"})",
       "'weight_map' must be an object (tensor name -> shard file), got a JSON string"},
      {R"({"weight_map": {"a\u0001b": 1}})", "weight_map entry 'a\\x01b' is not a string"}};
  for (const auto& [body, expected] : no_map) {
    std::ofstream(dir.file("bad.index.json")) << body;
    EXPECT_HAS(error_of([&] { Checkpoint::open(dir.file("bad.index.json")); }, ErrorCode::kIo),
               expected);
  }
}

// The index is read as Python's json reads it (transformers' sharded
// loading): a NaN or Infinity in its metadata is taken, a byte-order mark
// refused (nlohmann skipped it).
TEST(Checkpoint, IndexIsReadAsPythonJsonReadsIt) {
  TempDir dir("ckpt_index_json");
  save_safetensors(dir.file("s.safetensors"), {{"a", Tensor::zeros(DType::kF32, {2})}});
  const std::string index = dir.file("model.safetensors.index.json");
  const std::string body =
      R"({"metadata": {"total_size": NaN, "x": [Infinity, -1e999]}, "weight_map": {"a": "s.safetensors"}})";
  std::ofstream(index) << body;
  EXPECT_EQ(Checkpoint::open(dir.path()).get("a").view().str(), "f32 [2]");
  std::ofstream(index) << "\xEF\xBB\xBF" << body;
  EXPECT_HAS(error_of([&] { Checkpoint::open(dir.path()); }, ErrorCode::kIo),
             index + ": starts with a UTF-8 byte-order mark (bytes EF BB BF)");
  std::ofstream(index) << R"({"weight_map": {"a": NaN}})";
  EXPECT_HAS(error_of([&] { Checkpoint::open(dir.path()); }, ErrorCode::kIo),
             index + ": weight_map entry 'a' is not a string");
  // A NUL in a shard's name (a \u0000 escape) would open the file named by
  // what precedes it: refused, as Python's open() refuses it.
  std::ofstream(index) << R"({"weight_map": {"a": "s.safetensors\u0000junk"}})";
  EXPECT_HAS(error_of([&] { Checkpoint::open(dir.path()); }, ErrorCode::kIo),
             index + ": weight_map entry 'a': \"s.safetensors\\x00junk\" holds a NUL byte (at 13)");
}

TEST(Checkpoint, ShardPathsStayInsideTheModelFolder) {
  TempDir dir("ckpt_escape");
  fs::create_directory(dir.file("model"));
  fs::create_directory(dir.file("model/sub"));
  Tensor t = Tensor::zeros(DType::kF32, {2});
  save_safetensors(dir.file("outside.safetensors"), {{"a", t}});
  save_safetensors(dir.file("model/sub/in.safetensors"), {{"a", t}});
  const std::string index = dir.file("model/model.safetensors.index.json");
  const auto write_index = [&](const std::string& shard) {
    std::ofstream(index) << R"({"weight_map": {"a": ")" << shard << R"("}})";
  };
  for (const std::string& shard :
       {std::string("../outside.safetensors"), std::string("sub/../../outside.safetensors"),
        dir.file("outside.safetensors"), std::string("/etc/passwd"), std::string(""),
        std::string(".")}) {
    SCOPED_TRACE(shard);
    write_index(shard);
    const std::string msg = error_of([&] { Checkpoint::open(dir.file("model")); }, ErrorCode::kIo);
    EXPECT_HAS(msg, index);
    EXPECT_HAS(msg,
               "weight_map entry 'a': \"" + shard + "\" is not a file inside the model folder");
  }
  // Inside the folder (also through "sub/../sub"): read, and listed by files().
  write_index("sub/../sub/in.safetensors");
  const Checkpoint ck = Checkpoint::open(dir.file("model"));
  EXPECT_EQ(ck.get("a").view().str(), "f32 [2]");
  EXPECT_EQ(ck.files(), (std::vector<std::string>{index, dir.file("model/sub/in.safetensors")}));
  EXPECT_EQ(ck.index_path(), index);
  // A shard that is missing: named, with the index and the tensor.
  write_index("missing.safetensors");
  const Checkpoint gone = Checkpoint::open(dir.file("model"));
  const std::string msg = error_of([&] { gone.get("a"); }, ErrorCode::kIo);
  EXPECT_HAS(msg, index + ": the shard of tensor 'a': " + dir.file("model/missing.safetensors"));
  EXPECT_HAS(msg, "No such file or directory");
}

// A ".." in a shard's path is resolved as the OS resolves it (HF's reader
// opens the path as the index gives it): `sub/../x.safetensors` with no folder
// `sub` (or `sub` a file) cannot be opened, even when x.safetensors is there
// and already open for another tensor; a `..` out of a symbolic link to a
// folder elsewhere is refused (the OS would read outside the model folder).
TEST(Checkpoint, ShardPathDotDotIsResolvedAsTheOSDoes) {
  TempDir dir("ckpt_dotdot");
  fs::create_directories(dir.file("model/real"));
  fs::create_directories(dir.file("elsewhere/deep"));
  Tensor t = Tensor::zeros(DType::kF32, {2});
  save_safetensors(dir.file("model/x.safetensors"),
                   {{"a", t}, {"b", t}, {"c", t}, {"d", t}, {"f", t}, {"g", t}, {"h", t}});
  save_safetensors(dir.file("elsewhere/x.safetensors"), {{"e", t}});
  fs::create_directory_symlink(dir.file("elsewhere/deep"), dir.file("model/out"));
  fs::create_directory_symlink("real", dir.file("model/in"));
  const std::string index = dir.file("model/model.safetensors.index.json");
  fs::create_directories(dir.file("model/real/two"));
  std::ofstream(index) << R"({"weight_map": {"a": "sub/../x.safetensors", "b": "x.safetensors",
      "c": "x.safetensors/../x.safetensors", "d": "in/../real/../x.safetensors",
      "e": "out/../x.safetensors", "f": "real/two/../../x.safetensors",
      "g": "real/./../x.safetensors", "h": "./real/../x.safetensors"}})";
  const Checkpoint ck = Checkpoint::open(dir.file("model"));
  EXPECT_EQ(ck.names(), (std::vector<std::string>{"a", "b", "c", "d", "e", "f", "g", "h"}));
  EXPECT_EQ(ck.get("b").view().str(), "f32 [2]");  // x.safetensors is open now
  const std::string shard_of = index + ": the shard of tensor ";
  for (int info = 0; info < 2; ++info) {
    SCOPED_TRACE(info ? "info" : "get");
    const auto read = [&](const std::string& name) {
      return error_of([&] { info ? (void)ck.info(name) : (void)ck.get(name); });
    };
    EXPECT_EQ(read("a"), shard_of + "'a': " + dir.file("model/sub/../x.safetensors") +
                             ": cannot open: No such file or directory (" + dir.file("model/sub") +
                             ", which '..' steps out of, does not exist)");
    EXPECT_EQ(read("c"), shard_of + "'c': " + dir.file("model/x.safetensors/../x.safetensors") +
                             ": cannot open: Not a directory (" + dir.file("model/x.safetensors") +
                             ", which '..' steps out of, is no directory)");
    EXPECT_EQ(read("e"), shard_of + "'e': " + dir.file("model/out/../x.safetensors") + ": " +
                             dir.file("model/out/..") + " is not " + dir.file("model") +
                             " as the OS resolves it (" + dir.file("model/out") +
                             " is a symbolic link); expected a shard path whose '..' steps back "
                             "out of a folder of the model");
  }
  // Through folders that are there (a link into the model folder too; two
  // ".." in a row; a "." before one): read.
  for (const char* name : {"d", "f", "g", "h"})
    EXPECT_EQ(ck.get(name).view().str(), "f32 [2]") << name;
  EXPECT_EQ(ck.info("d").nbytes, 8u);
}

TEST(Safetensors, SaveWritesThroughSymlinksAndRefusesSpecialFiles) {
  TempDir dir("st_special");
  Tensor t = Tensor::zeros(DType::kF32, {2});
  // A symbolic link: its target gets the file, the link stays a link.
  const std::string target = dir.file("target.safetensors"), link = dir.file("link.safetensors");
  { std::ofstream(target) << "old"; }
  fs::create_symlink(target, link);
  save_safetensors(link, {{"a", t}});
  EXPECT_TRUE(fs::is_symlink(link));
  EXPECT_TRUE(SafetensorsFile::open(target)->contains("a"));
  // A directory (and likewise a device or FIFO) is refused, not replaced.
  const std::string sub = dir.file("subdir");
  fs::create_directory(sub);
  EXPECT_NE(error_of([&] {
              save_safetensors(sub, {{"a", t}});
            }).find("not a regular file"),
            std::string::npos);
  EXPECT_TRUE(fs::is_directory(sub));
  EXPECT_THROW(save_safetensors("/dev/null", {{"a", t}}), Error);
  EXPECT_TRUE(fs::is_character_file("/dev/null"));
}

}  // namespace
}  // namespace fusedmoe
