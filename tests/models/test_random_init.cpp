// The counter-based random initialisation (model/random_init.h): the draws' sample statistics against the
// distributions' known moments, repeatability, and independence of the tensors' seeds.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "model/random_init.h"

namespace lathe {
namespace {

TEST(RandomInit, NormalDrawsHaveTheDistributionsMoments) {
  const size_t n = 1 << 20;
  std::vector<double> x(n + 1);  // an odd count: the last pair's second value is dropped
  fill_normal(x, tensor_seed(3, 0), 0.5);
  double mean = 0, var = 0, fourth = 0;
  size_t within_one_sd = 0;
  for (double v : x) mean += v;
  mean /= double(x.size());
  for (double v : x) {
    var += (v - mean) * (v - mean);
    fourth += std::pow(v / 0.5, 4);
    within_one_sd += std::abs(v) < 0.5;
  }
  var /= double(x.size() - 1);
  fourth /= double(x.size());
  // Standard errors at n = 2^20: mean 0.5 / 1024; sd about 0.5 / sqrt(2n); P(|z| < 1) = 0.682689 with sd 0.00045.
  EXPECT_NEAR(mean, 0.0, 5 * 0.5 / 1024);
  EXPECT_NEAR(std::sqrt(var), 0.5, 5 * 0.5 / std::sqrt(2.0 * double(n)));
  EXPECT_NEAR(fourth, 3.0, 0.05);  // a normal's kurtosis
  EXPECT_NEAR(double(within_one_sd) / double(x.size()), 0.682689, 5 * 0.00045);
}

TEST(RandomInit, UniformDrawsStayInTheirRangeWithTheRightMean) {
  std::vector<double> x(1 << 20);
  fill_uniform(x, tensor_seed(3, 1), 0.01, 16.0);
  double mean = 0;
  for (double v : x) {
    ASSERT_GE(v, 0.01);
    ASSERT_LT(v, 16.0);
    mean += v;
  }
  mean /= double(x.size());
  EXPECT_NEAR(mean, (0.01 + 16.0) / 2, 5 * (16.0 - 0.01) / std::sqrt(12.0 * double(x.size())));
}

TEST(RandomInit, DrawsRepeatAndTensorsGetTheirOwn) {
  std::vector<double> a(1000), b(1000), c(1000), d(1000);
  fill_normal(a, tensor_seed(7, 4), 1.0);
  fill_normal(b, tensor_seed(7, 4), 1.0);
  fill_normal(c, tensor_seed(7, 5), 1.0);  // the next tensor
  fill_normal(d, tensor_seed(8, 4), 1.0);  // another run's seed
  EXPECT_EQ(a, b);
  double ac = 0, ad = 0;  // sample correlations: about 1 / sqrt(1000) = 0.03 for independent draws
  for (size_t i = 0; i < a.size(); ++i) ac += a[i] * c[i], ad += a[i] * d[i];
  EXPECT_LT(std::abs(ac / 1000), 0.15);
  EXPECT_LT(std::abs(ad / 1000), 0.15);
  EXPECT_NE(a, c);
}

}  // namespace
}  // namespace lathe
