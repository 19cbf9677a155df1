// src/parallel/grad_reducer.h plan_buckets: buckets of whole parameters that cover the flat space in order, cut from
// the last parameter backwards at about the byte cap and at every dtype change, each complete at the smallest
// `complete_after` of its parameters.
#include <gtest/gtest.h>

#include "backend/runtime.h"
#include "parallel/grad_reducer.h"

using namespace lathe;

namespace {

std::vector<Parameter> make_params(const std::vector<std::pair<int64_t, DType>>& shapes) {
  static Runtime rt;
  std::vector<Parameter> ps;
  for (const auto& [n, dtype] : shapes)
    ps.push_back({"p" + std::to_string(ps.size()), Tensor::empty({n}, dtype, rt.backend(DeviceType::CPU).allocator(0)), {}, {}});
  return ps;
}

std::vector<Parameter*> pointers(std::vector<Parameter>& ps) {
  std::vector<Parameter*> out;
  for (Parameter& p : ps) out.push_back(&p);
  return out;
}

}  // namespace

TEST(GradBuckets, CoverTheParametersInOrderCutFromTheBack) {
  // f32: 100, 10, 10, 50, 30 elements (400, 40, 40, 200, 120 bytes); a cap of 150 bytes.
  std::vector<Parameter> ps = make_params({{100, DType::F32}, {10, DType::F32}, {10, DType::F32}, {50, DType::F32},
                                           {30, DType::F32}});
  const std::vector<GradBucket> b = plan_buckets(pointers(ps), {-1, 0, 0, 1, 2}, 150);
  // From the back: {p4} is 120 bytes (< 150), p3 joins (320): cut; {p2, p1} 80 then p0 joins (480): cut.
  ASSERT_EQ(b.size(), 2u);
  EXPECT_EQ(b[0].first, 0u);
  EXPECT_EQ(b[0].end, 3u);
  EXPECT_EQ(b[0].begin, 0);
  EXPECT_EQ(b[0].elements, 120);
  EXPECT_EQ(b[0].complete_after, -1);  // the embedding-like p0 is complete only at the end
  EXPECT_EQ(b[1].first, 3u);
  EXPECT_EQ(b[1].end, 5u);
  EXPECT_EQ(b[1].begin, 120);
  EXPECT_EQ(b[1].elements, 80);
  EXPECT_EQ(b[1].complete_after, 1);
  EXPECT_EQ(b[1].chunk(3), 27);  // 80 padded to 81 over 3 ranks
}

TEST(GradBuckets, ADtypeChangeStartsABucketAndALargeParameterStandsAlone) {
  std::vector<Parameter> ps = make_params({{8, DType::F32}, {8, DType::BF16}, {1000, DType::BF16}, {4, DType::BF16}});
  const std::vector<GradBucket> b = plan_buckets(pointers(ps), {-1, -1, 3, 3}, 64);
  ASSERT_EQ(b.size(), 3u);
  EXPECT_EQ(b[0].dtype, DType::F32);
  EXPECT_EQ(b[0].end, 1u);
  EXPECT_EQ(b[1].first, 1u);  // p1 alone: p2's 2000 bytes filled the bucket above it
  EXPECT_EQ(b[1].end, 2u);
  EXPECT_EQ(b[2].first, 2u);
  EXPECT_EQ(b[2].end, 4u);
  EXPECT_EQ(b[2].complete_after, 3);
  int64_t total = 0;
  for (const GradBucket& g : b) total += g.elements;
  EXPECT_EQ(total, 8 + 8 + 1000 + 4);
}

TEST(GradBuckets, RefusesAStageListOfAnotherLength) {
  std::vector<Parameter> ps = make_params({{8, DType::F32}});
  EXPECT_THROW(plan_buckets(pointers(ps), {}, 64), Error);
}
