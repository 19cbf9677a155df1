// TensorBoard event-file writer (format in tensorboard.h): a table-driven CRC32C, the few protobuf encodings
// needed (varint keys, int64 and enum, fixed64 double, fixed32 float, length-delimited strings and messages), and
// the file. Covered by tests/unit/test_metrics.cpp.
#include "train/tensorboard.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>

#include "core/error.h"

namespace lathe {

namespace tb {

namespace {

constexpr std::array<uint32_t, 256> make_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;  // reflected 0x1EDC6F41
    t[i] = c;
  }
  return t;
}
constexpr std::array<uint32_t, 256> kTable = make_table();

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(char(uint8_t(v) | 0x80));
    v >>= 7;
  }
  out.push_back(char(v));
}

template <typename T> void put_le(std::string& out, T v) {  // fixed-width little-endian
  uint8_t b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  if constexpr (std::endian::native == std::endian::big) std::reverse(b, b + sizeof(T));
  out.append(reinterpret_cast<const char*>(b), sizeof(T));
}

enum Wire : uint32_t { kVarint = 0, kFixed64 = 1, kBytes = 2, kFixed32 = 5 };

void put_key(std::string& out, uint32_t field, Wire wire) { put_varint(out, (uint64_t(field) << 3) | wire); }

void put_bytes(std::string& out, uint32_t field, std::string_view bytes) {
  put_key(out, field, kBytes);
  put_varint(out, bytes.size());
  out.append(bytes);
}

std::string event_header(double wall_time, int64_t step) {
  std::string e;
  put_key(e, 1, kFixed64);
  put_le(e, wall_time);
  if (step != 0) {  // proto3 default: omitted when 0
    put_key(e, 2, kVarint);
    put_varint(e, uint64_t(step));  // negative steps take ten bytes, as protobuf encodes int64
  }
  return e;
}

}  // namespace

uint32_t crc32c(const void* data, size_t size, uint32_t crc) {
  const auto* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
  for (size_t i = 0; i < size; ++i) crc = kTable[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

uint32_t masked_crc32c(const void* data, size_t size) {
  const uint32_t c = crc32c(data, size);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::string tfrecord(std::string_view data) {
  std::string header;
  put_le(header, uint64_t(data.size()));
  std::string out = header;
  put_le(out, masked_crc32c(header.data(), header.size()));
  out.append(data);
  put_le(out, masked_crc32c(data.data(), data.size()));
  return out;
}

std::string file_version_event(double wall_time, std::string_view version) {
  std::string e = event_header(wall_time, 0);
  put_bytes(e, 3, version);
  return e;
}

std::string scalars_event(double wall_time, int64_t step, const std::vector<std::pair<std::string, float>>& values) {
  std::string summary;
  for (const auto& [tag, v] : values) {
    std::string value;
    put_bytes(value, 1, tag);
    put_key(value, 2, kFixed32);
    put_le(value, v);
    put_bytes(summary, 1, value);
  }
  std::string e = event_header(wall_time, step);
  put_bytes(e, 5, summary);
  return e;
}

std::string histogram_event(double wall_time, int64_t step, const std::string& tag, std::vector<double> values) {
  std::sort(values.begin(), values.end());
  std::string histo;
  double sum = 0, squares = 0;
  for (double v : values) sum += v, squares += v * v;
  std::string limits, counts;  // one bucket per distinct value, its right edge the value: (previous, value]
  for (size_t i = 0; i < values.size();) {
    size_t j = i;
    while (j < values.size() && values[j] == values[i]) ++j;
    put_le(limits, values[i]);
    put_le(counts, double(j - i));
    i = j;
  }
  for (const auto& [field, v] : {std::pair{1u, values.empty() ? 0.0 : values.front()},
                                 {2u, values.empty() ? 0.0 : values.back()}, {3u, double(values.size())}, {4u, sum},
                                 {5u, squares}}) {
    put_key(histo, field, kFixed64);
    put_le(histo, v);
  }
  put_bytes(histo, 6, limits);  // packed doubles
  put_bytes(histo, 7, counts);
  std::string value;
  put_bytes(value, 1, tag);
  put_bytes(value, 5, histo);
  std::string summary;
  put_bytes(summary, 1, value);
  std::string e = event_header(wall_time, step);
  put_bytes(e, 5, summary);
  return e;
}

std::string session_start_event(double wall_time, int64_t step) {
  std::string log;
  put_key(log, 1, kVarint);
  put_varint(log, 1);  // SessionLog.START
  std::string e = event_header(wall_time, step);
  put_bytes(e, 7, log);
  return e;
}

}  // namespace tb

namespace {

double wall_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

TensorBoardWriter::TensorBoardWriter(const std::string& logdir, std::optional<int64_t> first_step) {
  std::error_code ec;
  std::filesystem::create_directories(logdir, ec);
  LATHE_CHECK(!ec, "tensorboard: cannot create {}: {}", logdir, ec.message());
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0 || host[0] == '\0') std::strcpy(host, "localhost");
  const auto secs = int64_t(wall_seconds());
  for (int n = 0; fd_ < 0; ++n) {  // a second writer in the same second and process takes the next number
    path_ = fmt::format("{}/events.out.tfevents.{:010d}.{}.{}.{}", logdir, secs, host, ::getpid(), n);
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_CLOEXEC, 0644);
    LATHE_CHECK(fd_ >= 0 || errno == EEXIST, "tensorboard: cannot create {}: {}", path_, std::strerror(errno));
  }
  append(tb::file_version_event(wall_seconds(), "brain.Event:2"));
  if (first_step) append(tb::session_start_event(wall_seconds(), *first_step));
}

TensorBoardWriter::~TensorBoardWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void TensorBoardWriter::add_scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values) {
  std::vector<std::pair<std::string, float>> v;
  for (const auto& [tag, x] : values) v.emplace_back(tag, float(x));
  append(tb::scalars_event(wall_seconds(), step, v));
}

void TensorBoardWriter::add_histogram(int64_t step, const std::string& tag, const std::vector<double>& values) {
  append(tb::histogram_event(wall_seconds(), step, tag, values));
}

void TensorBoardWriter::append(const std::string& event) {
  const std::string record = tb::tfrecord(event);
  size_t done = 0;
  while (done < record.size()) {
    const ssize_t n = ::write(fd_, record.data() + done, record.size() - done);
    if (n < 0 && errno == EINTR) continue;
    LATHE_CHECK(n > 0, "tensorboard: cannot write {}: {}", path_, std::strerror(errno));
    done += size_t(n);
  }
}

}  // namespace lathe
