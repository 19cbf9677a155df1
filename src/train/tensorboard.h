// TensorBoard event files, written by hand (no Debian library does it): TFRecord framing (u64 length, masked
// CRC32C of the length, data, masked CRC32C of the data; little-endian) around protobuf-encoded Event messages:
// Event{wall_time = 1 (double), step = 2 (int64), file_version = 3 (string), summary = 5 {value = 1 {tag = 1,
// simple_value = 2 (float), histo = 5 (below)}}}, session_log = 7 {status = 1 (START = 1)}}. The first record carries file_version
// "brain.Event:2"; the second, when the writer is given its first step, is SessionLog START at that step. With file
// version 2, a START is what makes TensorBoard purge orphaned points: those of earlier files at steps >= the START
// step (what a crashed run logged after its last checkpoint).
// One new file per writer: <logdir>/events.out.tfevents.<secs>.<host>.<pid>.<n>.
// Covered by tests/unit/test_metrics.cpp (decoder) and dev/ref/check_tensorboard.py (tensorboard itself).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace lathe {

namespace tb {

uint32_t crc32c(const void* data, size_t size, uint32_t crc = 0);  // Castagnoli, as in iSCSI and TFRecord
uint32_t masked_crc32c(const void* data, size_t size);             // ((c >> 15) | (c << 17)) + 0xa282ead8
std::string tfrecord(std::string_view data);                       // one framed record
// Serialised Event messages.
std::string file_version_event(double wall_time, std::string_view version);
std::string scalars_event(double wall_time, int64_t step, const std::vector<std::pair<std::string, float>>& values);
std::string session_start_event(double wall_time, int64_t step);
// Summary.Value{tag = 1, histo = 5 {min = 1, max = 2, num = 3, sum = 4, sum_squares = 5 (doubles), bucket_limit = 6,
// bucket = 7 (packed doubles)}}: a bucket per distinct value, whose right edge (bucket_limit) is the value.
std::string histogram_event(double wall_time, int64_t step, const std::string& tag, std::vector<double> values);

}  // namespace tb

class TensorBoardWriter {
 public:
  // Creates `logdir` (and its parents) if needed and a new event file in it. `first_step` is the first step this
  // run will log (1 for a fresh run, N + 1 when resuming from a checkpoint at step N): points of earlier files at
  // that step or later are dropped by TensorBoard. Without it no START is written and nothing is purged (a resumed
  // run then shows two points at the steps the interrupted run logged after its checkpoint).
  explicit TensorBoardWriter(const std::string& logdir, std::optional<int64_t> first_step = std::nullopt);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // One event holding every value, written at once (one write() per call: nothing to flush).
  void add_scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values);
  void add_scalar(const std::string& tag, double value, int64_t step) { add_scalars(step, {{tag, value}}); }
  // The distribution of `values` at `step` (TensorBoard's histograms and distributions tabs).
  void add_histogram(int64_t step, const std::string& tag, const std::vector<double>& values);

  const std::string& path() const { return path_; }

 private:
  void append(const std::string& event);

  std::string path_;
  int fd_ = -1;
};

}  // namespace lathe
