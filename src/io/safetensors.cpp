// Safetensors reader, writer and sharded model folders (see safetensors.h, docs/safetensors.md).
// Convention: JSON is parsed twice, first by a SAX checker (syntax, depth, duplicate keys, which the
// DOM parser would silently resolve to the last value), then into a DOM that is validated field by
// field; nothing is exposed before both pass. Covered by tests/io/test_safetensors.cpp and the fuzzer.
#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <set>
#include <utility>

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace lathe::io {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

constexpr int kMaxJsonDepth = 16;  // a valid header nests 3 deep; deeper input is refused early
constexpr size_t kMaxShownBytes = 200;

// Makes untrusted text safe for an error message: control bytes become '?', non-ASCII bytes too
// when `ascii_only` (text that may not be UTF-8), and long text is cut at a UTF-8 boundary.
std::string shown(std::string_view s, bool ascii_only = false) {
  std::string out;
  size_t n = std::min(s.size(), kMaxShownBytes);
  while (n < s.size() && n > 0 && (uint8_t(s[n]) & 0xC0) == 0x80) --n;  // don't split a code point
  for (size_t i = 0; i < n; ++i) {
    const uint8_t c = uint8_t(s[i]);
    out += (c < 0x20 || c == 0x7f || (ascii_only && c >= 0x80)) ? '?' : char(c);
  }
  if (n < s.size()) out += "...";
  return out;
}

std::string_view safetensors_dtype_name(DType t) {
  switch (t) {
    case DType::F64: return "F64";
    case DType::F32: return "F32";
    case DType::BF16: return "BF16";
    case DType::F16: return "F16";
    case DType::I64: return "I64";
    case DType::I32: return "I32";
    case DType::U8: return "U8";
    case DType::Bool: return "BOOL";
  }
  LATHE_FAIL("safetensors: invalid dtype value {}", int(t));
}

std::optional<DType> safetensors_dtype_from_name(std::string_view name) {
  for (DType t : kAllDTypes)
    if (safetensors_dtype_name(t) == name) return t;
  return std::nullopt;
}

// First pass over JSON text with nlohmann's SAX parser: syntax, trailing bytes, nesting depth and
// duplicate keys. Builds nothing but one key set per open object.
class StrictJsonChecker {
 public:
  bool null() { return true; }
  bool boolean(bool) { return true; }
  bool number_integer(Json::number_integer_t) { return true; }
  bool number_unsigned(Json::number_unsigned_t) { return true; }
  bool number_float(Json::number_float_t, const Json::string_t&) { return true; }
  bool string(Json::string_t&) { return true; }
  bool binary(Json::binary_t&) { return true; }
  bool start_object(size_t) {
    keys_.emplace_back();
    return enter();
  }
  bool end_object() {
    keys_.pop_back();
    --depth_;
    return true;
  }
  bool start_array(size_t) { return enter(); }
  bool end_array() {
    --depth_;
    return true;
  }
  bool key(Json::string_t& k) {
    if (keys_.back().insert(k).second) return true;
    error_ = fmt::format("duplicate key '{}' (JSON object keys must be unique)", shown(k));
    return false;
  }
  bool parse_error(size_t, const std::string&, const Json::exception& e) {
    error_ = fmt::format("not valid JSON: {}", shown(e.what(), /*ascii_only=*/true));
    return false;
  }

  std::string error_;

 private:
  bool enter() {
    if (++depth_ <= kMaxJsonDepth) return true;
    error_ = fmt::format("JSON nested deeper than {} levels", kMaxJsonDepth);
    return false;
  }

  int depth_ = 0;
  std::vector<std::set<std::string>> keys_;
};

// Parses untrusted JSON; `what` ("header", "index") and `label` (a path) go into the message.
Json parse_json_strict(std::string_view text, std::string_view what, std::string_view label) {
  // nlohmann's lexer takes a NUL byte for the end of input, which would hide whatever follows it.
  const size_t nul = text.find('\0');
  LATHE_CHECK(nul == std::string_view::npos, "safetensors: {}: {} is not valid JSON: NUL byte at offset {}",
              label, what, nul);
  StrictJsonChecker checker;
  const bool ok = Json::sax_parse(text.begin(), text.end(), &checker);
  LATHE_CHECK(ok && checker.error_.empty(), "safetensors: {}: {} is {}", label, what,
              checker.error_.empty() ? std::string("not valid JSON") : checker.error_);
  try {
    return Json::parse(text.begin(), text.end());
  } catch (const Json::exception& e) {  // unreachable after the checker; kept as a guard
    LATHE_FAIL("safetensors: {}: {} is not valid JSON: {}", label, what, shown(e.what(), true));
  }
}

// A JSON value that must be a non-negative integer fitting in int64.
uint64_t get_count(const Json& j, std::string_view where, std::string_view what) {
  if (j.is_number_unsigned()) {
    const uint64_t v = j.get<uint64_t>();
    LATHE_CHECK(v <= uint64_t(std::numeric_limits<int64_t>::max()), "{}: {} is too large ({})", where,
                what, v);
    return v;
  }
  if (j.is_number_integer()) {
    const int64_t v = j.get<int64_t>();
    LATHE_CHECK(v >= 0, "{}: {} is negative ({})", where, what, v);
    return uint64_t(v);
  }
  if (j.is_number_float())
    LATHE_FAIL("{}: {} is not an integer ({})", where, what, shown(j.dump(), true));
  LATHE_FAIL("{}: {} is not an integer (got {})", where, what, j.type_name());
}

SafetensorsTensor parse_entry(const std::string& name, const Json& entry, uint64_t data_size,
                              std::string_view label) {
  const std::string where = fmt::format("safetensors: {}: tensor '{}'", label, shown(name));
  LATHE_CHECK(entry.is_object(), "{}: entry is not an object (got {})", where, entry.type_name());
  for (const auto& [key, value] : entry.items())
    LATHE_CHECK(key == "dtype" || key == "shape" || key == "data_offsets",
                "{}: unknown field '{}' (expected dtype, shape, data_offsets)", where, shown(key));
  const auto field = [&](const char* key) -> const Json& {
    const auto it = entry.find(key);
    LATHE_CHECK(it != entry.end(), "{}: missing field '{}'", where, key);
    return *it;
  };

  SafetensorsTensor t;
  t.name = name;
  const Json& dtype = field("dtype");
  LATHE_CHECK(dtype.is_string(), "{}: field 'dtype' is not a string (got {})", where, dtype.type_name());
  const std::string& dtype_str = dtype.get_ref<const std::string&>();
  const std::optional<DType> dt = safetensors_dtype_from_name(dtype_str);
  LATHE_CHECK(dt.has_value(), "{}: unsupported dtype '{}' (supported: F64, F32, BF16, F16, I64, I32, U8, BOOL)",
              where, shown(dtype_str));
  t.dtype = *dt;

  const Json& shape = field("shape");
  LATHE_CHECK(shape.is_array(), "{}: field 'shape' is not an array (got {})", where, shape.type_name());
  for (size_t i = 0; i < shape.size(); ++i)
    t.shape.push_back(int64_t(get_count(shape[i], where, fmt::format("shape[{}]", i))));
  // A zero dimension makes the tensor empty whatever the others are, so it cannot overflow.
  const bool empty = std::find(t.shape.begin(), t.shape.end(), 0) != t.shape.end();
  uint64_t numel = empty ? 0 : 1;
  for (size_t i = 0; i < t.shape.size() && !empty; ++i)
    LATHE_CHECK(!__builtin_mul_overflow(numel, uint64_t(t.shape[i]), &numel),
                "{}: element count of shape {} overflows", where, shown(shape.dump()));
  uint64_t expected_bytes = 0;
  LATHE_CHECK(!__builtin_mul_overflow(numel, uint64_t(dtype_size(t.dtype)), &expected_bytes) &&
                  numel <= uint64_t(std::numeric_limits<int64_t>::max()),
              "{}: byte size of shape {} x {} bytes overflows", where, shown(shape.dump()),
              dtype_size(t.dtype));
  t.numel = int64_t(numel);

  const Json& offsets = field("data_offsets");
  LATHE_CHECK(offsets.is_array() && offsets.size() == 2,
              "{}: field 'data_offsets' is not an array of two integers", where);
  t.data_begin = get_count(offsets[0], where, "data_offsets[0]");
  t.data_end = get_count(offsets[1], where, "data_offsets[1]");
  LATHE_CHECK(t.data_begin <= t.data_end, "{}: data_offsets [{}, {}] has begin > end", where, t.data_begin,
              t.data_end);
  LATHE_CHECK(t.byte_size() == expected_bytes,
              "{}: data_offsets [{}, {}] hold {} bytes but shape {} of {} needs {} bytes", where,
              t.data_begin, t.data_end, t.byte_size(), shown(shape.dump()), dtype_str, expected_bytes);
  LATHE_CHECK(t.data_end <= data_size,
              "{}: data_offsets [{}, {}] lie outside the data region of {} bytes", where, t.data_begin,
              t.data_end, data_size);
  return t;
}

}  // namespace

SafetensorsHeader parse_safetensors_header(std::string_view json, uint64_t data_size,
                                           std::string_view source_label) {
  const std::string_view label = source_label;
  // Only '{' may come first: no leading whitespace, and no BOM (which nlohmann would skip silently).
  LATHE_CHECK(!json.empty() && json.front() == '{',
              "safetensors: {}: header is not a JSON object: it does not start with '{{'", label);
  const Json root = parse_json_strict(json, "header", label);
  LATHE_CHECK(root.is_object(), "safetensors: {}: header is not a JSON object", label);

  SafetensorsHeader header;
  header.data_offset = 8 + uint64_t(json.size());
  for (const auto& [key, value] : root.items()) {
    if (key != "__metadata__") {
      header.tensors.push_back(parse_entry(key, value, data_size, label));
      continue;
    }
    LATHE_CHECK(value.is_object(), "safetensors: {}: __metadata__ is not a string->string map (got {})",
                label, value.type_name());
    for (const auto& [mkey, mvalue] : value.items()) {
      LATHE_CHECK(mvalue.is_string(),
                  "safetensors: {}: __metadata__ is not a string->string map: value of '{}' is {}", label,
                  shown(mkey), mvalue.type_name());
      header.metadata.emplace(mkey, mvalue.get<std::string>());
    }
  }

  auto& tensors = header.tensors;
  std::sort(tensors.begin(), tensors.end(), [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
    return std::tie(a.data_begin, a.data_end, a.name) < std::tie(b.data_begin, b.data_end, b.name);
  });
  // Gaps are allowed; overlaps are not. Empty tensors occupy no bytes and cannot overlap.
  const SafetensorsTensor* furthest = nullptr;  // the non-empty tensor ending last so far
  for (const SafetensorsTensor& t : tensors) {
    if (t.byte_size() == 0) continue;
    LATHE_CHECK(furthest == nullptr || t.data_begin >= furthest->data_end,
                "safetensors: {}: tensors '{}' [{}, {}] and '{}' [{}, {}] overlap", label,
                shown(furthest ? furthest->name : ""), furthest ? furthest->data_begin : 0,
                furthest ? furthest->data_end : 0, shown(t.name), t.data_begin, t.data_end);
    furthest = &t;
  }
  return header;
}

SafetensorsHeader parse_safetensors_bytes(std::span<const uint8_t> bytes, std::string_view source_label) {
  const std::string_view label = source_label;
  LATHE_CHECK(bytes.size() >= 8, "safetensors: {}: file is {} bytes, shorter than the 8-byte header size",
              label, bytes.size());
  uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | bytes[size_t(i)];  // little-endian
  LATHE_CHECK(header_size <= kMaxHeaderBytes, "safetensors: {}: header size {} exceeds the {}-byte limit",
              label, header_size, kMaxHeaderBytes);
  LATHE_CHECK(header_size <= bytes.size() - 8,
              "safetensors: {}: header size {} is larger than the {} bytes after the size field", label,
              header_size, bytes.size() - 8);
  const std::string_view json(reinterpret_cast<const char*>(bytes.data()) + 8, size_t(header_size));
  return parse_safetensors_header(json, bytes.size() - 8 - header_size, label);
}

namespace {

// Elements [first, first + count) of `tensor` into `out` as `dst`.
void convert_span(const SafetensorsTensor& tensor, size_t first, size_t count, DType dst, uint8_t* out,
                  std::string_view label) {
  const size_t src_size = dtype_size(tensor.dtype), dst_size = dtype_size(dst);
  if (tensor.dtype == dst) {
    if (count > 0) std::memcpy(out, tensor.data + first * src_size, count * dst_size);
    return;
  }
  LATHE_CHECK(is_floating(tensor.dtype) && is_floating(dst),
              "safetensors: {}: tensor '{}': cannot convert {} to {} (only between floating dtypes)", label,
              shown(tensor.name), dtype_name(tensor.dtype), dtype_name(dst));
  // Elements are copied through aligned scratch: mapped data is not aligned to the element size.
  alignas(8) uint8_t in[8], res[8];
  for (size_t i = 0; i < count; ++i) {
    std::memcpy(in, tensor.data + (first + i) * src_size, src_size);
    store_from_double(res, dst, 0, load_as_double(in, tensor.dtype, 0));
    std::memcpy(out + i * dst_size, res, dst_size);
  }
}

}  // namespace

void convert_tensor(const SafetensorsTensor& tensor, DType dst, void* out, size_t out_bytes,
                    std::string_view source_label) {
  const std::string_view label = source_label;
  const size_t dst_size = dtype_size(dst);
  const size_t n = size_t(tensor.numel);
  LATHE_CHECK(tensor.data != nullptr || tensor.byte_size() == 0,
              "safetensors: {}: tensor '{}' has no data (a bare header entry)", label, shown(tensor.name));
  LATHE_CHECK(out_bytes / dst_size == n && out_bytes % dst_size == 0,
              "safetensors: {}: tensor '{}' has {} elements but the {} output buffer holds {} bytes", label,
              shown(tensor.name), n, dtype_name(dst), out_bytes);
  convert_span(tensor, 0, n, dst, static_cast<uint8_t*>(out), label);
}

namespace {

// The 2-D box [offset, offset + box) of `tensor`, row by row, into `out` as `dst`.
void convert_box(const SafetensorsTensor& tensor, const std::vector<int64_t>& offset, const std::vector<int64_t>& box,
                 DType dst, void* out, size_t out_bytes, std::string_view label) {
  const size_t dst_size = dtype_size(dst);
  LATHE_CHECK(tensor.data != nullptr || tensor.byte_size() == 0,
              "safetensors: {}: tensor '{}' has no data (a bare header entry)", label, shown(tensor.name));
  // The tensor viewed as 2-D: dim 0 by the product of the others (a 1-D tensor: one column).
  int64_t cols = 1;
  for (size_t d = 1; d < tensor.shape.size(); ++d) cols *= tensor.shape[d];
  LATHE_CHECK(!tensor.shape.empty() && offset.size() == 2 && box.size() == 2 && offset[0] >= 0 && offset[1] >= 0 &&
                  offset[0] + box[0] <= tensor.shape[0] && offset[1] + box[1] <= cols,
              "safetensors: {}: tensor '{}' {}: the box at ({}, {}) of {} x {} is not inside it", label,
              shown(tensor.name), fmt::join(tensor.shape, "x"), offset.empty() ? -1 : offset[0],
              offset.size() < 2 ? -1 : offset[1], box.empty() ? -1 : box[0], box.size() < 2 ? -1 : box[1]);
  LATHE_CHECK(out_bytes == size_t(box[0] * box[1]) * dst_size,
              "safetensors: {}: tensor '{}': a box of {} x {} does not fill {} bytes of {}", label, shown(tensor.name),
              box[0], box[1], out_bytes, dtype_name(dst));
  for (int64_t r = 0; r < box[0]; ++r)
    convert_span(tensor, size_t((offset[0] + r) * cols + offset[1]), size_t(box[1]), dst,
                 static_cast<uint8_t*>(out) + size_t(r * box[1]) * dst_size, label);
}

}  // namespace

// ---- SafetensorsFile ----

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  SafetensorsFile file;
  file.path_ = path;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  LATHE_CHECK(fd >= 0, "safetensors: {}: cannot open: {}", path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    LATHE_FAIL("safetensors: {}: cannot stat: {}", path, std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    LATHE_FAIL("safetensors: {}: not a regular file", path);
  }
  const size_t size = size_t(st.st_size);
  if (size < 8) {  // checked here because mmap of zero bytes fails
    ::close(fd);
    LATHE_FAIL("safetensors: {}: file is {} bytes, shorter than the 8-byte header size", path, size);
  }
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int err = errno;
  ::close(fd);  // the mapping keeps the file alive
  LATHE_CHECK(map != MAP_FAILED, "safetensors: {}: cannot mmap {} bytes: {}", path, size, std::strerror(err));
  file.map_ = map;
  file.map_size_ = size;

  const auto* base = static_cast<const uint8_t*>(map);
  file.header_ = parse_safetensors_bytes({base, size}, path);  // on throw, ~SafetensorsFile unmaps
  for (size_t i = 0; i < file.header_.tensors.size(); ++i) {
    SafetensorsTensor& t = file.header_.tensors[i];
    t.data = base + file.header_.data_offset + t.data_begin;
    file.by_name_.emplace(t.name, i);
  }
  return file;
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept
    : path_(std::move(other.path_)),
      map_(std::exchange(other.map_, nullptr)),
      map_size_(std::exchange(other.map_size_, 0)),
      header_(std::move(other.header_)),
      by_name_(std::move(other.by_name_)) {}

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept {
  if (this != &other) {
    unmap();
    path_ = std::move(other.path_);
    map_ = std::exchange(other.map_, nullptr);
    map_size_ = std::exchange(other.map_size_, 0);
    header_ = std::move(other.header_);
    by_name_ = std::move(other.by_name_);
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() { unmap(); }

void SafetensorsFile::unmap() {
  if (map_) ::munmap(map_, map_size_);
  map_ = nullptr;
  map_size_ = 0;
}

const SafetensorsTensor* SafetensorsFile::find(std::string_view name) const {
  const auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &header_.tensors[it->second];
}

const SafetensorsTensor& SafetensorsFile::get(std::string_view name) const {
  const SafetensorsTensor* t = find(name);
  LATHE_CHECK(t != nullptr, "safetensors: {}: no tensor '{}'", path_, shown(name));
  return *t;
}

std::vector<float> SafetensorsFile::read_as_f32(std::string_view name) const {
  const SafetensorsTensor& t = get(name);
  std::vector<float> out(size_t(t.numel));
  convert_tensor(t, DType::F32, out.data(), out.size() * sizeof(float), path_);
  return out;
}

void SafetensorsFile::read_into(std::string_view name, DType dst, void* out, size_t out_bytes) const {
  convert_tensor(get(name), dst, out, out_bytes, path_);
}

void SafetensorsFile::read_box_into(std::string_view name, const std::vector<int64_t>& offset,
                                    const std::vector<int64_t>& box, DType dst, void* out, size_t out_bytes) const {
  convert_box(get(name), offset, box, dst, out, out_bytes, path_);
}

// ---- writer ----

namespace {

struct ByteSpan {
  const void* data;
  size_t size;
};

[[noreturn]] void fail_errno(std::string_view path, std::string_view action, int err) {
  LATHE_FAIL("safetensors: {}: {}: {}", path, action, std::strerror(err));
}

void fsync_dir(const std::string& path) {
  fs::path dir = fs::path(path).parent_path();
  if (dir.empty()) dir = ".";
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) fail_errno(path, fmt::format("cannot open folder {} to sync it", dir.string()), errno);
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0 && err != EINVAL) fail_errno(path, "cannot sync its folder", err);  // EINVAL: no dir fsync
}

// Writes `chunks` to `path + ".tmp.<pid>"`, syncs it and renames it over `path`; on failure the temp
// file is removed and `path` is untouched.
void atomic_write_file(const std::string& path, const std::vector<ByteSpan>& chunks) {
  const std::string tmp = fmt::format("{}.tmp.{}", path, ::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail_errno(path, fmt::format("cannot create temporary file {}", tmp), errno);
  try {
    for (const ByteSpan& chunk : chunks) {
      const auto* p = static_cast<const uint8_t*>(chunk.data);
      size_t left = chunk.size;
      while (left > 0) {
        const ssize_t n = ::write(fd, p, left);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) fail_errno(path, fmt::format("cannot write {}", tmp), n < 0 ? errno : EIO);
        p += n;
        left -= size_t(n);
      }
    }
    if (::fsync(fd) != 0) fail_errno(path, fmt::format("cannot sync {}", tmp), errno);
    const int rc = ::close(fd);
    fd = -1;
    if (rc != 0) fail_errno(path, fmt::format("cannot close {}", tmp), errno);
    if (::rename(tmp.c_str(), path.c_str()) != 0)
      fail_errno(path, fmt::format("cannot rename {} over it", tmp), errno);
  } catch (...) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  fsync_dir(path);
}

std::string json_quoted(std::string_view s, std::string_view label) {
  try {
    return Json(std::string(s)).dump();  // throws on invalid UTF-8
  } catch (const Json::exception&) {
    LATHE_FAIL("safetensors: {}: '{}' is not valid UTF-8", label, shown(s, true));
  }
}

// Sorts tensors by name and checks names, shapes and buffer sizes (throwing on the first problem).
void prepare_tensors(std::vector<TensorRef>& tensors, std::string_view label) {
  std::sort(tensors.begin(), tensors.end(),
            [](const TensorRef& a, const TensorRef& b) { return a.name < b.name; });
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorRef& t = tensors[i];
    LATHE_CHECK(i == 0 || tensors[i - 1].name != t.name, "safetensors: {}: duplicate tensor name '{}'", label,
                shown(t.name));
    LATHE_CHECK(t.name != "__metadata__", "safetensors: {}: '__metadata__' is reserved, not a tensor name",
                label);
    for (int64_t d : t.shape)
      LATHE_CHECK(d >= 0, "safetensors: {}: tensor '{}': negative dimension {}", label, shown(t.name), d);
    // As in the reader, a zero dimension makes the tensor empty whatever the others are.
    const bool empty = std::find(t.shape.begin(), t.shape.end(), 0) != t.shape.end();
    uint64_t bytes = empty ? 0 : dtype_size(t.dtype);
    for (size_t k = 0; k < t.shape.size() && !empty; ++k)
      LATHE_CHECK(!__builtin_mul_overflow(bytes, uint64_t(t.shape[k]), &bytes),
                  "safetensors: {}: tensor '{}': byte size overflows", label, shown(t.name));
    LATHE_CHECK(bytes == t.byte_size,
                "safetensors: {}: tensor '{}': buffer holds {} bytes but shape {} of {} needs {} bytes", label,
                shown(t.name), t.byte_size, fmt::join(t.shape, "x"), safetensors_dtype_name(t.dtype), bytes);
    LATHE_CHECK(t.data != nullptr || t.byte_size == 0, "safetensors: {}: tensor '{}' has a null data pointer",
                label, shown(t.name));
  }
}

}  // namespace

void write_safetensors(const std::string& path, std::vector<TensorRef> tensors,
                       const std::map<std::string, std::string>& metadata) {
  prepare_tensors(tensors, path);
  // Compact JSON in the reference library's layout: __metadata__ first, then
  // {"dtype","shape","data_offsets"} per tensor.
  std::string header = "{";
  if (!metadata.empty()) {
    header += "\"__metadata__\":{";
    bool first = true;
    for (const auto& [key, value] : metadata) {
      header += fmt::format("{}{}:{}", first ? "" : ",", json_quoted(key, path), json_quoted(value, path));
      first = false;
    }
    header += "}";
  }
  uint64_t offset = 0;
  for (const TensorRef& t : tensors) {
    if (header.size() > 1) header += ",";
    header += fmt::format("{}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{},{}]}}",
                          json_quoted(t.name, path), safetensors_dtype_name(t.dtype), fmt::join(t.shape, ","),
                          offset, offset + t.byte_size);
    offset += t.byte_size;
  }
  header += "}";
  header.append((8 - header.size() % 8) % 8, ' ');  // the data region starts 8-byte aligned
  LATHE_CHECK(header.size() <= kMaxHeaderBytes, "safetensors: {}: header of {} bytes exceeds the {}-byte limit",
              path, header.size(), kMaxHeaderBytes);

  uint8_t size_field[8];
  for (int i = 0; i < 8; ++i) size_field[i] = uint8_t(uint64_t(header.size()) >> (8 * i));
  std::vector<ByteSpan> chunks = {{size_field, 8}, {header.data(), header.size()}};
  for (const TensorRef& t : tensors) chunks.push_back({t.data, t.byte_size});
  atomic_write_file(path, chunks);
}

namespace {

std::string shard_file_name(size_t i, size_t n) {
  return fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, n);
}

// Matches "model-DDDDD-of-DDDDD.safetensors".
bool is_shard_file_name(std::string_view name) {
  const std::string_view pattern = "model-#####-of-#####.safetensors";
  if (name.size() != pattern.size()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const bool ok = pattern[i] == '#' ? (name[i] >= '0' && name[i] <= '9') : name[i] == pattern[i];
    if (!ok) return false;
  }
  return true;
}

void remove_file(const fs::path& path) {
  std::error_code ec;
  fs::remove(path, ec);
  LATHE_CHECK(!ec, "safetensors: {}: cannot remove stale file: {}", path.string(), ec.message());
}

}  // namespace

void write_sharded_safetensors(const std::string& dir, std::vector<TensorRef> tensors,
                               uint64_t max_shard_bytes, const std::map<std::string, std::string>& metadata) {
  LATHE_CHECK(max_shard_bytes > 0, "safetensors: {}: max_shard_bytes must be positive", dir);
  prepare_tensors(tensors, dir);  // everything is checked before any file is written
  std::error_code ec;
  fs::create_directories(dir, ec);
  LATHE_CHECK(!ec, "safetensors: {}: cannot create folder: {}", dir, ec.message());

  std::vector<std::vector<TensorRef>> shards;
  uint64_t shard_bytes = 0, total_bytes = 0;
  for (TensorRef& t : tensors) {
    if (shards.empty() || (!shards.back().empty() && shard_bytes + t.byte_size > max_shard_bytes)) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shard_bytes += t.byte_size;
    total_bytes += t.byte_size;
    shards.back().push_back(std::move(t));
  }
  if (shards.empty()) shards.emplace_back();  // no tensors: one empty model.safetensors
  LATHE_CHECK(shards.size() <= 99999, "safetensors: {}: {} shards exceed the 5-digit file naming", dir,
              shards.size());

  // The index goes first and comes back last: an interrupted save leaves either the previous
  // single-file checkpoint or a folder that refuses to open, never an old index over new shards.
  const fs::path folder(dir);
  remove_file(folder / kSafetensorsIndexFile);
  std::set<std::string> written;
  if (shards.size() == 1) {
    write_safetensors((folder / kSafetensorsSingleFile).string(), std::move(shards[0]), metadata);
    written.insert(kSafetensorsSingleFile);
  } else {
    Json index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", Json::object()}};
    for (size_t i = 0; i < shards.size(); ++i) {
      const std::string file = shard_file_name(i, shards.size());
      for (const TensorRef& t : shards[i]) index["weight_map"][t.name] = file;
      write_safetensors((folder / file).string(), std::move(shards[i]), metadata);
      written.insert(file);
    }
    const std::string text = index.dump(2) + "\n";  // names were checked as UTF-8 by the writer
    atomic_write_file((folder / kSafetensorsIndexFile).string(), {{text.data(), text.size()}});
    written.insert(kSafetensorsIndexFile);
  }

  // Remove what an earlier save left behind, so the folder never describes two checkpoints.
  std::vector<fs::path> stale;
  for (const fs::directory_entry& e : fs::directory_iterator(folder, ec)) {
    const std::string name = e.path().filename().string();
    const bool ours = name == kSafetensorsSingleFile || name == kSafetensorsIndexFile || is_shard_file_name(name);
    if (ours && !written.count(name)) stale.push_back(e.path());
  }
  LATHE_CHECK(!ec, "safetensors: {}: cannot list folder: {}", dir, ec.message());
  for (const fs::path& p : stale) remove_file(p);
  fsync_dir((folder / kSafetensorsIndexFile).string());
}

// ---- SafetensorsModel ----

namespace {

std::string read_text_file(const std::string& path, uint64_t max_bytes) {
  std::ifstream in(path, std::ios::binary);
  LATHE_CHECK(in.good(), "safetensors: {}: cannot open: {}", path, std::strerror(errno));
  in.seekg(0, std::ios::end);
  const std::streamoff size = in.tellg();
  LATHE_CHECK(size >= 0 && uint64_t(size) <= max_bytes, "safetensors: {}: file size {} exceeds the {}-byte limit",
              path, int64_t(size), max_bytes);
  std::string text(size_t(size), '\0');
  in.seekg(0);
  in.read(text.data(), size);
  LATHE_CHECK(in.good() || size == 0, "safetensors: {}: read failed", path);
  return text;
}

}  // namespace

SafetensorsModel SafetensorsModel::open(const std::string& dir) {
  const fs::path folder(dir);
  std::error_code ec;
  LATHE_CHECK(fs::is_directory(folder, ec), "safetensors: {}: not a folder", dir);
  SafetensorsModel model;
  model.dir_ = dir;
  const fs::path index_path = folder / kSafetensorsIndexFile;

  if (!fs::exists(index_path, ec)) {
    const fs::path single = folder / kSafetensorsSingleFile;
    LATHE_CHECK(fs::exists(single, ec), "safetensors: {}: folder has neither {} nor {}", dir,
                kSafetensorsIndexFile, kSafetensorsSingleFile);
    model.files_.push_back(SafetensorsFile::open(single.string()));
    for (const SafetensorsTensor& t : model.files_[0].tensors()) model.file_of_.emplace(t.name, 0);
    return model;
  }

  const std::string label = index_path.string();
  const Json index = parse_json_strict(read_text_file(label, kMaxHeaderBytes), "index", label);
  LATHE_CHECK(index.is_object(), "safetensors: {}: index is not a JSON object", label);
  const auto wm = index.find("weight_map");
  LATHE_CHECK(wm != index.end() && wm->is_object(), "safetensors: {}: index has no 'weight_map' object", label);

  // Open every listed file once, in name order.
  std::map<std::string, size_t> file_index;
  for (const auto& [name, file] : wm->items()) {
    LATHE_CHECK(file.is_string(), "safetensors: {}: weight_map entry '{}' is not a file name (got {})", label,
                shown(name), file.type_name());
    const std::string& f = file.get_ref<const std::string&>();
    LATHE_CHECK(!f.empty() && f != "." && f != ".." && f.find('/') == std::string::npos,
                "safetensors: {}: weight_map entry '{}' names '{}', not a file in the folder", label,
                shown(name), shown(f));
    file_index.emplace(f, 0);
  }
  for (auto& [f, i] : file_index) {
    const fs::path path = folder / f;
    LATHE_CHECK(fs::is_regular_file(path, ec), "safetensors: {}: index lists file '{}', which does not exist",
                label, shown(f));
    i = model.files_.size();
    model.files_.push_back(SafetensorsFile::open(path.string()));
  }
  for (const auto& [name, file] : wm->items()) {
    const size_t i = file_index.at(file.get<std::string>());
    LATHE_CHECK(model.files_[i].find(name) != nullptr,
                "safetensors: {}: index maps tensor '{}' to '{}', which has no such tensor", label, shown(name),
                model.files_[i].path());
    model.file_of_.emplace(name, i);
  }
  // Every tensor of every file must be the one the index names (so none is in two files).
  for (size_t i = 0; i < model.files_.size(); ++i) {
    for (const SafetensorsTensor& t : model.files_[i].tensors()) {
      const auto it = model.file_of_.find(t.name);
      LATHE_CHECK(it != model.file_of_.end(), "safetensors: {}: tensor '{}' in {} is not listed in the index",
                  label, shown(t.name), model.files_[i].path());
      LATHE_CHECK(it->second == i, "safetensors: {}: tensor '{}' is in both {} and {}", label, shown(t.name),
                  model.files_[it->second].path(), model.files_[i].path());
    }
  }
  return model;
}

std::vector<std::string> SafetensorsModel::names() const {
  std::vector<std::string> out;
  out.reserve(file_of_.size());
  for (const auto& [name, i] : file_of_) out.push_back(name);
  return out;
}

const SafetensorsTensor* SafetensorsModel::find(std::string_view name) const {
  const auto it = file_of_.find(name);
  return it == file_of_.end() ? nullptr : files_[it->second].find(name);
}

const SafetensorsTensor& SafetensorsModel::get(std::string_view name) const { return file_of(name).get(name); }

const SafetensorsFile& SafetensorsModel::file_of(std::string_view name) const {
  const auto it = file_of_.find(name);
  LATHE_CHECK(it != file_of_.end(), "safetensors: {}: no tensor '{}' in the model folder", dir_, shown(name));
  return files_[it->second];
}

std::vector<float> SafetensorsModel::read_as_f32(std::string_view name) const {
  return file_of(name).read_as_f32(name);
}

void SafetensorsModel::read_into(std::string_view name, DType dst, void* out, size_t out_bytes) const {
  file_of(name).read_into(name, dst, out, out_bytes);
}

void SafetensorsModel::read_box_into(std::string_view name, const std::vector<int64_t>& offset,
                                     const std::vector<int64_t>& box, DType dst, void* out, size_t out_bytes) const {
  file_of(name).read_box_into(name, offset, box, dst, out, out_bytes);
}

}  // namespace lathe::io
