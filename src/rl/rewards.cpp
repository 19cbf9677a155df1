// Rewards (rewards.h). The external command runs under fork/exec with its stdin, stdout and stderr on pipes, fed and
// drained together through poll() so that neither side blocks the other, and killed at the timeout.
#define PCRE2_CODE_UNIT_WIDTH 8
#include "rl/rewards.h"

#include <fcntl.h>
#include <poll.h>
#include <pcre2.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "core/error.h"

namespace lathe {

namespace {

std::string trim(std::string_view s) {
  const size_t b = s.find_first_not_of(" \t\r\n"), e = s.find_last_not_of(" \t\r\n");
  return b == std::string_view::npos ? std::string() : std::string(s.substr(b, e - b + 1));
}

// The number a string spells after dropping "$", thousands separators and a trailing period; nullopt otherwise.
std::optional<double> as_number(std::string_view s) {
  std::string t;
  for (char c : trim(s))
    if (c != '$' && c != ',') t += c;
  if (!t.empty() && t.back() == '.') t.pop_back();
  if (t.empty()) return std::nullopt;
  char* end = nullptr;
  const double v = std::strtod(t.c_str(), &end);
  if (end != t.c_str() + t.size() || !std::isfinite(v)) return std::nullopt;
  return v;
}

}  // namespace

std::optional<std::string> extract_answer(std::string_view text) {
  const size_t boxed = text.rfind("\\boxed{");
  if (boxed != std::string_view::npos) {
    size_t i = boxed + 7;
    int depth = 1;
    for (size_t j = i; j < text.size(); ++j) {
      depth += text[j] == '{' ? 1 : text[j] == '}' ? -1 : 0;
      if (depth == 0) return trim(text.substr(i, j - i));
    }
    return std::nullopt;  // an unclosed \boxed{
  }
  // The last number: digits with an optional sign, thousands separators and one decimal point.
  for (size_t end = text.size(); end-- > 0;) {
    if (!std::isdigit(static_cast<unsigned char>(text[end]))) continue;
    const auto digit = [&](size_t k) { return std::isdigit(static_cast<unsigned char>(text[k])) != 0; };
    size_t begin = end;
    while (begin > 0 && (digit(begin - 1) || text[begin - 1] == '.' ||
                         (text[begin - 1] == ',' && begin >= 2 && digit(begin - 2))))
      --begin;
    if (begin > 0 && text[begin - 1] == '-') --begin;
    std::string n;
    for (size_t k = begin; k <= end; ++k)
      if (text[k] != ',') n += text[k];
    return n;
  }
  return std::nullopt;
}

bool answers_match(std::string_view got, std::string_view want) {
  const std::optional<double> a = as_number(got), b = as_number(want);
  if (a && b) return std::abs(*a - *b) <= 1e-6 * std::max({1.0, std::abs(*a), std::abs(*b)});
  const auto norm = [](std::string_view s) {
    std::string out;
    for (char c : trim(s)) {
      const bool space = c == ' ' || c == '\t' || c == '\n' || c == '\r';
      if (space && (out.empty() || out.back() == ' ')) continue;
      out += space ? ' ' : c;
    }
    return out;
  };
  return norm(got) == norm(want);
}

double answer_reward(std::string_view completion, std::string_view answer) {
  const std::optional<std::string> got = extract_answer(completion);
  return got && answers_match(*got, answer) ? 1.0 : 0.0;
}

struct FormatReward::Code {
  pcre2_code* code = nullptr;
  ~Code() { pcre2_code_free(code); }
};

FormatReward::FormatReward(const std::string& pattern) : code_(std::make_unique<Code>()), pattern_(pattern) {
  int err = 0;
  PCRE2_SIZE offset = 0;
  code_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                              PCRE2_UTF | PCRE2_DOTALL | PCRE2_ANCHORED | PCRE2_ENDANCHORED, &err, &offset, nullptr);
  if (!code_->code) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(err, message, sizeof(message));
    LATHE_FAIL("rl: format reward pattern '{}': {} at offset {}", pattern, reinterpret_cast<const char*>(message),
               offset);
  }
}

FormatReward::~FormatReward() = default;
FormatReward::FormatReward(FormatReward&&) noexcept = default;
FormatReward& FormatReward::operator=(FormatReward&&) noexcept = default;

double FormatReward::operator()(std::string_view completion) const {
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(code_->code, nullptr);
  const int rc = pcre2_match(code_->code, reinterpret_cast<PCRE2_SPTR>(completion.data()), completion.size(), 0, 0,
                             md, nullptr);
  pcre2_match_data_free(md);
  LATHE_CHECK(rc >= 0 || rc == PCRE2_ERROR_NOMATCH, "rl: format reward pattern '{}' failed on a completion (PCRE2 "
              "error {})", pattern_, rc);
  return rc >= 0 ? 1.0 : 0.0;
}

double overlong_penalty(int64_t length, int64_t max_length, int64_t buffer) {
  LATHE_CHECK(buffer >= 1 && buffer <= max_length, "rl: overlong buffer {} must be in [1, max length {}]", buffer,
              max_length);
  if (length <= max_length - buffer) return 0.0;
  if (length <= max_length) return double(max_length - buffer - length) / double(buffer);
  return -1.0;
}

std::vector<double> external_rewards(const std::string& command, const std::vector<std::string>& rows,
                                     double timeout_s) {
  int in[2], out[2], err[2];
  LATHE_CHECK(pipe(in) == 0 && pipe(out) == 0 && pipe(err) == 0, "rl: reward command '{}': pipe: {}", command,
              std::strerror(errno));
  const pid_t pid = fork();
  LATHE_CHECK(pid >= 0, "rl: reward command '{}': fork: {}", command, std::strerror(errno));
  if (pid == 0) {
    dup2(in[0], 0), dup2(out[1], 1), dup2(err[1], 2);
    for (int fd : {in[0], in[1], out[0], out[1], err[0], err[1]}) close(fd);
    execl("/bin/sh", "sh", "-c", command.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  close(in[0]), close(out[1]), close(err[1]);
  std::string input;
  for (const std::string& r : rows) input += r + "\n";
  std::string output, errors;
  size_t written = 0;
  int to_child = in[1];
  if (input.empty()) close(to_child), to_child = -1;
  fcntl(out[0], F_SETFL, O_NONBLOCK);
  fcntl(err[0], F_SETFL, O_NONBLOCK);
  if (to_child >= 0) fcntl(to_child, F_SETFL, O_NONBLOCK);
  // A command that exits without reading all of its input makes the write fail (EPIPE) instead of killing this
  // process; its exit status tells. The previous disposition is restored below.
  const auto previous_sigpipe = signal(SIGPIPE, SIG_IGN);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  bool out_open = true, err_open = true, timed_out = false;
  while (out_open || err_open) {
    const double left = std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count();
    if (left <= 0) {
      timed_out = true;
      break;
    }
    pollfd fds[3];
    int n = 0;
    if (out_open) fds[n++] = {out[0], POLLIN, 0};
    if (err_open) fds[n++] = {err[0], POLLIN, 0};
    if (to_child >= 0) fds[n++] = {to_child, POLLOUT, 0};
    if (poll(fds, nfds_t(n), int(std::min(left, 1.0) * 1000) + 1) < 0 && errno != EINTR) break;
    for (int k = 0; k < n; ++k) {
      if (!fds[k].revents) continue;
      if (fds[k].fd == to_child) {
        const ssize_t w = write(to_child, input.data() + written, input.size() - written);
        if (w > 0) written += size_t(w);
        if (w < 0 && errno != EAGAIN) written = input.size();  // the command closed its stdin
        if (written == input.size()) close(to_child), to_child = -1;
        continue;
      }
      char buf[65536];
      const ssize_t r = read(fds[k].fd, buf, sizeof(buf));
      if (r > 0) (fds[k].fd == out[0] ? output : errors).append(buf, size_t(r));
      else if (r == 0 || errno != EAGAIN) (fds[k].fd == out[0] ? out_open : err_open) = false;
    }
  }
  if (to_child >= 0) close(to_child);
  close(out[0]), close(err[0]);
  int status = 0;
  while (!timed_out && waitpid(pid, &status, WNOHANG) != pid) {  // a command that closed its output may still run
    if (std::chrono::steady_clock::now() >= deadline) timed_out = true;
    else usleep(10000);
  }
  if (timed_out) {
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
  }
  signal(SIGPIPE, previous_sigpipe);
  const std::string tail = errors.size() > 400 ? errors.substr(errors.size() - 400) : errors;
  LATHE_CHECK(!timed_out, "rl: reward command '{}' did not finish within {} s (killed); stderr: {}", command, timeout_s,
              trim(tail));
  LATHE_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "rl: reward command '{}' {} {}; stderr: {}", command,
              WIFEXITED(status) ? "exited with status" : "was killed by signal",
              WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status), trim(tail));
  std::vector<double> rewards;
  size_t at = 0;
  while (at < output.size()) {
    const size_t nl = output.find('\n', at);
    const std::string line = trim(output.substr(at, nl == std::string::npos ? std::string::npos : nl - at));
    at = nl == std::string::npos ? output.size() : nl + 1;
    if (line.empty() && at >= output.size()) break;
    char* end = nullptr;
    const double v = std::strtod(line.c_str(), &end);
    LATHE_CHECK(!line.empty() && end == line.c_str() + line.size() && std::isfinite(v),
                "rl: reward command '{}': output line {} is '{}', not a finite number", command, rewards.size() + 1,
                line);
    rewards.push_back(v);
  }
  LATHE_CHECK(rewards.size() == rows.size(), "rl: reward command '{}' wrote {} rewards for {} completions", command,
              rewards.size(), rows.size());
  return rewards;
}

}  // namespace lathe
