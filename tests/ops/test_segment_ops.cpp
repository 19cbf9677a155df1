// The row-segment ops beyond what the op check can see: segment_mask selects (Inf/NaN outside the kept blocks give
// 0), dropout keeps the right fraction, its mask depends only on (seed, local index) so a segment gets the same
// mask wherever it sits, the hash is pinned to splitmix64's reference output, attrs are validated with clear
// errors, and on a GPU the CUDA mask is bit-identical to the CPU one. Values and gradients against the f64
// reference: the segment_mask / dropout op-check cases (src/testing/op_cases.cpp).
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <random>

#include "backend/dropout_hash.h"
#include "backend/runtime.h"
#include "ops/ops.h"
#include "support/error_of.h"

using namespace lathe;
using lathe::test_support::error_of;

namespace {

Runtime& runtime() {
  static Runtime rt;
  return rt;
}

Tensor make(const std::vector<double>& values, const Shape& shape, DType dtype, Device device = Device::cpu()) {
  std::vector<uint8_t> bytes(values.size() * dtype_size(dtype));
  for (size_t i = 0; i < values.size(); ++i) store_from_double(bytes.data(), dtype, int64_t(i), values[i]);
  return runtime().from_host(bytes.data(), shape, dtype, device);
}

std::vector<double> values(const Tensor& t) {
  const Tensor h = runtime().copy_to(t, Device::cpu());
  std::vector<double> v(size_t(h.numel()));
  for (int64_t i = 0; i < h.numel(); ++i) v[size_t(i)] = load_as_double(h.data_ptr(), h.dtype(), i);
  return v;
}

std::vector<Device> devices() {
  std::vector<Device> d = {Device::cpu()};
  if (runtime().has_device(Device::cuda(0))) d.push_back(Device::cuda(0));
  return d;
}

SegmentAttrs dropout_attrs(std::vector<int64_t> rows, std::vector<double> p, std::vector<uint64_t> seed) {
  SegmentAttrs a;
  a.rows = std::move(rows);
  a.p = std::move(p);
  a.seed = std::move(seed);
  return a;
}

}  // namespace

TEST(SegmentOps, HashIsSplitmix64) {
  // splitmix64's first output for state 0 (Vigna's reference splitmix64.c); n = 0 hashes the seed itself.
  EXPECT_EQ(splitmix64(0), 0xE220A8397B1DCDAFull);
  EXPECT_EQ(dropout_bits(0, 0), uint32_t(0xE220A8397B1DCDAFull >> 40));
  EXPECT_EQ(dropout_threshold(0.0), 0u);
  EXPECT_EQ(dropout_threshold(0.5), 1u << 23);
  EXPECT_EQ(dropout_threshold(0.3), uint32_t(std::ceil(0.3 * 16777216.0)));
}

TEST(SegmentOps, MaskSelectsSoInfAndNanOutsideGiveZero) {
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  // x (5, 4): rows 0-1 segment 0 keeps cols [1, 3) x 2; row 2 segment 1 keeps col [0, 1) x -1; rows 3-4 are past
  // the last segment. Every element outside the kept blocks is Inf, -Inf or NaN.
  const std::vector<double> x = {inf, 1, 2, nan,    //
                                 -inf, 3, 4, inf,   //
                                 5, nan, -inf, nan,  //
                                 nan, inf, -inf, nan,  //
                                 inf, inf, nan, nan};
  SegmentAttrs a;
  a.rows = {0, 2, 3};
  a.col_begin = {1, 0};
  a.col_end = {3, 1};
  a.scale = {2.0, -1.0};
  const std::vector<double> want = {0, 2, 4, 0, 0, 6, 8, 0, -5, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  for (const Device& dev : devices())
    for (DType dt : {DType::F32, DType::F64, DType::BF16, DType::F16}) {
      ExecContext ctx = runtime().context(dev);
      const std::vector<double> y = values(segment_mask(ctx, make(x, {5, 4}, dt, dev), a));
      for (size_t i = 0; i < want.size(); ++i)
        EXPECT_EQ(y[i], want[i]) << dev.str() << " " << dtype_name(dt) << " element " << i;
    }
}

TEST(SegmentOps, DropoutKeepsSeventyPercentAtP03) {
  const int64_t t = 100, c = 1000;  // 100k elements in one segment
  const std::vector<double> ones(size_t(t * c), 1.0);
  for (const Device& dev : devices()) {
    ExecContext ctx = runtime().context(dev);
    const std::vector<double> y =
        values(dropout(ctx, make(ones, {t, c}, DType::F32, dev), dropout_attrs({0, t}, {0.3}, {1234})));
    int64_t kept = 0;
    for (double v : y) {
      if (v != 0) {
        ++kept;
        EXPECT_EQ(v, double(1.0f / float(1.0 - 0.3))) << dev.str();  // x / (1 - p) in f32
      }
    }
    EXPECT_NEAR(double(kept) / double(t * c), 0.7, 0.01) << dev.str();
  }
}

TEST(SegmentOps, DropoutMaskIsTheSameWhereverTheSegmentSits) {
  const int64_t c = 33, len = 40;
  std::mt19937_64 rng(5);
  std::vector<double> seg(size_t(len * c));
  for (double& v : seg) v = std::uniform_real_distribution<double>(0.5, 2.0)(rng);  // never 0
  // Alone at rows [0, 40), then as the second segment at rows [17, 57) of a batch of 60 rows.
  const int64_t off = 17, t = 60;
  std::vector<double> batch(size_t(t * c), 1.0);
  std::copy(seg.begin(), seg.end(), batch.begin() + off * c);
  for (const Device& dev : devices()) {
    ExecContext ctx = runtime().context(dev);
    const std::vector<double> alone =
        values(dropout(ctx, make(seg, {len, c}, DType::F32, dev), dropout_attrs({0, len}, {0.3}, {99})));
    const std::vector<double> moved = values(dropout(ctx, make(batch, {t, c}, DType::F32, dev),
                                                     dropout_attrs({0, off, off + len}, {0.5, 0.3}, {7, 99})));
    int64_t dropped = 0;
    for (int64_t i = 0; i < len * c; ++i) {
      ASSERT_EQ(alone[size_t(i)], moved[size_t(off * c + i)]) << dev.str() << " element " << i;
      dropped += alone[size_t(i)] == 0;
    }
    EXPECT_GT(dropped, 0);
    for (int64_t i = (off + len) * c; i < t * c; ++i) EXPECT_EQ(moved[size_t(i)], 1.0) << "tail row passes through";
  }
}

// A rank's part of a segment (context parallelism: its rows begin inside the segment, row_shift; tensor parallelism:
// its columns of a row-parallel input, col_offset of row_width) draws exactly the part of the whole segment's mask:
// two segments of 40 and 23 rows of 48 columns; the part is rows [25, 55) (the first segment's last 15 rows, the
// second's first 15) and columns [16, 40). Fails with either shift left out.
TEST(SegmentOps, DropoutOfAPartIsThePartOfTheWholesMask) {
  const int64_t w = 48, t = 63, r1 = 25, r2 = 55, c1 = 16, c2 = 40, rows = r2 - r1, cols = c2 - c1;
  std::mt19937_64 rng(9);
  std::vector<double> whole(size_t(t * w));
  for (double& v : whole) v = std::uniform_real_distribution<double>(0.5, 2.0)(rng);  // never 0
  std::vector<double> part;
  for (int64_t i = r1; i < r2; ++i)
    for (int64_t j = c1; j < c2; ++j) part.push_back(whole[size_t(i * w + j)]);
  for (const Device& dev : devices()) {
    ExecContext ctx = runtime().context(dev);
    const std::vector<double> all =
        values(dropout(ctx, make(whole, {t, w}, DType::F32, dev), dropout_attrs({0, 40, 63}, {0.3, 0.5}, {11, 12})));
    SegmentAttrs a = dropout_attrs({0, 40 - r1, rows}, {0.3, 0.5}, {11, 12});
    a.row_shift = {r1, 0};  // the first segment began 25 rows before this part; the second begins inside it
    a.col_offset = c1;
    a.row_width = w;
    const std::vector<double> got = values(dropout(ctx, make(part, {rows, cols}, DType::F32, dev), a));
    int64_t dropped = 0;
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) {
        ASSERT_EQ(got[size_t(i * cols + j)], all[size_t((r1 + i) * w + c1 + j)]) << dev.str() << " " << i << "," << j;
        dropped += got[size_t(i * cols + j)] == 0;
      }
    EXPECT_GT(dropped, 0);
  }
}

TEST(SegmentOps, CudaMaskIsBitIdenticalToCpu) {
  std::string why;
  if (!runtime().has_device(Device::cuda(0), &why)) GTEST_SKIP() << "no CUDA device: " << why;
  const int64_t t = 257, c = 301;
  std::mt19937_64 rng(11);
  std::vector<double> x(size_t(t * c));
  for (double& v : x) v = std::uniform_real_distribution<double>(0.5, 2.0)(rng);
  const SegmentAttrs a = dropout_attrs({0, 3, 3, 130, 250}, {0.3, 0.9, 0.0, 0.05}, {1, 2, 3, ~0ull});
  for (DType dt : {DType::F32, DType::F64, DType::BF16, DType::F16}) {
    ExecContext cpu = runtime().context(Device::cpu());
    ExecContext gpu = runtime().context(Device::cuda(0));
    const std::vector<double> yc = values(dropout(cpu, make(x, {t, c}, dt), a));
    const std::vector<double> yg = values(dropout(gpu, make(x, {t, c}, dt, Device::cuda(0)), a));
    for (size_t i = 0; i < yc.size(); ++i) ASSERT_EQ(yc[i], yg[i]) << dtype_name(dt) << " element " << i;
  }
}

TEST(SegmentOps, InvalidAttrsNameTheOpAndTheProblem) {
  ExecContext ctx = runtime().context(Device::cpu());
  const Tensor x = make(std::vector<double>(12, 1.0), {3, 4}, DType::F32);
  SegmentAttrs m;
  m.rows = {0, 2};
  m.col_begin = {1};
  m.col_end = {5};
  m.scale = {1.0};
  EXPECT_NE(error_of([&] { segment_mask(ctx, x, m); }).find("segment_mask columns [1, 5)"), std::string::npos);
  m.col_end = {4};
  m.rows = {0, 4};
  EXPECT_NE(error_of([&] { segment_mask(ctx, x, m); }).find("rows end at 4"), std::string::npos);
  m.rows = {0, 2, 1};
  EXPECT_NE(error_of([&] { segment_mask(ctx, x, m); }).find("non-decreasing"), std::string::npos);
  m.rows = {0, 1, 2};
  EXPECT_NE(error_of([&] { segment_mask(ctx, x, m); }).find("one col_begin per segment"), std::string::npos);
  EXPECT_NE(error_of([&] { dropout(ctx, x, dropout_attrs({0, 2}, {1.0}, {1})); }).find("dropout p of segment 0"),
            std::string::npos);
  EXPECT_NE(error_of([&] { dropout(ctx, x, dropout_attrs({0, 2}, {0.1}, {})); }).find("dropout needs one seed"),
            std::string::npos);
  const Tensor x3 = make(std::vector<double>(8, 1.0), {2, 2, 2}, DType::F32);
  EXPECT_NE(error_of([&] { dropout(ctx, x3, dropout_attrs({0}, {}, {})); }).find("dropout needs x (T, C)"),
            std::string::npos);
  SegmentAttrs part = dropout_attrs({0, 2}, {0.1}, {1});
  part.col_offset = 3;
  part.row_width = 6;  // columns [3, 7) of 6
  EXPECT_NE(error_of([&] { dropout(ctx, x, part); }).find("dropout columns [3, 7) of x"), std::string::npos);
  part.col_offset = 0;
  part.row_shift = {-1};
  EXPECT_NE(error_of([&] { dropout(ctx, x, part); }).find("dropout row_shift -1 is negative"), std::string::npos);
}
