// The op table: every op the engine knows, declared once (X-macro), with its attribute structs.
// A backward that is a plain composition of other ops lives in ops/grad.cpp; a backward that needs its own
// kernel is an op of its own here (softmax_backward, silu_backward).
// Covered by tests/ops (every op x device x dtype).
#pragma once

#include <string_view>
#include <variant>
#include <vector>

#include "core/dtype.h"

namespace lathe {

// X(name, number of inputs)
#define LATHE_OP_LIST(X) \
  X(matmul, 2)           \
  X(add, 2)              \
  X(mul, 2)              \
  X(scale, 1)            \
  X(cast, 1)             \
  X(sum, 1)              \
  X(mean, 1)             \
  X(softmax, 1)          \
  X(softmax_backward, 2) \
  X(silu, 1)             \
  X(silu_backward, 2)

enum class OpId {
#define LATHE_X(name, n_in) name,
  LATHE_OP_LIST(LATHE_X)
#undef LATHE_X
  kCount
};

inline constexpr int kOpCount = int(OpId::kCount);

std::string_view op_name(OpId op);
int op_num_inputs(OpId op);
OpId op_from_name(std::string_view name);  // throws on an unknown name

// out = alpha * op(A) @ op(B) + beta * out, where op(X) = X^T when trans_x. A: (..., M, K) (or (..., K, M)
// when trans_a); B: (..., K, N) with the same leading dims as A, or 2-D B shared by every batch (then
// trans_a must be false and the batch folds into M). Accumulation in fp32 (fp64 for f64).
struct MatmulAttrs {
  bool trans_a = false;
  bool trans_b = false;
  float alpha = 1.0f;
  float beta = 0.0f;  // non-zero reads the output tensor's current contents
};

struct ScaleAttrs {
  double alpha = 1.0;
};

struct CastAttrs {
  DType to = DType::F32;
};

// Reduction over `dims` (empty = all dims).
struct ReduceAttrs {
  std::vector<int> dims;
  bool keepdim = false;
};

using OpAttrs = std::variant<std::monostate, MatmulAttrs, ScaleAttrs, CastAttrs, ReduceAttrs>;

}  // namespace lathe
