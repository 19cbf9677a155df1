#include "model/batch.h"

#include <algorithm>

namespace lathe {

std::vector<int32_t> next_token_labels(const std::vector<int32_t>& ids, const std::vector<int32_t>& cu) {
  std::vector<int32_t> labels(ids.size(), -100);
  for (size_t b = 0; b + 1 < cu.size(); ++b)
    for (int32_t i = cu[b]; i + 1 < cu[b + 1]; ++i) labels[size_t(i)] = ids[size_t(i) + 1];
  return labels;
}

namespace {

// Checks a batch's documents (cu_seqlens from 0 to the token count, never decreasing), ids and labels; returns the
// number of labelled tokens.
int64_t check_batch(const std::vector<int32_t>& ids, const std::vector<int32_t>& cu, const std::vector<int32_t>& labels,
                    int64_t vocab_size) {
  const int64_t t = int64_t(ids.size());
  LATHE_CHECK(t > 0, "batch: no tokens");
  LATHE_CHECK(cu.size() >= 2 && cu.front() == 0 && cu.back() == t,
              "batch: cu_seqlens must run from 0 to the token count {} (got {} entries ending at {})", t, cu.size(),
              cu.empty() ? -1 : cu.back());
  for (size_t i = 1; i < cu.size(); ++i)
    LATHE_CHECK(cu[i] >= cu[i - 1], "batch: cu_seqlens decreases at entry {}", i);
  LATHE_CHECK(labels.size() == ids.size(), "batch: {} labels for {} tokens", labels.size(), ids.size());
  int64_t labelled = 0;
  for (int64_t i = 0; i < t; ++i) {
    LATHE_CHECK(ids[size_t(i)] >= 0 && ids[size_t(i)] < vocab_size,
                "batch: token id {} at position {} is outside the vocabulary (size {})", ids[size_t(i)], i, vocab_size);
    const int32_t l = labels[size_t(i)];
    LATHE_CHECK(l == -100 || (l >= 0 && l < vocab_size), "batch: label {} at position {} is outside the vocabulary (size {})",
                l, i, vocab_size);
    labelled += l != -100;
  }
  return labelled;
}

// A checked batch on `device`.
PackedBatch upload_batch(Runtime& rt, Device device, std::vector<int32_t> ids, const std::vector<int32_t>& positions,
                         std::vector<int32_t> cu, std::vector<int32_t> labels, int64_t labelled) {
  const int64_t t = int64_t(ids.size());
  PackedBatch b;
  b.ids = rt.upload(ids.data(), {t}, DType::I32, device);  // no wait: the device may still run the last step
  b.positions = rt.upload(positions.data(), {t}, DType::I32, device);
  b.cu_seqlens = rt.upload(cu.data(), {int64_t(cu.size())}, DType::I32, device);
  b.labels = rt.upload(labels.data(), {t}, DType::I32, device);
  b.num_labelled = labelled;
  b.host_ids = std::move(ids);
  b.host_labels = std::move(labels);
  b.host_cu = std::move(cu);
  return b;
}

}  // namespace

PackedBatch make_packed_batch(Runtime& rt, Device device, std::vector<int32_t> ids, std::vector<int32_t> cu,
                              std::vector<int32_t> labels, int64_t vocab_size) {
  const int64_t labelled = check_batch(ids, cu, labels, vocab_size);
  std::vector<int32_t> positions(ids.size());
  for (size_t b = 0; b + 1 < cu.size(); ++b)
    for (int32_t i = cu[b]; i < cu[b + 1]; ++i) positions[size_t(i)] = i - cu[b];
  return upload_batch(rt, device, std::move(ids), positions, std::move(cu), std::move(labels), labelled);
}

PackedBatch continuation_batch(Runtime& rt, Device device, const std::vector<std::vector<int32_t>>& tokens,
                               const std::vector<int64_t>& past, int64_t vocab_size) {
  LATHE_CHECK(tokens.size() == past.size(), "batch: {} sequences' tokens for {} lengths", tokens.size(), past.size());
  std::vector<int32_t> ids, positions, cu = {0};
  for (size_t i = 0; i < tokens.size(); ++i) {
    for (size_t k = 0; k < tokens[i].size(); ++k) positions.push_back(int32_t(past[i] + int64_t(k)));
    ids.insert(ids.end(), tokens[i].begin(), tokens[i].end());
    cu.push_back(int32_t(ids.size()));
  }
  std::vector<int32_t> labels(ids.size(), -100);
  check_batch(ids, cu, labels, vocab_size);
  return upload_batch(rt, device, std::move(ids), positions, std::move(cu), std::move(labels), 0);
}

void set_segments(PackedBatch& b, std::vector<BatchSegment> segments) {
  int64_t start = 0;
  for (size_t i = 0; i < segments.size(); ++i) {
    const int64_t end = segments[i].rows_end;
    LATHE_CHECK(end >= start && end <= b.tokens(), "batch: segment {} ends at row {} (previous end {}, {} rows)", i, end, start,
                b.tokens());
    LATHE_CHECK(std::binary_search(b.host_cu.begin(), b.host_cu.end(), int32_t(end)),
                "batch: segment {} ends at row {}, inside a document", i, end);
    start = end;
  }
  LATHE_CHECK(segments.empty() || start == b.tokens(), "batch: the segments cover {} of {} rows", start, b.tokens());
  b.segments = std::move(segments);
}

}  // namespace lathe
