// Error handling for the whole engine.
// LATHE_CHECK reports a user, config or data problem (always on); its message starts with the subsystem.
// LATHE_ASSERT guards an internal invariant. Both throw lathe::Error; only the CLI catches and prints.
// Covered by tests/unit/test_core.cpp.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace lathe {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// Formats "subsystem: message (file:line)". Kept out of line so every throw site stays small.
[[noreturn]] void throw_error(const char* file, int line, const std::string& message);

}  // namespace lathe

#define LATHE_CHECK(cond, ...)                                                   \
  do {                                                                           \
    if (!(cond)) ::lathe::throw_error(__FILE__, __LINE__, fmt::format(__VA_ARGS__)); \
  } while (0)

#define LATHE_FAIL(...) ::lathe::throw_error(__FILE__, __LINE__, fmt::format(__VA_ARGS__))

#define LATHE_ASSERT(cond)                                                                 \
  do {                                                                                     \
    if (!(cond)) ::lathe::throw_error(__FILE__, __LINE__, "internal error: assertion failed: " #cond); \
  } while (0)
