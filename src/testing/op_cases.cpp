// The op cases: shapes chosen to hit edge sizes (1, odd, not multiples of tile sizes), broadcasting,
// transposes, batching and strided inputs. A new kernel must be reachable from at least one case (the
// coverage check in op_check.cpp fails otherwise).
#include "testing/op_check.h"

namespace lathe {

namespace {
const std::vector<DType> kFloat = {DType::F64, DType::F32, DType::BF16, DType::F16};
const std::vector<DType> kAll(std::begin(kAllDTypes), std::end(kAllDTypes));

std::string mm_params(int64_t b, int64_t m, int64_t n, int64_t k, const MatmulAttrs& a) {
  return fmt::format("b={},m={},n={},k={},ta={},tb={},alpha={},beta={}", b, m, n, k, int(a.trans_a), int(a.trans_b),
                     a.alpha, a.beta);
}

void add_matmul(std::vector<OpCase>& out, int64_t b, int64_t m, int64_t n, int64_t k, MatmulAttrs a, bool b_shared) {
  Shape sa = a.trans_a ? Shape{k, m} : Shape{m, k};
  Shape sb = a.trans_b ? Shape{n, k} : Shape{k, n};
  if (b > 0) {
    sa.insert(sa.begin(), b);
    if (!b_shared) sb.insert(sb.begin(), b);
  }
  out.push_back({OpId::matmul, mm_params(b, m, n, k, a) + (b_shared ? ",shared_b" : ""), {sa, sb}, a, kFloat});
}
}  // namespace

std::vector<OpCase> all_op_cases() {
  std::vector<OpCase> c;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) add_matmul(c, 0, 33, 17, 65, {ta, tb, 1.0f, 0.0f}, false);
  add_matmul(c, 0, 1, 1, 1, {}, false);
  add_matmul(c, 0, 64, 128, 256, {false, false, 0.5f, 0.0f}, false);
  add_matmul(c, 0, 16, 24, 40, {false, true, 1.0f, 1.0f}, false);  // accumulate into the output
  add_matmul(c, 3, 20, 12, 36, {false, false, 1.0f, 0.0f}, false);
  add_matmul(c, 2, 16, 8, 24, {true, true, 2.0f, 0.0f}, false);
  add_matmul(c, 4, 7, 9, 11, {false, true, 1.0f, 0.0f}, true);  // batched A, shared 2-D B

  for (OpId op : {OpId::add, OpId::mul}) {
    c.push_back({op, "same=[5,7]", {{5, 7}, {5, 7}}, {}, kFloat});
    c.push_back({op, "row=[4,6]+[6]", {{4, 6}, {6}}, {}, kFloat});
    c.push_back({op, "col=[3,5,2]+[3,1,2]", {{3, 5, 2}, {3, 1, 2}}, {}, kFloat});
    c.push_back({op, "both=[4,1]+[1,5]", {{4, 1}, {1, 5}}, {}, kFloat});
    c.push_back({op, "strided=[6,9]^T+[9]", {{6, 9}, {9}}, {}, kFloat, true});
    c.push_back({op, "large=[257,1031]", {{257, 1031}, {257, 1031}}, {}, kFloat});
  }
  c.push_back({OpId::scale, "n=1000,alpha=-1.5", {{10, 100}}, ScaleAttrs{-1.5}, kFloat});
  c.push_back({OpId::scale, "strided=[8,5]^T,alpha=0.25", {{8, 5}}, ScaleAttrs{0.25}, kFloat, true});
  for (DType to : kAll) {
    c.push_back({OpId::cast, fmt::format("to={},[7,13]", dtype_name(to)), {{7, 13}}, CastAttrs{to}, kAll, false, false});
  }
  c.push_back({OpId::cast, "to=f32,strided=[9,4]^T", {{9, 4}}, CastAttrs{DType::F32}, kAll, true, false});
  c.push_back({OpId::cast, "to=bf16,strided=[5,6]^T", {{5, 6}}, CastAttrs{DType::BF16}, kFloat, true, false});
  for (OpId op : {OpId::sum, OpId::mean}) {
    c.push_back({op, "all,[6,7]", {{6, 7}}, ReduceAttrs{{}, false}, kFloat});
    c.push_back({op, "dim=-1,[5,300]", {{5, 300}}, ReduceAttrs{{-1}, false}, kFloat});
    c.push_back({op, "dim=0,keep,[33,8]", {{33, 8}}, ReduceAttrs{{0}, true}, kFloat});
    c.push_back({op, "dims=0,2,[4,3,5]", {{4, 3, 5}}, ReduceAttrs{{0, 2}, false}, kFloat});
    c.push_back({op, "dim=1,strided=[7,6]^T", {{7, 6}}, ReduceAttrs{{1}, false}, kFloat, true});
  }
  for (Shape s : {Shape{1, 1}, Shape{4, 7}, Shape{3, 2, 129}, Shape{2, 3000}}) {
    c.push_back({OpId::softmax, "shape=" + shape_str(s), {s}, {}, kFloat});
    c.push_back({OpId::softmax_backward, "shape=" + shape_str(s), {s, s}, {}, kFloat, false, false});
    c.push_back({OpId::silu, "shape=" + shape_str(s), {s}, {}, kFloat});
    c.push_back({OpId::silu_backward, "shape=" + shape_str(s), {s, s}, {}, kFloat, false, false});
  }
  c.push_back({OpId::silu, "strided=[5,3]^T", {{5, 3}}, {}, kFloat, true});
  return c;
}

}  // namespace lathe
