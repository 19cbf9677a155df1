// src/core/files.h: an output file replaces a regular file only when committed, follows a symbolic link to its
// target, streams into a named pipe, a character device or a /dev/fd/N path without replacing it, and leaves no
// temporary behind after a failure (a full device, an error before commit); output folders likewise; errors name the
// path.
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <csignal>
#include <thread>

#include "core/error.h"
#include "core/files.h"
#include "support/error_of.h"

namespace fs = std::filesystem;
using lathe::test_support::error_of;

namespace {

fs::path scratch(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / fmt::format("lathe_files_{}_{}", name, getpid());
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(f)), {});
}

// The names in `dir` other than the ones given.
std::vector<std::string> others(const fs::path& dir, std::set<std::string> expected) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir))
    if (!expected.count(e.path().filename().string())) out.push_back(e.path().filename().string());
  return out;
}

}  // namespace

TEST(Files, OutputFileReplacesOnlyOnCommit) {
  const fs::path d = scratch("commit");
  std::ofstream(d / "out.jsonl") << "old\n";
  {
    lathe::OutputFile out((d / "out.jsonl").string(), "test");
    EXPECT_FALSE(out.streamed());
    out.stream() << "new\n";
    EXPECT_EQ(slurp(d / "out.jsonl"), "old\n");  // not yet
    out.commit();
  }
  EXPECT_EQ(slurp(d / "out.jsonl"), "new\n");
  {
    lathe::OutputFile out((d / "out.jsonl").string(), "test");
    out.stream() << "abandoned\n";
  }  // destroyed uncommitted: an error on the way
  EXPECT_EQ(slurp(d / "out.jsonl"), "new\n");
  EXPECT_TRUE(others(d, {"out.jsonl"}).empty()) << "a temporary was left behind";
}

TEST(Files, OutputFileFollowsASymlinkAndKeepsIt) {
  const fs::path d = scratch("link");
  std::ofstream(d / "real.txt") << "old";
  fs::create_symlink(d / "real.txt", d / "link.txt");
  lathe::write_file_atomic((d / "link.txt").string(), "through the link", "test");
  EXPECT_TRUE(fs::is_symlink(d / "link.txt"));
  EXPECT_EQ(slurp(d / "real.txt"), "through the link");
}

TEST(Files, OutputFileStreamsIntoANamedPipeWithoutReplacingIt) {
  const fs::path d = scratch("fifo");
  const fs::path fifo = d / "pipe";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  std::string got;
  std::thread reader([&] { got = slurp(fifo); });
  {
    lathe::OutputFile out(fifo.string(), "test");
    EXPECT_TRUE(out.streamed());
    out.stream() << "line 1\nline 2\n";
    out.commit();
  }
  reader.join();
  EXPECT_EQ(got, "line 1\nline 2\n");
  struct stat st {};
  ASSERT_EQ(stat(fifo.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode)) << "the pipe was replaced";
  EXPECT_TRUE(others(d, {"pipe"}).empty());
}

TEST(Files, OutputFileWritesIntoACharacterDevice) {
  lathe::OutputFile out("/dev/null", "test");
  EXPECT_TRUE(out.streamed());
  out.stream() << "discarded\n";
  out.commit();
  struct stat st {};
  ASSERT_EQ(stat("/dev/null", &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode));
}

// /dev/fd/N (like /dev/stdout under `> file`) names a regular file here: it is appended to in place, never renamed over.
TEST(Files, OutputFileWritesInPlaceThroughDevFdEvenToARegularFile) {
  const fs::path d = scratch("devfd");
  const int fd = ::open((d / "log").c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::write(fd, "a\n", 2), 2);
  struct stat before {}, after {};
  ASSERT_EQ(stat((d / "log").c_str(), &before), 0);
  {
    lathe::OutputFile out(fmt::format("/dev/fd/{}", fd), "test");
    EXPECT_TRUE(out.streamed());
    out.stream() << "b\n";
    out.commit();
  }
  ::close(fd);
  ASSERT_EQ(stat((d / "log").c_str(), &after), 0);
  EXPECT_EQ(before.st_ino, after.st_ino) << "the file was replaced";
  EXPECT_EQ(slurp(d / "log"), "a\nb\n");
  EXPECT_TRUE(others(d, {"log"}).empty());
}

TEST(Files, AFullDeviceIsAClearErrorAndLeavesNothing) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full on this machine";
  lathe::OutputFile out("/dev/full", "test");
  out.stream() << std::string(1 << 16, 'x');
  const std::string e = error_of([&] { out.commit(); });
  EXPECT_NE(e.find("test: writing /dev/full failed"), std::string::npos) << e;
}

TEST(Files, AFileSizeLimitFailsTheWriteAndRemovesTheTemporary) {
  // A full disk, as a process sees it: writes past RLIMIT_FSIZE fail (SIGXFSZ ignored) with EFBIG.
  const fs::path d = scratch("fsize");
  const pid_t pid = fork();
  if (pid == 0) {
    signal(SIGXFSZ, SIG_IGN);
    struct rlimit lim {4096, 4096};
    setrlimit(RLIMIT_FSIZE, &lim);
    try {
      lathe::write_file_atomic((d / "big.json").string(), std::string(1 << 20, 'x'), "test");
    } catch (const lathe::Error& e) {
      _exit(std::string(e.what()).find("test: writing") != std::string::npos ? 7 : 8);
    }
    _exit(0);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 7);
  EXPECT_TRUE(others(d, {}).empty()) << "a temporary was left behind";
}

TEST(Files, OutputDirAppearsWholeOrNotAtAll) {
  const fs::path d = scratch("dir");
  {
    lathe::OutputDir out((d / "model").string(), "test");
    std::ofstream(out.tmp() / "a.txt") << "a";
    EXPECT_FALSE(fs::exists(d / "model"));
    out.commit();
  }
  EXPECT_EQ(slurp(d / "model/a.txt"), "a");
  {
    lathe::OutputDir out((d / "model").string(), "test");
    std::ofstream(out.tmp() / "b.txt") << "b";
  }  // uncommitted
  EXPECT_TRUE(fs::exists(d / "model/a.txt"));
  EXPECT_FALSE(fs::exists(d / "model/b.txt"));
  EXPECT_TRUE(others(d, {"model"}).empty()) << "a temporary folder was left behind";
  {
    lathe::OutputDir out((d / "model").string(), "test");
    std::ofstream(out.tmp() / "c.txt") << "c";
    out.commit();
  }
  EXPECT_FALSE(fs::exists(d / "model/a.txt")) << "the old folder's files survived the swap";
  EXPECT_TRUE(others(d, {"model"}).empty());
}

TEST(Files, ErrorsNameThePathInTheWay) {
  const fs::path d = scratch("errors");
  std::ofstream(d / "file") << "x";
  EXPECT_NE(error_of([&] { lathe::make_dirs(d / "file/sub/dir", "train"); })
                .find(fmt::format("train: cannot create folder {}: {} is a file, not a folder", (d / "file/sub/dir").string(),
                                  (d / "file").string())),
            std::string::npos);
  EXPECT_NE(error_of([&] { lathe::OutputDir((d / "file").string(), "export"); }).find("exists and is not a folder"),
            std::string::npos);
  EXPECT_NE(error_of([&] { lathe::OutputFile(d.string(), "logprobs"); }).find("is a folder, not a file"), std::string::npos);
  EXPECT_NE(error_of([&] { lathe::OutputFile((d / "no/such/dir/x.jsonl").string(), "logprobs"); }).find("does not exist"),
            std::string::npos);
  EXPECT_NE(error_of([&] { lathe::OutputFile((d / "file/x.jsonl").string(), "logprobs"); })
                .find(fmt::format("{} is a file, not a folder", (d / "file").string())),
            std::string::npos);
  EXPECT_NE(error_of([&] { lathe::read_text_file((d / "absent.yaml").string(), "config"); })
                .find(fmt::format("config: {} does not exist", (d / "absent.yaml").string())),
            std::string::npos);
  EXPECT_NE(error_of([&] { lathe::read_text_file(d.string(), "config"); }).find("is a folder, not a file"), std::string::npos);
}
