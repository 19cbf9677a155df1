#include "core/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <iostream>

#include "core/error.h"

namespace lathe {

namespace fs = std::filesystem;

namespace {

std::string temp_name(const fs::path& target) { return target.string() + fmt::format(".tmp-{}", getpid()); }

// Syncs a written file's data to disk (the rename that follows must not land before the data).
void sync_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

}  // namespace

OutputFile::OutputFile(const std::string& path, std::string who) : who_(std::move(who)), path_(path) {
  LATHE_CHECK(!path.empty(), "{}: empty output path", who_);
  // /dev/stdout and its aliases are standard output even when the shell redirected it into a regular file: renaming
  // over that file would leave the process's own stdout pointing at an unlinked one.
  if (path == "-" || path == "/dev/stdout" || path == "/dev/fd/1" || path == "/proc/self/fd/1") {
    to_stdout_ = true;
    return;
  }
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {  // follows symbolic links
    LATHE_CHECK(!S_ISDIR(st.st_mode), "{}: output {} is a folder, not a file", who_, path);
    // A pipe, a character device, a socket: stream into it. So also for /dev/stderr, /dev/fd/N and the like that a
    // redirection made a regular file (appended to, as the shell's other writers do).
    const bool system_path = path.rfind("/dev/", 0) == 0 || path.rfind("/proc/", 0) == 0;
    if (!S_ISREG(st.st_mode) || system_path) {
      file_.open(path, S_ISREG(st.st_mode) ? std::ios::binary | std::ios::app : std::ios::binary);
      LATHE_CHECK(file_.good(), "{}: cannot open output {}: {}", who_, path, std::strerror(errno));
      return;
    }
  }
  std::error_code ec;
  const fs::path resolved = fs::is_symlink(fs::symlink_status(path, ec)) ? fs::weakly_canonical(path, ec) : fs::path(path);
  target_ = (ec ? fs::path(path) : resolved).string();
  const fs::path parent = fs::path(target_).parent_path();
  LATHE_CHECK(parent.empty() || fs::exists(parent, ec), "{}: cannot write {}: its folder {} does not exist", who_, path,
              parent.string());
  LATHE_CHECK(parent.empty() || fs::is_directory(parent, ec), "{}: cannot write {}: {} is a file, not a folder", who_,
              path, parent.string());
  tmp_ = temp_name(target_);
  file_.open(tmp_, std::ios::binary | std::ios::trunc);
  LATHE_CHECK(file_.good(), "{}: cannot create {}: {}", who_, tmp_, std::strerror(errno));
}

OutputFile::~OutputFile() {
  if (committed_ || tmp_.empty()) return;
  file_.close();
  std::remove(tmp_.c_str());
}

std::ostream& OutputFile::stream() { return to_stdout_ ? std::cout : file_; }

void OutputFile::commit() {
  LATHE_ASSERT(!committed_);
  if (to_stdout_) {
    std::cout.flush();
    LATHE_CHECK(std::cout.good(), "{}: writing to standard output failed", who_);
    committed_ = true;
    return;
  }
  file_.close();
  const int err = errno;
  LATHE_CHECK(!file_.fail(), "{}: writing {} failed: {}", who_, tmp_.empty() ? path_ : tmp_,
              err ? std::strerror(err) : "write error (is the disk full?)");
  if (!tmp_.empty()) {
    sync_file(tmp_);
    std::error_code ec;
    fs::rename(tmp_, target_, ec);
    LATHE_CHECK(!ec, "{}: cannot rename {} to {}: {}", who_, tmp_, target_, ec.message());
  }
  committed_ = true;
}

OutputDir::OutputDir(const std::string& path, std::string who) : who_(std::move(who)) {
  LATHE_CHECK(!path.empty(), "{}: empty output folder", who_);
  std::error_code ec;
  target_ = fs::absolute(path, ec);
  if (fs::is_symlink(fs::symlink_status(target_, ec))) target_ = fs::weakly_canonical(target_, ec);
  const fs::file_status st = fs::status(target_, ec);
  LATHE_CHECK(!fs::exists(st) || fs::is_directory(st), "{}: output {} exists and is not a folder", who_, path);
  make_dirs(target_.parent_path(), who_);
  tmp_ = temp_name(target_);
  fs::remove_all(tmp_, ec);
  make_dirs(tmp_, who_);
}

OutputDir::~OutputDir() {
  if (committed_) return;
  std::error_code ec;
  fs::remove_all(tmp_, ec);
}

void OutputDir::commit() {
  LATHE_ASSERT(!committed_);
  std::error_code ec;
  const fs::path old = target_.string() + fmt::format(".old-{}", getpid());
  if (fs::exists(target_, ec)) {
    fs::rename(target_, old, ec);
    LATHE_CHECK(!ec, "{}: cannot move the old {} aside: {}", who_, target_.string(), ec.message());
  }
  fs::rename(tmp_, target_, ec);
  LATHE_CHECK(!ec, "{}: cannot rename {} to {}: {}", who_, tmp_.string(), target_.string(), ec.message());
  committed_ = true;
  fs::remove_all(old, ec);
}

void write_file_atomic(const std::string& path, std::string_view text, const std::string& who) {
  OutputFile out(path, who);
  out.stream().write(text.data(), std::streamsize(text.size()));
  out.commit();
}

void make_dirs(const fs::path& dir, const std::string& who) {
  if (dir.empty()) return;
  std::error_code ec;
  if (fs::is_directory(dir, ec)) return;
  // The nearest part of the path that exists must be a folder.
  for (fs::path p = dir; !p.empty(); p = p.parent_path()) {
    if (fs::exists(fs::symlink_status(p, ec)) || fs::exists(p, ec)) {
      LATHE_CHECK(fs::is_directory(p, ec), "{}: cannot create folder {}: {} is a file, not a folder", who, dir.string(),
                  p.string());
      break;
    }
    if (p == p.parent_path()) break;
  }
  fs::create_directories(dir, ec);
  LATHE_CHECK(!ec, "{}: cannot create folder {}: {}", who, dir.string(), ec.message());
}

void check_folder(const std::string& dir, const std::string& what, const std::string& who, const char* required_file) {
  std::error_code ec;
  const fs::file_status st = fs::status(dir, ec);
  LATHE_CHECK(fs::exists(st), "{}: {} {} does not exist", who, what, dir);
  LATHE_CHECK(fs::is_directory(st), "{}: {} {} is a file, not a folder", who, what, dir);
  LATHE_CHECK(!required_file || fs::exists(fs::path(dir) / required_file, ec), "{}: {} {} has no {}", who, what, dir,
              required_file);
}

std::string read_text_file(const std::string& path, const std::string& who) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  LATHE_CHECK(fs::exists(st), "{}: {} does not exist", who, path);
  LATHE_CHECK(!fs::is_directory(st), "{}: {} is a folder, not a file", who, path);
  std::ifstream f(path, std::ios::binary);
  LATHE_CHECK(f.good(), "{}: cannot read {}: {}", who, path, std::strerror(errno));
  std::string text((std::istreambuf_iterator<char>(f)), {});
  LATHE_CHECK(!f.bad(), "{}: reading {} failed", who, path);
  return text;
}

}  // namespace lathe
