// Writing outputs so that a failure never leaves a half-written file, a stray temporary or a replaced special file.
// - OutputFile: "-" and /dev/stdout (also when redirected into a file) are standard output. A path that names a pipe,
//   a character device (/dev/null) or a socket, or any path under /dev/ or /proc/ (/dev/stderr, /dev/fd/N, even when
//   a redirection made them regular files: appended to), is written in place, streaming: there is nothing to rename
//   over. Anything else (a new path, a regular file,
//   a symbolic link to one: the link is followed, so it stays a link) is written to TARGET.tmp-PID beside its target
//   and renamed over it by commit(). Destroyed uncommitted (an error on the way), it removes its temporary.
// - OutputDir: a folder written as TARGET.tmp-PID/ and swapped in whole by commit(); destroyed uncommitted, it removes
//   its temporary folder.
// - make_dirs: create_directories with an error that names the part of the path in the way.
// Every failure is a lathe::Error that names the path and the system's reason; `who` is the subsystem that starts it.
// Covered by tests/unit/test_files.cpp.
#pragma once

#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

namespace lathe {

class OutputFile {
 public:
  OutputFile(const std::string& path, std::string who);
  ~OutputFile();
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;

  std::ostream& stream();
  // Flushes and checks the writes; a file written through a temporary is synced and renamed over its target.
  void commit();
  bool streamed() const { return tmp_.empty(); }  // written in place: standard output or a special file
  const std::string& path() const { return path_; }

 private:
  std::string who_, path_, target_, tmp_;  // tmp_ empty: written in place
  std::ofstream file_;
  bool to_stdout_ = false, committed_ = false;
};

class OutputDir {
 public:
  OutputDir(const std::string& path, std::string who);
  ~OutputDir();
  OutputDir(const OutputDir&) = delete;
  OutputDir& operator=(const OutputDir&) = delete;

  const std::filesystem::path& tmp() const { return tmp_; }  // write the folder's files here
  const std::filesystem::path& target() const { return target_; }
  // Swaps the folder in: an older folder at the target is renamed aside, then removed.
  void commit();

 private:
  std::string who_;
  std::filesystem::path target_, tmp_;
  bool committed_ = false;
};

// The whole of `text` into `path`, through OutputFile.
void write_file_atomic(const std::string& path, std::string_view text, const std::string& who);

// Creates `dir` and its parents; an error names the part of the path that is not a folder, or the system's reason.
void make_dirs(const std::filesystem::path& dir, const std::string& who);

// `dir` exists and is a folder (holding `required_file` when given); an error says which is not so, naming `what` (the
// option, e.g. "--model" or "model.path") and the path.
void check_folder(const std::string& dir, const std::string& what, const std::string& who, const char* required_file = nullptr);

// Every byte of a file; an error names the path and says whether it is missing, a folder or unreadable.
std::string read_text_file(const std::string& path, const std::string& who);

}  // namespace lathe
