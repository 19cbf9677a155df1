// LATHE_FAULT_INJECT=<point>:<n>: the test hooks by which a process dies, stalls or slows down at a named point of
// its work (tests of crash safety and fault reports only; e.g. "after_step:3", "rollout_sigkill:2").
#pragma once

#include <cstdint>
#include <cstdlib>
#include <string>

namespace lathe {

// Whether LATHE_FAULT_INJECT names `point` at `n` (the step, rollout, ... the point counts).
inline bool fault_injected(const char* point, int64_t n) {
  const char* f = std::getenv("LATHE_FAULT_INJECT");
  return f && std::string(f) == std::string(point) + ":" + std::to_string(n);
}

}  // namespace lathe
