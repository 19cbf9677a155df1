// The uniform variates of the sample_rows op (ops/op_table.h) as one integer function, shared by the CPU kernel and the
// CUDA kernel so that both draw from the same variates: u(key, counter, id) = (h >> 11 + 1/2) / 2^53 in (0, 1), with
// h = splitmix64(splitmix64(key ^ splitmix64(counter)) ^ id) (dropout_hash.h's splitmix64). A draw's key names its
// stream (the rollout engine: the request's seed and the sample's index), its counter the position in the stream (the
// number of tokens the sample has generated), so a token depends on nothing else in the batch. Also the f32 order as
// integers (ordered_key). Covered by the
// sample_rows op-check cases and tests/models/test_rollout.cpp.
#pragma once

#include <cstdint>
#include <cstring>

#include "backend/dropout_hash.h"

namespace lathe {

LATHE_HOST_DEVICE double sample_uniform(uint64_t key, uint64_t counter, uint64_t id) {
  const uint64_t h = splitmix64(splitmix64(key ^ splitmix64(counter)) ^ id);
  return (double(h >> 11) + 0.5) * 0x1.0p-53;
}

// The order of f32 values as unsigned integers (a < b exactly when ordered_key(a) < ordered_key(b), for values that are
// not NaN; -0 just below +0): sample_rows' top-k / top-p cut is a key, found by bisection on the device.
LATHE_HOST_DEVICE uint32_t ordered_key(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The 64-bit key of draw i from its two i32 halves (keys[i][0] low, keys[i][1] high, as unsigned).
LATHE_HOST_DEVICE uint64_t sample_key(int32_t lo, int32_t hi) {
  return uint64_t(uint32_t(lo)) | uint64_t(uint32_t(hi)) << 32;
}

}  // namespace lathe
