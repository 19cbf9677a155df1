// Metrics outputs: metrics.jsonl (append, null for NaN, truncate_after for resume, repair of a torn last line) and
// TensorBoard event files (CRC32C known vectors; a decoder here parses the records back and checks the TFRecord
// framing and every protobuf field). dev/ref/check_tensorboard.py checks the files with tensorboard itself.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "train/metrics.h"
#include "train/tensorboard.h"

using namespace lathe;

namespace {

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::vector<std::string> lines_of(const std::string& path) {
  std::vector<std::string> out;
  std::istringstream in(read_text(path));
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

std::string fresh_dir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/" + name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// A protobuf reader for the few wire types an Event uses.
struct Reader {
  std::string_view s;
  size_t pos = 0;
  bool done() const { return pos >= s.size(); }
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0;; shift += 7) {
      if (pos >= s.size() || shift > 63) throw std::runtime_error("truncated varint");
      const uint8_t b = uint8_t(s[pos++]);
      v |= uint64_t(b & 0x7F) << shift;
      if (!(b & 0x80)) return v;
    }
  }
  template <typename T> T fixed() {
    if (pos + sizeof(T) > s.size()) throw std::runtime_error("truncated fixed");
    T v;
    std::memcpy(&v, s.data() + pos, sizeof(T));  // little-endian host (x86, arm64)
    pos += sizeof(T);
    return v;
  }
  std::string_view bytes() {
    const uint64_t n = varint();
    if (pos + n > s.size()) throw std::runtime_error("truncated bytes");
    const std::string_view b = s.substr(pos, n);
    pos += n;
    return b;
  }
};

struct DecodedEvent {
  double wall_time = 0;
  int64_t step = 0;
  std::string file_version;
  int session_status = -1;  // -1: no session_log
  std::vector<std::pair<std::string, float>> values;
};

DecodedEvent decode_event(std::string_view data) {
  DecodedEvent e;
  Reader r{data};
  while (!r.done()) {
    const uint64_t key = r.varint();
    const uint64_t field = key >> 3, wire = key & 7;
    if (field == 1 && wire == 1) e.wall_time = r.fixed<double>();
    else if (field == 2 && wire == 0) e.step = int64_t(r.varint());
    else if (field == 3 && wire == 2) e.file_version = std::string(r.bytes());
    else if (field == 7 && wire == 2) {
      Reader log{r.bytes()};
      e.session_status = 0;
      while (!log.done()) {
        if (log.varint() != ((1 << 3) | 0)) throw std::runtime_error("unexpected SessionLog field");
        e.session_status = int(log.varint());
      }
    }
    else if (field == 5 && wire == 2) {
      Reader summary{r.bytes()};
      while (!summary.done()) {
        if (summary.varint() != ((1 << 3) | 2)) throw std::runtime_error("unexpected Summary field");
        Reader value{summary.bytes()};
        std::pair<std::string, float> v;
        while (!value.done()) {
          const uint64_t k = value.varint();
          if (k == ((1 << 3) | 2)) v.first = std::string(value.bytes());
          else if (k == ((2 << 3) | 5)) v.second = value.fixed<float>();
          else throw std::runtime_error("unexpected Summary.Value field");
        }
        e.values.push_back(v);
      }
    } else {
      throw std::runtime_error("unexpected Event field " + std::to_string(field));
    }
  }
  return e;
}

// Splits a TFRecord file into its records, checking both masked CRCs of each.
std::vector<std::string> read_records(const std::string& bytes) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < bytes.size()) {
    EXPECT_LE(pos + 12, bytes.size()) << "truncated record header";
    uint64_t len;
    uint32_t len_crc, data_crc;
    std::memcpy(&len, bytes.data() + pos, 8);
    std::memcpy(&len_crc, bytes.data() + pos + 8, 4);
    EXPECT_EQ(len_crc, tb::masked_crc32c(bytes.data() + pos, 8)) << "length crc at " << pos;
    EXPECT_LE(pos + 12 + len + 4, bytes.size()) << "truncated record";
    const std::string data = bytes.substr(pos + 12, len);
    std::memcpy(&data_crc, bytes.data() + pos + 12 + len, 4);
    EXPECT_EQ(data_crc, tb::masked_crc32c(data.data(), data.size())) << "data crc at " << pos;
    out.push_back(data);
    pos += 12 + len + 4;
  }
  return out;
}

}  // namespace

TEST(Crc32c, KnownVectors) {
  EXPECT_EQ(tb::crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(tb::crc32c("", 0), 0u);
  uint8_t buf[32];
  std::memset(buf, 0, 32);
  EXPECT_EQ(tb::crc32c(buf, 32), 0x8A9136AAu);  // RFC 3720 B.4
  std::memset(buf, 0xFF, 32);
  EXPECT_EQ(tb::crc32c(buf, 32), 0x62A8AB43u);
  for (int i = 0; i < 32; ++i) buf[i] = uint8_t(i);
  EXPECT_EQ(tb::crc32c(buf, 32), 0x46DD794Eu);
  // Incremental use continues a running value.
  EXPECT_EQ(tb::crc32c("56789", 5, tb::crc32c("1234", 4)), 0xE3069283u);
}

TEST(TensorBoard, RecordsDecodeBack) {
  const std::string dir = fresh_dir("lathe_tb") + "/run";  // created by the writer
  std::string path;
  {
    TensorBoardWriter w(dir, 1);
    path = w.path();
    w.add_scalars(1, {{"train/loss", 2.5}, {"train/lr", 1e-4}});
    w.add_scalar("train/loss", 1.25, 2);
    w.add_scalar("eval/loss", -3.0, 300000);
  }
  const std::string name = std::filesystem::path(path).filename().string();
  EXPECT_EQ(name.rfind("events.out.tfevents.", 0), 0u) << name;
  EXPECT_EQ(name.substr(name.size() - 2), ".0") << name;

  const std::vector<std::string> records = read_records(read_text(path));
  ASSERT_EQ(records.size(), 5u);
  const DecodedEvent first = decode_event(records[0]);
  EXPECT_EQ(first.file_version, "brain.Event:2");
  EXPECT_GT(first.wall_time, 1.6e9);
  const DecodedEvent start = decode_event(records[1]);
  EXPECT_EQ(start.session_status, 1);  // START
  EXPECT_EQ(start.step, 1);
  EXPECT_TRUE(start.values.empty());
  const DecodedEvent e1 = decode_event(records[2]);
  EXPECT_EQ(e1.step, 1);
  ASSERT_EQ(e1.values.size(), 2u);
  EXPECT_EQ(e1.values[0].first, "train/loss");
  EXPECT_EQ(e1.values[0].second, 2.5f);
  EXPECT_EQ(e1.values[1].first, "train/lr");
  EXPECT_EQ(e1.values[1].second, 1e-4f);
  EXPECT_GE(e1.wall_time, first.wall_time);
  const DecodedEvent e3 = decode_event(records[4]);
  EXPECT_EQ(e3.step, 300000);
  ASSERT_EQ(e3.values.size(), 1u);
  EXPECT_EQ(e3.values[0], (std::pair<std::string, float>{"eval/loss", -3.0f}));

  // A second writer in the same folder (and likely the same second) gets a file of its own.
  TensorBoardWriter again(dir, 1);
  EXPECT_NE(again.path(), path);
}

// A run resumed from a checkpoint at step 2 writes a new file starting with SessionLog START at step 3. TensorBoard
// itself then drops the orphaned points (steps 3..5 of the first file): dev/ref/check_tensorboard.py on this folder
// should show train/loss at steps 1, 2, 3, 4 = 11, 12, 23, 24 (run with TEST_TMPDIR=DIR: DIR/lathe_tb_resume).
TEST(TensorBoard, ResumeWritesANewFile) {
  const std::string dir = fresh_dir("lathe_tb_resume");
  std::string first_path;
  {
    TensorBoardWriter first(dir, 1);
    first_path = first.path();
    for (int s = 1; s <= 5; ++s) first.add_scalar("train/loss", 10 + s, s);
  }
  TensorBoardWriter second(dir, 3);
  for (int s = 3; s <= 4; ++s) second.add_scalar("train/loss", 20 + s, s);
  EXPECT_LT(first_path, second.path());  // TensorBoard reads the files in name order
  const std::vector<std::string> a = read_records(read_text(first_path)), b = read_records(read_text(second.path()));
  ASSERT_EQ(a.size(), 7u);
  ASSERT_EQ(b.size(), 4u);
  EXPECT_EQ(decode_event(b[1]).session_status, 1);
  EXPECT_EQ(decode_event(b[1]).step, 3);
  EXPECT_EQ(decode_event(b[2]).step, 3);
  EXPECT_EQ(decode_event(b[2]).values.at(0).second, 23.0f);
}

TEST(TensorBoard, EncodingBytes) {
  // Event{wall_time: 1.0, step: 300, summary{value{tag: "a", simple_value: 1.0}}}, encoded by hand.
  const std::string e = tb::scalars_event(1.0, 300, {{"a", 1.0f}});
  const std::string want("\x09\x00\x00\x00\x00\x00\x00\xf0\x3f"  // 1: fixed64 double 1.0
                         "\x10\xac\x02"                            // 2: varint 300
                         "\x2a\x0a"                                // 5: summary, 10 bytes
                         "\x0a\x08"                                // value, 8 bytes
                         "\x0a\x01" "a"                            // tag
                         "\x15\x00\x00\x80\x3f",                   // simple_value 1.0f
                         24);
  EXPECT_EQ(e, want);
  EXPECT_EQ(tb::session_start_event(1.0, 3), std::string("\x09\x00\x00\x00\x00\x00\x00\xf0\x3f" "\x10\x03"
                                                         "\x3a\x02" "\x08\x01", 15));  // 7: SessionLog{status: START}
  // Event{wall_time: 1.0, step: 2, summary{value{tag: "h", histo{min 1, max 3, num 3, sum 7, sum_squares 19,
  // bucket_limit [1, 3], bucket [1, 2]}}}} for the values 3, 1, 3, encoded by hand.
  const std::string h = tb::histogram_event(1.0, 2, "h", {3, 1, 3});
  const auto d = [](double v) { std::string b(8, '\0'); std::memcpy(b.data(), &v, 8); return b; };
  const std::string histo = "\x09" + d(1) + "\x11" + d(3) + "\x19" + d(3) + "\x21" + d(7) + "\x29" + d(19) +
                            "\x32\x10" + d(1) + d(3) + "\x3a\x10" + d(1) + d(2);
  ASSERT_EQ(histo.size(), 5 * 9 + 2 * 18u);
  const std::string value = std::string("\x0a\x01" "h") + "\x2a\x51" + histo;  // tag, histo (81 bytes): 86 bytes
  EXPECT_EQ(h, "\x09" + d(1) + "\x10\x02" + "\x2a\x58" + "\x0a\x56" + value);  // summary (88 bytes), its value
  const std::string rec = tb::tfrecord("abc");
  ASSERT_EQ(rec.size(), 8 + 4 + 3 + 4u);
  EXPECT_EQ(rec.substr(0, 8), std::string("\x03\0\0\0\0\0\0\0", 8));
}

TEST(Metrics, AppendsTruncatesAndRepairs) {
  const std::string path = fresh_dir("lathe_metrics") + "/metrics.jsonl";
  {
    MetricsWriter w(path);
    for (int s = 1; s <= 5; ++s) w.write({{"step", s}, {"loss", 1.0 / s}, {"lr", 1e-4}});
    w.write({{"step", 4}, {"eval_loss", 0.5}});
    w.write({{"step", 6}, {"loss", std::nan("")}});
    EXPECT_THROW(w.write({{"loss", 1.0}}), Error);
    EXPECT_THROW(w.write({{"step", 1.5}}), Error);
  }
  std::vector<std::string> lines = lines_of(path);
  ASSERT_EQ(lines.size(), 7u);
  EXPECT_EQ(lines[0], R"({"loss":1.0,"lr":0.0001,"step":1})");
  EXPECT_EQ(lines[6], R"({"loss":null,"step":6})");

  // A crash mid-line leaves a torn tail: reopening drops it, and resume keeps steps <= 3.
  { std::ofstream(path, std::ios::app) << R"({"step":7,"lo)"; }
  MetricsWriter w(path);
  EXPECT_EQ(lines_of(path).size(), 7u);
  w.truncate_after(3);
  w.write({{"step", 4}, {"loss", 0.25}});  // the writer appends to the rewritten file
  lines = lines_of(path);
  ASSERT_EQ(lines.size(), 4u);
  EXPECT_EQ(lines[2], R"({"loss":0.3333333333333333,"lr":0.0001,"step":3})");
  EXPECT_EQ(lines[3], R"({"loss":0.25,"step":4})");
  EXPECT_EQ(read_text(path).back(), '\n');
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
}
