// The message of the exception a callable throws, for tests that check what an error names.
#pragma once

#include <exception>
#include <functional>
#include <string>

namespace lathe::test_support {

// Runs `f` and returns what() of the std::exception it throws, or "(no error)" when it returns normally (which no
// needle a test looks for contains).
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace lathe::test_support
