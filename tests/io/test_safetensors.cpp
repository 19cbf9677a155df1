// Tests for src/io/safetensors: hand-built files read back exactly, writer round trips and its byte
// layout, sharded folders, one case per validation failure, and atomic-write failure behaviour.
// Convention: expected files are built here byte by byte from the spec, never by the writer under test
// (except in round trips). Every test works in its own temporary folder.
#include "io/safetensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>

#include "core/error.h"

namespace lathe::io {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::StartsWith;

// A file image per the spec: 8-byte little-endian header size, header, data.
std::string file_image(std::string_view header, std::string_view data = {}) {
  std::string out;
  for (int i = 0; i < 8; ++i) out += char(uint8_t(uint64_t(header.size()) >> (8 * i)));
  out += header;
  out += data;
  return out;
}

template <typename T>
std::string raw_bytes(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Runs `f` and returns the lathe::Error message it throws ("" and a failure if it does not throw).
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a lathe::Error";
  return "";
}

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name = fmt::format("lathe_io_{}_{}_{}", ::getpid(), info->test_suite_name(), info->name());
    std::replace(name.begin(), name.end(), '/', '_');
    dir_ = fs::temp_directory_path() / name;
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string path(std::string_view name) const { return (dir_ / name).string(); }
  std::string write_raw(std::string_view name, std::string_view bytes) const {
    std::ofstream(path(name), std::ios::binary) << bytes;
    return path(name);
  }
  std::vector<std::string> listing() const {  // file names in the test folder, sorted
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(dir_)) out.push_back(e.path().filename().string());
    std::sort(out.begin(), out.end());
    return out;
  }

  fs::path dir_;
};

// ---- reading hand-built files ----

TEST_F(SafetensorsTest, HandBuiltFileReadsExactValues) {
  // Entries listed out of offset order; "b" starts the data region.
  const std::string header =
      R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[8,24]},)"
      R"("b":{"dtype":"I64","shape":[],"data_offsets":[0,8]},)"
      R"("__metadata__":{"format":"pt","note":"hand"},)"
      R"("c":{"dtype":"BF16","shape":[3],"data_offsets":[24,30]}})";
  const std::vector<float> a = {1.5f, -2.0f, 3.25f, 1e-3f};
  const std::vector<int64_t> b = {-7};
  const std::vector<uint16_t> c = {0x3F80, 0xC000, 0x4049};  // 1, -2, 3.140625 in bf16
  const std::string p = write_raw("x.safetensors", file_image(header, raw_bytes(b) + raw_bytes(a) + raw_bytes(c)));

  const SafetensorsFile f = SafetensorsFile::open(p);
  EXPECT_EQ(f.path(), p);
  ASSERT_EQ(f.tensors().size(), 3u);
  EXPECT_EQ(f.tensors()[0].name, "b");  // file order = offset order
  EXPECT_EQ(f.tensors()[1].name, "a");
  EXPECT_EQ(f.tensors()[2].name, "c");
  const SafetensorsTensor& ta = f.get("a");
  EXPECT_EQ(ta.dtype, DType::F32);
  EXPECT_EQ(ta.shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(ta.numel, 4);
  EXPECT_EQ(ta.byte_size(), 16u);
  EXPECT_EQ(f.read_as_f32("a"), a);
  EXPECT_EQ(f.get("b").shape, std::vector<int64_t>{});
  EXPECT_EQ(f.get("b").numel, 1);
  int64_t bv = 0;
  f.read_into("b", DType::I64, &bv, sizeof bv);
  EXPECT_EQ(bv, -7);
  EXPECT_EQ(f.read_as_f32("c"), (std::vector<float>{1.0f, -2.0f, 3.140625f}));
  EXPECT_EQ(std::memcmp(f.get("c").data, c.data(), 6), 0);
  EXPECT_EQ(f.metadata(), (std::map<std::string, std::string>{{"format", "pt"}, {"note", "hand"}}));
  EXPECT_EQ(f.find("missing"), nullptr);
  EXPECT_THAT(error_of([&] { f.get("missing"); }), AllOf(HasSubstr(p), HasSubstr("'missing'")));
}

TEST_F(SafetensorsTest, EverySupportedDtypeNameMaps) {
  const std::pair<const char*, DType> names[] = {{"F64", DType::F64}, {"F32", DType::F32}, {"BF16", DType::BF16},
                                                 {"F16", DType::F16}, {"I64", DType::I64}, {"I32", DType::I32},
                                                 {"U8", DType::U8},   {"BOOL", DType::Bool}};
  for (const auto& [name, dtype] : names) {
    const size_t n = dtype_size(dtype) * 2;
    const std::string header =
        fmt::format(R"({{"t":{{"dtype":"{}","shape":[2],"data_offsets":[0,{}]}}}})", name, n);
    const SafetensorsHeader h = parse_safetensors_header(header, n, "label");
    ASSERT_EQ(h.tensors.size(), 1u);
    EXPECT_EQ(h.tensors[0].dtype, dtype) << name;
  }
}

TEST_F(SafetensorsTest, UnalignedDataConvertsAllFloatDtypes) {
  // A 9-byte-longer header puts the data at an odd file offset: reads must not assume alignment.
  const std::vector<double> f64 = {0.1, -3.0};
  const std::vector<uint16_t> f16 = {0x3C00, 0xC500};  // 1, -5
  const std::vector<float> f32 = {7.0f, 0.5f};
  std::string header = R"({"d":{"dtype":"F64","shape":[2],"data_offsets":[0,16]},)"
                       R"("h":{"dtype":"F16","shape":[2],"data_offsets":[16,20]},)"
                       R"("s":{"dtype":"F32","shape":[2],"data_offsets":[20,28]}})";
  while (header.size() % 2 == 0) header += ' ';
  const SafetensorsFile f =
      SafetensorsFile::open(write_raw("u.safetensors", file_image(header, raw_bytes(f64) + raw_bytes(f16) + raw_bytes(f32))));
  EXPECT_EQ(f.read_as_f32("d"), (std::vector<float>{0.1f, -3.0f}));
  EXPECT_EQ(f.read_as_f32("h"), (std::vector<float>{1.0f, -5.0f}));
  EXPECT_EQ(f.read_as_f32("s"), f32);
  std::vector<uint16_t> bf(2);
  f.read_into("s", DType::BF16, bf.data(), 4);
  EXPECT_EQ(bf, (std::vector<uint16_t>{0x40E0, 0x3F00}));  // 7.0, 0.5
  double d[2];
  f.read_into("h", DType::F64, d, sizeof d);
  EXPECT_EQ(d[1], -5.0);
  EXPECT_THAT(error_of([&] { f.read_into("s", DType::F32, bf.data(), 4); }),
              AllOf(HasSubstr("'s'"), HasSubstr("output buffer holds 4 bytes")));
}

TEST_F(SafetensorsTest, IntegerTensorsDoNotConvertToFloat) {
  const std::string header = R"({"i":{"dtype":"I32","shape":[1],"data_offsets":[0,4]}})";
  const SafetensorsFile f = SafetensorsFile::open(write_raw("i.safetensors", file_image(header, std::string(4, '\0'))));
  EXPECT_THAT(error_of([&] { f.read_as_f32("i"); }), AllOf(HasSubstr("'i'"), HasSubstr("cannot convert i32 to f32")));
}

TEST_F(SafetensorsTest, EmptyHeaderGapsAndEmptyTensorsAreAccepted) {
  EXPECT_TRUE(parse_safetensors_header("{}", 0, "x").tensors.empty());
  EXPECT_TRUE(parse_safetensors_header("{}   \n", 100, "x").tensors.empty());  // padding, unused data
  // A gap between two tensors, a trailing gap, and empty tensors (inside another one's range too).
  const std::string header = R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                             R"("b":{"dtype":"U8","shape":[2],"data_offsets":[5,7]},)"
                             R"("e":{"dtype":"F32","shape":[0,3],"data_offsets":[1,1]},)"
                             R"("z":{"dtype":"F32","shape":[4294967296,4294967296,0],"data_offsets":[7,7]}})";
  const SafetensorsFile f = SafetensorsFile::open(write_raw("g.safetensors", file_image(header, "AB...CD..")));
  ASSERT_EQ(f.tensors().size(), 4u);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(f.get("b").data), 2), "CD");
  EXPECT_EQ(f.get("e").numel, 0);
  EXPECT_TRUE(f.read_as_f32("z").empty());
}

TEST_F(SafetensorsTest, MovedFileKeepsItsMappingAndPointers) {
  const std::string header = R"({"a":{"dtype":"U8","shape":[3],"data_offsets":[0,3]}})";
  SafetensorsFile f = SafetensorsFile::open(write_raw("m.safetensors", file_image(header, "xyz")));
  const uint8_t* data = f.get("a").data;
  SafetensorsFile g = std::move(f);
  EXPECT_EQ(g.get("a").data, data);
  std::vector<SafetensorsFile> files;
  files.push_back(std::move(g));
  files.push_back(SafetensorsFile::open(path("m.safetensors")));
  files[0] = std::move(files[1]);
  EXPECT_EQ(files[0].get("a").data[2], 'z');
}

// ---- one case per header validation failure ----

struct BadHeader {
  const char* case_name;
  std::string header;
  uint64_t data_size;
  std::vector<std::string> expected;  // substrings the message must contain
};

void PrintTo(const BadHeader& c, std::ostream* os) { *os << c.case_name; }

class BadHeaderTest : public SafetensorsTest, public ::testing::WithParamInterface<BadHeader> {};

TEST_P(BadHeaderTest, IsRejectedWithAClearMessage) {
  const BadHeader& c = GetParam();
  const std::string p = write_raw("bad.safetensors", file_image(c.header, std::string(c.data_size, '\0')));
  const std::string message = error_of([&] { SafetensorsFile::open(p); });
  EXPECT_THAT(message, StartsWith("safetensors: " + p + ":"));
  for (const std::string& s : c.expected) EXPECT_THAT(message, HasSubstr(s));
}

std::string entry(std::string_view name, std::string_view body) {
  return fmt::format(R"({{"{}":{{{}}}}})", name, body);
}

const BadHeader kBadHeaders[] = {
    {"EmptyHeader", "", 0, {"header is not a JSON object", "does not start with '{'"}},
    {"NotAnObject", "[1]", 0, {"header is not a JSON object", "does not start with '{'"}},
    {"LeadingSpace", " {}", 0, {"header is not a JSON object", "does not start with '{'"}},
    {"ByteOrderMark", "\xEF\xBB\xBF{}", 0, {"header is not a JSON object", "does not start with '{'"}},
    {"InvalidJson", R"({"a":)", 0, {"header is not valid JSON"}},
    {"TrailingGarbage", "{} x", 0, {"not valid JSON"}},
    {"SecondObject", "{}{}", 0, {"not valid JSON"}},
    {"TrailingNul", std::string("{}\0\0", 4), 0, {"not valid JSON"}},
    {"InvalidUtf8", "{\"\xff\":1}", 0, {"not valid JSON"}},
    {"EntryNotObject", R"({"w":[1,2]})", 0, {"tensor 'w'", "entry is not an object"}},
    {"MissingDtype", entry("w", R"("shape":[1],"data_offsets":[0,4])"), 4, {"tensor 'w'", "missing field 'dtype'"}},
    {"MissingShape", entry("w", R"("dtype":"F32","data_offsets":[0,4])"), 4, {"tensor 'w'", "missing field 'shape'"}},
    {"MissingOffsets", entry("w", R"("dtype":"F32","shape":[1])"), 4, {"tensor 'w'", "missing field 'data_offsets'"}},
    {"DtypeNotString", entry("w", R"("dtype":1,"shape":[1],"data_offsets":[0,4])"), 4, {"'dtype' is not a string"}},
    {"ShapeNotArray", entry("w", R"("dtype":"F32","shape":"1","data_offsets":[0,4])"), 4, {"'shape' is not an array"}},
    {"OffsetsNotArray", entry("w", R"("dtype":"F32","shape":[1],"data_offsets":{})"), 4, {"'data_offsets' is not an array"}},
    {"UnknownField", entry("w", R"("dtype":"F32","shape":[1],"data_offsets":[0,4],"extra":0)"), 4,
     {"tensor 'w'", "unknown field 'extra'"}},
    {"DtypeI8", entry("w", R"("dtype":"I8","shape":[1],"data_offsets":[0,1])"), 1, {"tensor 'w'", "unsupported dtype 'I8'"}},
    {"DtypeU16", entry("w", R"("dtype":"U16","shape":[1],"data_offsets":[0,2])"), 2, {"unsupported dtype 'U16'"}},
    {"DtypeF8", entry("w", R"("dtype":"F8_E4M3","shape":[1],"data_offsets":[0,1])"), 1, {"unsupported dtype 'F8_E4M3'"}},
    {"DtypeLowercase", entry("w", R"("dtype":"f32","shape":[1],"data_offsets":[0,4])"), 4, {"unsupported dtype 'f32'"}},
    {"NegativeDim", entry("w", R"("dtype":"F32","shape":[2,-3],"data_offsets":[0,4])"), 4, {"tensor 'w'", "shape[1] is negative"}},
    {"FractionalDim", entry("w", R"("dtype":"F32","shape":[1.5],"data_offsets":[0,4])"), 4, {"shape[0] is not an integer"}},
    {"StringDim", entry("w", R"("dtype":"F32","shape":["2"],"data_offsets":[0,8])"), 8, {"shape[0] is not an integer"}},
    {"HugeDim", entry("w", R"("dtype":"U8","shape":[9223372036854775808],"data_offsets":[0,1])"), 1, {"shape[0] is too large"}},
    {"ElementCountOverflow", entry("w", R"("dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,1])"), 1,
     {"tensor 'w'", "element count", "overflows"}},
    {"ByteSizeOverflow", entry("w", R"("dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,8])"), 8,
     {"byte size", "overflows"}},
    {"OneOffset", entry("w", R"("dtype":"U8","shape":[1],"data_offsets":[1])"), 1, {"'data_offsets' is not an array of two"}},
    {"ThreeOffsets", entry("w", R"("dtype":"U8","shape":[1],"data_offsets":[0,1,2])"), 2, {"array of two integers"}},
    {"NegativeOffset", entry("w", R"("dtype":"U8","shape":[1],"data_offsets":[-1,0])"), 1, {"data_offsets[0] is negative"}},
    {"FractionalOffset", entry("w", R"("dtype":"U8","shape":[1],"data_offsets":[0,1.0])"), 1,
     {"data_offsets[1] is not an integer"}},
    {"BeginAfterEnd", entry("w", R"("dtype":"U8","shape":[0],"data_offsets":[4,2])"), 4, {"tensor 'w'", "begin > end"}},
    {"SizeMismatch", entry("w", R"("dtype":"F32","shape":[2],"data_offsets":[0,4])"), 8,
     {"tensor 'w'", "hold 4 bytes", "needs 8 bytes"}},
    {"OutsideDataRegion", entry("w", R"("dtype":"F32","shape":[2],"data_offsets":[4,12])"), 8,
     {"tensor 'w'", "outside the data region of 8 bytes"}},
    {"Overlap",
     R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12,
     {"'a' [0, 8]", "'b' [4, 12]", "overlap"}},
    {"OverlapContained",
     R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[1],"data_offsets":[1,2]},)"
     R"("c":{"dtype":"U8","shape":[1],"data_offsets":[3,4]}})", 8,
     {"'a'", "'b'", "overlap"}},
    {"MetadataNotObject", R"({"__metadata__":"x"})", 0, {"__metadata__ is not a string->string map"}},
    {"MetadataNull", R"({"__metadata__":null})", 0, {"__metadata__ is not a string->string map"}},
    {"MetadataValueNotString", R"({"__metadata__":{"k":1}})", 0, {"__metadata__", "value of 'k' is number"}},
    {"DuplicateTensor",
     R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"w":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})", 2,
     {"duplicate key 'w'"}},
    {"DuplicateField", entry("w", R"("dtype":"U8","dtype":"F32","shape":[1],"data_offsets":[0,1])"), 1,
     {"duplicate key 'dtype'"}},
    {"DuplicateMetadataKey", R"({"__metadata__":{"k":"1","k":"2"}})", 0, {"duplicate key 'k'"}},
    {"DeepNesting", R"({"__metadata__":{"k":)" + std::string(40, '[') + std::string(40, ']') + "}}", 0,
     {"nested deeper than"}},
};

INSTANTIATE_TEST_SUITE_P(Safetensors, BadHeaderTest, ::testing::ValuesIn(kBadHeaders),
                         [](const auto& info) { return std::string(info.param.case_name); });

TEST_F(SafetensorsTest, FileShorterThanEightBytesIsRejected) {
  for (size_t n = 0; n < 8; ++n) {
    const std::string p = write_raw("short.safetensors", std::string(n, '\x01'));
    EXPECT_THAT(error_of([&] { SafetensorsFile::open(p); }),
                AllOf(StartsWith("safetensors: " + p), HasSubstr("shorter than the 8-byte header size")));
  }
}

TEST_F(SafetensorsTest, HeaderSizeLargerThanFileIsRejected) {
  std::string image = file_image("{}");
  image[0] = 3;  // claims 3 bytes of header, has 2
  const std::string p = write_raw("big.safetensors", image);
  EXPECT_THAT(error_of([&] { SafetensorsFile::open(p); }),
              AllOf(StartsWith("safetensors: " + p), HasSubstr("header size 3 is larger than the 2 bytes")));
}

TEST_F(SafetensorsTest, AbsurdHeaderSizeIsRejected) {
  for (uint64_t n : {kMaxHeaderBytes + 1, ~uint64_t(0)}) {
    std::string image(16, ' ');
    for (int i = 0; i < 8; ++i) image[size_t(i)] = char(uint8_t(n >> (8 * i)));
    const std::string p = write_raw("absurd.safetensors", image);
    EXPECT_THAT(error_of([&] { SafetensorsFile::open(p); }),
                AllOf(StartsWith("safetensors: " + p), HasSubstr("exceeds the 100000000-byte limit")));
  }
}

TEST_F(SafetensorsTest, MissingFileAndFolderAreRejected) {
  const std::string p = path("nope.safetensors");
  EXPECT_THAT(error_of([&] { SafetensorsFile::open(p); }), AllOf(HasSubstr(p), HasSubstr("No such file")));
  EXPECT_THAT(error_of([&] { SafetensorsFile::open(dir_.string()); }), HasSubstr("not a regular file"));
}

TEST_F(SafetensorsTest, EveryTruncationOfAValidFileIsRejected) {
  const std::vector<float> a = {1, 2, 3};
  const std::vector<uint16_t> b = {1, 2};
  write_safetensors(path("full.safetensors"), {{"a", DType::F32, {3}, a.data(), 12}, {"b", DType::BF16, {2}, b.data(), 4}},
                    {{"k", "v"}});
  const std::string full = read_file(path("full.safetensors"));
  ASSERT_NO_THROW(SafetensorsFile::open(path("full.safetensors")));
  for (size_t n = 0; n < full.size(); ++n) {
    const std::string p = write_raw("cut.safetensors", full.substr(0, n));
    EXPECT_THAT(error_of([&] { SafetensorsFile::open(p); }), StartsWith("safetensors: " + p + ":")) << n;
    const auto* bytes = reinterpret_cast<const uint8_t*>(full.data());
    EXPECT_THROW(parse_safetensors_bytes({bytes, n}, "mem"), Error) << n;
  }
}

// A tensor-parallel slice: the rows [1, 3) or the columns [2, 4) of a 3 x 5 f32 tensor (as f32, and as f64 through
// the conversion), each element worked out here; a box outside the tensor or a buffer of another size is refused.
TEST_F(SafetensorsTest, ReadBoxIntoReadsRowsOrColumnsOfA2DTensor) {
  std::vector<float> m(15);
  for (int i = 0; i < 15; ++i) m[size_t(i)] = float(10 * (i / 5) + i % 5);  // 10 r + c
  write_safetensors(path("m.safetensors"), {{"m", DType::F32, {3, 5}, m.data(), 60}}, {});
  const SafetensorsFile f = SafetensorsFile::open(path("m.safetensors"));
  std::vector<float> rows(10);
  f.read_box_into("m", {1, 0}, {2, 5}, DType::F32, rows.data(), 40);
  EXPECT_EQ(rows, (std::vector<float>{10, 11, 12, 13, 14, 20, 21, 22, 23, 24}));
  std::vector<double> cols(6);
  f.read_box_into("m", {0, 2}, {3, 2}, DType::F64, cols.data(), 48);
  EXPECT_EQ(cols, (std::vector<double>{2, 3, 12, 13, 22, 23}));
  EXPECT_THAT(error_of([&] { f.read_box_into("m", {2, 0}, {2, 5}, DType::F32, rows.data(), 40); }),
              HasSubstr("is not inside it"));
  EXPECT_THAT(error_of([&] { f.read_box_into("m", {0, 0}, {2, 5}, DType::F32, rows.data(), 36); }),
              HasSubstr("does not fill 36 bytes"));
}

// ---- writer ----

TEST_F(SafetensorsTest, WriterMatchesTheReferenceLayoutByteForByte) {
  const std::vector<float> b = {1.0f, 2.0f};
  const std::vector<uint8_t> a = {1, 2, 3};
  write_safetensors(path("w.safetensors"), {{"b", DType::F32, {2}, b.data(), 8}, {"a", DType::U8, {3}, a.data(), 3}},
                    {{"format", "pt"}});
  // What the Python/Rust safetensors library writes for the same tensors: compact JSON, __metadata__
  // first, names sorted, header padded with spaces to a multiple of 8.
  std::string header = R"({"__metadata__":{"format":"pt"},"a":{"dtype":"U8","shape":[3],"data_offsets":[0,3]},)"
                       R"("b":{"dtype":"F32","shape":[2],"data_offsets":[3,11]}})";
  header.append((8 - header.size() % 8) % 8, ' ');
  EXPECT_EQ(read_file(path("w.safetensors")), file_image(header, raw_bytes(a) + raw_bytes(b)));

  // Two vectors from the reference library's own tests (empty file, with and without metadata).
  write_safetensors(path("e.safetensors"), {});
  EXPECT_EQ(read_file(path("e.safetensors")), file_image("{}      "));
  write_safetensors(path("m.safetensors"), {}, {{"framework", "pt"}});
  EXPECT_EQ(read_file(path("m.safetensors")), file_image(R"({"__metadata__":{"framework":"pt"}}     )"));
}

TEST_F(SafetensorsTest, WriterRoundTripsEveryDtype) {
  std::vector<TensorRef> refs;
  std::vector<std::vector<uint8_t>> buffers;
  for (DType t : kAllDTypes) {
    std::vector<uint8_t> buf(6 * dtype_size(t));
    for (int64_t i = 0; i < 6; ++i) store_from_double(buf.data(), t, i, t == DType::Bool ? i % 2 : 3 * i + 1);
    buffers.push_back(std::move(buf));
    refs.push_back({fmt::format("t_{}", dtype_name(t)), t, {2, 3}, buffers.back().data(), buffers.back().size()});
  }
  const double scalar = 2.5;
  refs.push_back({"scalar", DType::F64, {}, &scalar, 8});
  refs.push_back({"empty", DType::F32, {0, 4}, nullptr, 0});
  refs.push_back({"empty_huge", DType::F64, {int64_t(1) << 40, int64_t(1) << 40, 0}, nullptr, 0});
  std::vector<TensorRef> shuffled(refs.rbegin(), refs.rend());
  write_safetensors(path("a.safetensors"), refs, {{"k", "v"}});
  write_safetensors(path("b.safetensors"), shuffled, {{"k", "v"}});
  EXPECT_EQ(read_file(path("a.safetensors")), read_file(path("b.safetensors")));  // order-independent

  const SafetensorsFile f = SafetensorsFile::open(path("a.safetensors"));
  EXPECT_EQ(f.metadata().at("k"), "v");
  ASSERT_EQ(f.tensors().size(), refs.size());
  EXPECT_EQ(f.tensors().front().name, "empty");  // data laid out in name order
  for (const TensorRef& r : refs) {
    const SafetensorsTensor& t = f.get(r.name);
    EXPECT_EQ(t.dtype, r.dtype) << r.name;
    EXPECT_EQ(t.shape, r.shape) << r.name;
    ASSERT_EQ(t.byte_size(), r.byte_size) << r.name;
    if (r.byte_size) {
      EXPECT_EQ(std::memcmp(t.data, r.data, r.byte_size), 0) << r.name;
    }
  }
  EXPECT_EQ(f.read_as_f32("t_bf16"), (std::vector<float>{1, 4, 7, 10, 13, 16}));
  EXPECT_EQ(read_file(path("a.safetensors"))[0] % 8, 0);  // header padded: data region 8-aligned
}

TEST_F(SafetensorsTest, WriterRejectsBadInputWithoutTouchingTheTarget) {
  const std::vector<float> v = {1, 2};
  const std::string target = path("t.safetensors");
  write_raw("t.safetensors", "old contents");
  const struct {
    std::vector<TensorRef> refs;
    std::string expected;
  } cases[] = {
      {{{"w", DType::F32, {2}, v.data(), 8}, {"w", DType::F32, {2}, v.data(), 8}}, "duplicate tensor name 'w'"},
      {{{"w", DType::F32, {3}, v.data(), 8}}, "tensor 'w': buffer holds 8 bytes but shape 3 of F32 needs 12 bytes"},
      {{{"w", DType::F32, {-1}, v.data(), 8}}, "tensor 'w': negative dimension -1"},
      {{{"w", DType::F32, {int64_t(1) << 40, int64_t(1) << 40}, v.data(), 8}}, "tensor 'w': byte size overflows"},
      {{{"w", DType::F32, {2}, nullptr, 8}}, "tensor 'w' has a null data pointer"},
      {{{"__metadata__", DType::F32, {2}, v.data(), 8}}, "'__metadata__' is reserved"},
      {{{"bad\xff", DType::F32, {2}, v.data(), 8}}, "is not valid UTF-8"},
  };
  for (const auto& c : cases) {
    EXPECT_THAT(error_of([&] { write_safetensors(target, c.refs); }),
                AllOf(StartsWith("safetensors: " + target), HasSubstr(c.expected)));
    EXPECT_EQ(read_file(target), "old contents");
    EXPECT_EQ(listing(), std::vector<std::string>{"t.safetensors"});
  }
  EXPECT_THAT(error_of([&] { write_safetensors(target, {}, {{"k", "\xc3"}}); }), HasSubstr("not valid UTF-8"));
}

TEST_F(SafetensorsTest, FailedRenameRemovesTheTempFile) {
  fs::create_directory(dir_ / "target_is_a_folder");
  const std::string target = path("target_is_a_folder");
  const float v = 1;
  EXPECT_THAT(error_of([&] { write_safetensors(target, {{"w", DType::F32, {}, &v, 4}}); }),
              AllOf(StartsWith("safetensors: " + target), HasSubstr("cannot rename"), HasSubstr("Is a directory")));
  EXPECT_EQ(listing(), std::vector<std::string>{"target_is_a_folder"});
}

TEST_F(SafetensorsTest, MissingOrUnwritableFolderIsReported) {
  const std::string target = path("no_such_dir/x.safetensors");
  EXPECT_THAT(error_of([&] { write_safetensors(target, {}); }),
              AllOf(HasSubstr(target), HasSubstr("cannot create temporary file"), HasSubstr("No such file")));
  if (::geteuid() == 0) GTEST_SKIP() << "running as root: permission bits do not stop writes";
  fs::create_directory(dir_ / "ro");
  write_raw("ro/t.safetensors", "old");
  fs::permissions(dir_ / "ro", fs::perms::owner_read | fs::perms::owner_exec);
  EXPECT_THAT(error_of([&] { write_safetensors(path("ro/t.safetensors"), {}); }), HasSubstr("Permission denied"));
  fs::permissions(dir_ / "ro", fs::perms::owner_all);
  EXPECT_EQ(read_file(path("ro/t.safetensors")), "old");
}

TEST_F(SafetensorsTest, FailedWriteMidFileRemovesTheTempFile) {
  // RLIMIT_FSIZE makes write() fail with EFBIG part way, like a full disk.
  const std::string target = write_raw("t.safetensors", "old contents");
  const std::vector<uint8_t> big(1 << 20, 7);
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  rlimit small = old;
  small.rlim_cur = 4096;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  std::string message;
  try {
    write_safetensors(target, {{"w", DType::U8, {int64_t(big.size())}, big.data(), big.size()}});
  } catch (const Error& e) {
    message = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_THAT(message, AllOf(StartsWith("safetensors: " + target), HasSubstr("cannot write"), HasSubstr("too large")));
  EXPECT_EQ(read_file(target), "old contents");
  EXPECT_EQ(listing(), std::vector<std::string>{"t.safetensors"});
}

// ---- sharded model folders ----

struct Weights {  // n F32 tensors of 5, 6, ... elements with distinct contents
  std::vector<std::vector<float>> data;
  std::vector<TensorRef> refs;
  uint64_t total = 0;
  explicit Weights(int n = 10) {
    data.resize(size_t(n));
    for (int i = 0; i < n; ++i) {
      data[size_t(i)].resize(size_t(5 + i));
      std::iota(data[size_t(i)].begin(), data[size_t(i)].end(), float(100 * i));
    }
    for (int i = 0; i < n; ++i) {
      const auto& d = data[size_t(i)];
      refs.push_back({fmt::format("layers.{}.weight", i), DType::F32, {int64_t(d.size())}, d.data(), d.size() * 4});
      total += d.size() * 4;
    }
  }
};

TEST_F(SafetensorsTest, ShardedRoundTripWritesAnIndex) {
  const Weights w;
  write_sharded_safetensors(dir_.string(), w.refs, 100, {{"format", "pt"}});
  const std::vector<std::string> files = listing();
  ASSERT_GE(files.size(), 4u);  // >= 3 shards + index
  const size_t n = files.size() - 1;
  for (size_t i = 0; i < n; ++i) EXPECT_EQ(files[i], fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, n));
  EXPECT_EQ(files.back(), "model.safetensors.index.json");

  const auto index = nlohmann::json::parse(read_file(dir_ / "model.safetensors.index.json"));
  EXPECT_EQ(index["metadata"]["total_size"].get<uint64_t>(), w.total);
  ASSERT_EQ(index["weight_map"].size(), w.refs.size());
  for (const TensorRef& r : w.refs) {  // every index entry names a shard that holds it
    const std::string file = index["weight_map"][r.name].get<std::string>();
    EXPECT_NE(SafetensorsFile::open(path(file)).find(r.name), nullptr) << r.name;
    EXPECT_EQ(SafetensorsFile::open(path(file)).metadata().at("format"), "pt");
  }
  for (size_t i = 0; i < n; ++i) {  // shards respect the limit
    uint64_t bytes = 0;
    const SafetensorsFile shard = SafetensorsFile::open(path(files[i]));
    for (const auto& t : shard.tensors()) bytes += t.byte_size();
    EXPECT_LE(bytes, 100u) << files[i];
  }

  const SafetensorsModel m = SafetensorsModel::open(dir_.string());
  EXPECT_EQ(m.files().size(), n);
  std::vector<std::string> names;
  for (const TensorRef& r : w.refs) names.push_back(r.name);
  std::sort(names.begin(), names.end());
  EXPECT_EQ(m.names(), names);
  for (size_t i = 0; i < w.refs.size(); ++i) EXPECT_EQ(m.read_as_f32(w.refs[i].name), w.data[i]);
  EXPECT_EQ(m.find("nope"), nullptr);
  EXPECT_THAT(error_of([&] { m.get("nope"); }), AllOf(HasSubstr(dir_.string()), HasSubstr("'nope'")));
}

TEST_F(SafetensorsTest, OversizedTensorGetsItsOwnShard) {
  const Weights w(3);  // 20, 24, 28 bytes
  write_sharded_safetensors(dir_.string(), w.refs, 10);
  EXPECT_EQ(listing().size(), 4u);
  EXPECT_EQ(SafetensorsModel::open(dir_.string()).names().size(), 3u);
}

TEST_F(SafetensorsTest, SingleShardAndResavesLeaveNoStaleFiles) {
  const Weights w;
  write_sharded_safetensors(dir_.string(), w.refs, 1 << 20);
  EXPECT_EQ(listing(), std::vector<std::string>{"model.safetensors"});
  write_raw("notes.txt", "kept");
  write_sharded_safetensors(dir_.string(), w.refs, 100);  // sharded over single
  const std::vector<std::string> sharded = listing();
  EXPECT_EQ(std::count(sharded.begin(), sharded.end(), "model.safetensors"), 0);
  EXPECT_EQ(std::count(sharded.begin(), sharded.end(), "notes.txt"), 1);
  write_sharded_safetensors(dir_.string(), Weights(2).refs, 1 << 20);  // single over sharded
  EXPECT_EQ(listing(), (std::vector<std::string>{"model.safetensors", "notes.txt"}));
  EXPECT_EQ(SafetensorsModel::open(dir_.string()).names().size(), 2u);
}

TEST_F(SafetensorsTest, ModelFolderErrorsNameTheFolderAndFile) {
  const std::string index_path = path("model.safetensors.index.json");
  EXPECT_THAT(error_of([&] { SafetensorsModel::open(path("missing")); }), HasSubstr("not a folder"));
  EXPECT_THAT(error_of([&] { SafetensorsModel::open(dir_.string()); }),
              AllOf(HasSubstr(dir_.string()), HasSubstr("neither")));

  const Weights w(4);
  write_safetensors(path("s1.safetensors"), {w.refs[0], w.refs[1]});
  write_safetensors(path("s2.safetensors"), {w.refs[1], w.refs[2]});  // refs[1] in both
  const auto expect_index_error = [&](std::string_view index, std::vector<std::string> expected) {
    write_raw("model.safetensors.index.json", index);
    const std::string message = error_of([&] { SafetensorsModel::open(dir_.string()); });
    EXPECT_THAT(message, StartsWith("safetensors: " + index_path)) << index;
    for (const std::string& s : expected) EXPECT_THAT(message, HasSubstr(s)) << index;
  };
  expect_index_error("{", {"index is not valid JSON"});
  expect_index_error(R"({"weight_map":{"a":"s1.safetensors","a":"s1.safetensors"}})", {"duplicate key 'a'"});
  expect_index_error(R"({"metadata":{}})", {"no 'weight_map' object"});
  expect_index_error(R"({"weight_map":{"a":1}})", {"entry 'a' is not a file name"});
  expect_index_error(R"({"weight_map":{"a":"../s1.safetensors"}})", {"'../s1.safetensors', not a file in the folder"});
  expect_index_error(R"({"weight_map":{"layers.0.weight":"gone.safetensors"}})",
                     {"lists file 'gone.safetensors', which does not exist"});
  expect_index_error(R"({"weight_map":{"layers.0.weight":"s2.safetensors"}})",
                     {"maps tensor 'layers.0.weight' to", "s2.safetensors", "no such tensor"});
  expect_index_error(R"({"weight_map":{"layers.0.weight":"s1.safetensors"}})",
                     {"tensor 'layers.1.weight' in", "s1.safetensors", "not listed in the index"});
  expect_index_error(R"({"weight_map":{"layers.0.weight":"s1.safetensors","layers.1.weight":"s1.safetensors",)"
                     R"("layers.2.weight":"s2.safetensors"}})",
                     {"tensor 'layers.1.weight' is in both", "s1.safetensors", "s2.safetensors"});
  // A broken shard reports the shard's own path.
  write_raw("s3.safetensors", "garbage!!");
  const std::string message = error_of([&] {
    write_raw("model.safetensors.index.json", R"({"weight_map":{"x":"s3.safetensors"}})");
    SafetensorsModel::open(dir_.string());
  });
  EXPECT_THAT(message, StartsWith("safetensors: " + path("s3.safetensors")));
}

}  // namespace
}  // namespace lathe::io
