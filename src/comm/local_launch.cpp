#include "comm/local_launch.h"

#include <fmt/format.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <thread>

#include "core/error.h"

namespace lathe {

namespace {

std::string describe(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with status {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return fmt::format("was killed by signal {} ({})", WTERMSIG(status), strsignal(WTERMSIG(status)));
  return "stopped";
}

}  // namespace

int run_local_ranks(const std::string& binary, const std::vector<std::string>& args, int n) {
  LATHE_CHECK(n >= 1, "launch: --nproc must be at least 1 (got {})", n);
  char dir_template[] = "/tmp/lathe-rendezvous-XXXXXX";
  LATHE_CHECK(mkdtemp(dir_template) != nullptr, "launch: cannot make a rendezvous folder in /tmp");
  const std::string rendezvous = dir_template;
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    const pid_t pid = fork();
    LATHE_CHECK(pid >= 0, "launch: cannot start rank {}", r);
    if (pid == 0) {
      setenv("LATHE_RANK", std::to_string(r).c_str(), 1);
      setenv("LATHE_WORLD", std::to_string(n).c_str(), 1);
      setenv("LATHE_LOCAL_RANK", std::to_string(r).c_str(), 1);
      setenv("LATHE_RENDEZVOUS", rendezvous.c_str(), 1);
      setenv("NCCL_NVLS_ENABLE", "0", 0);
      std::vector<char*> argv = {const_cast<char*>(binary.c_str())};
      for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      execv(binary.c_str(), argv.data());
      std::fprintf(stderr, "lathe: launch: cannot run %s for rank %d\n", binary.c_str(), r);
      _exit(127);
    }
    pids.push_back(pid);
  }
  int result = 0, running = n;
  while (running > 0) {
    int status = 0;
    const pid_t pid = waitpid(-1, &status, 0);
    if (pid < 0) break;
    --running;
    const int rank = int(std::find(pids.begin(), pids.end(), pid) - pids.begin());
    if (rank < n) pids[size_t(rank)] = -1;
    const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (ok || result != 0) continue;
    result = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    std::fprintf(stderr, "lathe: launch: rank %d %s; ending the other ranks\n", rank, describe(status).c_str());
    for (pid_t p : pids)
      if (p > 0) kill(p, SIGTERM);
    // Ranks stuck in a collective may not answer SIGTERM: SIGKILL whatever is left after 10 s.
    std::thread([pids] {
      std::this_thread::sleep_for(std::chrono::seconds(10));
      for (pid_t p : pids)
        if (p > 0) kill(p, SIGKILL);
    }).detach();
  }
  std::error_code ec;
  std::filesystem::remove_all(rendezvous, ec);
  return result;
}

}  // namespace lathe
