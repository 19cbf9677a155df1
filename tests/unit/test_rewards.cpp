// RL rewards (rl/rewards.h): answers extracted and matched by hand-picked cases (boxed with nested braces, last
// number with sign, decimals and thousands separators, none); the format reward's whole-completion match and a bad
// pattern's error; DAPO's overlong shaping at its boundaries (the paper's formula); the external command's rewards,
// including an input larger than a pipe's buffer, and each failure path reported by name: a non-zero exit, a line
// that is not a number, too few lines, and a command that does not finish within the timeout (killed).
#include <gtest/gtest.h>

#include <chrono>

#include "core/error.h"
#include "rl/rewards.h"

using namespace lathe;

namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST(Rewards, AnswersAreExtractedAndMatched) {
  EXPECT_EQ(extract_answer("so 3 + 4 = 7, the answer is 42."), "42");
  EXPECT_EQ(extract_answer("first \\boxed{1} then \\boxed{\\frac{1}{2}} and 9"), "\\frac{1}{2}");
  EXPECT_EQ(extract_answer("it falls to -3.5 degrees"), "-3.5");
  EXPECT_EQ(extract_answer("a total of 1,234,567 apples"), "1234567");
  EXPECT_EQ(extract_answer("no digits here"), std::nullopt);
  EXPECT_EQ(extract_answer("\\boxed{unclosed"), std::nullopt);
  EXPECT_TRUE(answers_match("42", "42.0"));
  EXPECT_TRUE(answers_match("$1,000", "1000"));
  EXPECT_TRUE(answers_match("\\frac{1}{2}", " \\frac{1}{2} "));
  EXPECT_FALSE(answers_match("41", "42"));
  EXPECT_FALSE(answers_match("x", "y"));
  EXPECT_EQ(answer_reward("the sum is 12", "12"), 1.0);
  EXPECT_EQ(answer_reward("the sum is 12, not 13", "12"), 0.0);  // the last number counts
}

TEST(Rewards, FormatRewardMatchesTheWholeCompletion) {
  const FormatReward think("<think>.*</think>\\s*\\\\boxed\\{.+\\}");
  EXPECT_EQ(think("<think>a\nb</think> \\boxed{4}"), 1.0);
  EXPECT_EQ(think("<think>a</think> 4"), 0.0);
  EXPECT_EQ(think("x <think>a</think> \\boxed{4}"), 0.0);  // anchored at the start
  const std::string err = error_of([] { FormatReward bad("(unclosed"); });
  EXPECT_NE(err.find("format reward pattern '(unclosed'"), std::string::npos) << err;
}

// DAPO eq. 13 with L_max 20 and L_cache 4: 0 up to 16 tokens, (16 - L) / 4 from 17 to 20, -1 beyond.
TEST(Rewards, OverlongShaping) {
  EXPECT_EQ(overlong_penalty(10, 20, 4), 0.0);
  EXPECT_EQ(overlong_penalty(16, 20, 4), 0.0);
  EXPECT_EQ(overlong_penalty(18, 20, 4), -0.5);
  EXPECT_EQ(overlong_penalty(20, 20, 4), -1.0);
  EXPECT_EQ(overlong_penalty(25, 20, 4), -1.0);
  EXPECT_THROW(overlong_penalty(5, 20, 0), Error);
}

TEST(Rewards, ExternalCommandAndItsFailures) {
  // One number per row: the row's length in bytes; 20,000 rows (more than a pipe holds, both ways).
  std::vector<std::string> rows;
  for (int i = 0; i < 20000; ++i) rows.push_back("{\"completion\": \"" + std::string(size_t(i % 13), 'a') + "\"}");
  const std::vector<double> r = external_rewards("awk '{ print length($0) }'", rows, 30);
  ASSERT_EQ(r.size(), rows.size());
  for (size_t i = 0; i < rows.size(); i += 997) EXPECT_EQ(r[i], double(rows[i].size())) << i;
  const std::vector<std::string> two = {"{}", "{}"};
  EXPECT_NE(error_of([&] { external_rewards("cat >/dev/null; echo oops >&2; exit 3", two, 10); })
                .find("exited with status 3; stderr: oops"), std::string::npos);
  EXPECT_NE(error_of([&] { external_rewards("cat >/dev/null; echo 1; echo high", two, 10); })
                .find("output line 2 is 'high', not a finite number"), std::string::npos);
  EXPECT_NE(error_of([&] { external_rewards("cat >/dev/null; echo 1", two, 10); })
                .find("wrote 1 rewards for 2 completions"), std::string::npos);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_NE(error_of([&] { external_rewards("sleep 30", two, 0.5); }).find("did not finish within 0.5 s (killed)"),
            std::string::npos);
  // Closing its output does not end the wait: the timeout still holds.
  EXPECT_NE(error_of([&] { external_rewards("exec >&- 2>&-; sleep 30", two, 0.5); }).find("did not finish within"),
            std::string::npos);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10.0);
}
