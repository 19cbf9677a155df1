// metrics.jsonl writer (conventions in metrics.h). POSIX I/O: one write() per line, fsync + rename to rewrite.
// Covered by tests/unit/test_metrics.cpp.
#include "train/metrics.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "core/files.h"

namespace lathe {

namespace {

void write_all(int fd, const std::string& data, const std::string& path) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    LATHE_CHECK(n > 0, "metrics: cannot write {}: {}", path, std::strerror(errno));
    done += size_t(n);
  }
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  LATHE_CHECK(in.good(), "metrics: cannot read {}: {}", path, std::strerror(errno));
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

MetricsWriter::MetricsWriter(std::string path) : path_(std::move(path)) {
  // Drop a torn last line (no newline) left by a crash, so the next entry starts on a line of its own.
  struct stat st {};
  if (::stat(path_.c_str(), &st) == 0 && st.st_size > 0) {
    const std::string text = read_file(path_);
    if (text.back() != '\n') {
      const size_t keep = text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1;
      LATHE_CHECK(::truncate(path_.c_str(), off_t(keep)) == 0, "metrics: cannot repair {}: {}", path_,
                  std::strerror(errno));
    }
  }
  open_for_append();
}

MetricsWriter::~MetricsWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void MetricsWriter::open_for_append() {
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  LATHE_CHECK(fd_ >= 0, "metrics: cannot open {}: {}", path_, std::strerror(errno));
}

void MetricsWriter::write(const nlohmann::json& entry) {
  LATHE_CHECK(entry.is_object() && entry.contains("step") && entry["step"].is_number_integer(),
              "metrics: an entry must be an object with an integer \"step\", got {}", entry.dump());
  write_all(fd_, entry.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n", path_);
}

void MetricsWriter::truncate_after(int64_t step) {
  const std::string text = read_file(path_);
  std::string kept;
  size_t begin = 0;
  while (begin < text.size()) {
    size_t end = text.find('\n', begin);
    if (end == std::string::npos) break;  // a torn last line: dropped
    const std::string_view line(text.data() + begin, end - begin);
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    const bool later = !j.is_discarded() && j.is_object() && j.contains("step") && j["step"].is_number_integer() &&
                       j["step"].get<int64_t>() > step;
    if (!later) kept.append(line).push_back('\n');
    begin = end + 1;
  }
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  write_file_atomic(path_, kept, "metrics");  // synced, then renamed over the file; nothing left behind on failure
  open_for_append();
}

}  // namespace lathe
