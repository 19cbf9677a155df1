// metrics.jsonl: one JSON object per line, each with an integer "step" (train entries, eval entries, ...).
// Each line goes out in one write() on an O_APPEND descriptor, so a crash (kill -9 included) loses at most the line
// being written and never interleaves two; a torn last line is dropped when the file is opened again. On resume,
// truncate_after(step) removes the entries of steps after the checkpoint, so the file matches the resumed run.
// Non-finite numbers are written as null (JSON has no NaN). Covered by tests/unit/test_metrics.cpp.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

namespace lathe {

class MetricsWriter {
 public:
  // Opens `path` for appending, creating it (not its folder) if missing.
  explicit MetricsWriter(std::string path);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  // Appends one entry: a JSON object with an integer "step".
  void write(const nlohmann::json& entry);
  // Keeps only the entries with step <= `step` (and lines that are not such entries), replacing the file
  // atomically (temp file, fsync, rename).
  void truncate_after(int64_t step);

  const std::string& path() const { return path_; }

 private:
  void open_for_append();

  std::string path_;
  int fd_ = -1;
};

}  // namespace lathe
