// Rewards of RL post-training (issue 28): the built-in ones and an external command.
// - Answer match: the completion's answer is the content of its last \boxed{...} (braces balanced) or, without one,
//   its last number; it matches the expected answer when both read as numbers equal within 1e-6 relative (after
//   dropping "$", thousands separators and a trailing period), or as normalised strings (trimmed, spaces collapsed).
// - Format: 1 when the whole completion matches a PCRE2 pattern (DOTALL), else 0.
// - DAPO's overlong shaping (Yu et al. 2025, eq. 13): 0 up to max_length - buffer tokens, then falling linearly to -1
//   at max_length, -1 beyond.
// - External command: `/bin/sh -c COMMAND` reads one JSON row per completion on stdin and writes one number per line
//   on stdout. A non-zero exit, a missing or extra line, a line that is not a finite number, or no answer within the
//   timeout is an error naming the command and the problem (the process is killed on timeout): never a zero reward.
// Covered by tests/unit/test_rewards.cpp.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace lathe {

std::optional<std::string> extract_answer(std::string_view completion);
bool answers_match(std::string_view got, std::string_view want);
double answer_reward(std::string_view completion, std::string_view answer);  // 1 or 0

class FormatReward {
 public:
  explicit FormatReward(const std::string& pattern);  // throws naming the pattern and the error's offset
  ~FormatReward();
  FormatReward(FormatReward&&) noexcept;
  FormatReward& operator=(FormatReward&&) noexcept;
  double operator()(std::string_view completion) const;  // 1 or 0

 private:
  struct Code;
  std::unique_ptr<Code> code_;
  std::string pattern_;
};

double overlong_penalty(int64_t length, int64_t max_length, int64_t buffer);

// One reward per row (`rows`: JSON objects, one line each, written to the command's stdin).
std::vector<double> external_rewards(const std::string& command, const std::vector<std::string>& rows,
                                     double timeout_s);

}  // namespace lathe
