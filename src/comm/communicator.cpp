#include "comm/communicator.h"

#include <algorithm>
#include <numeric>

#include "backend/runtime.h"
#include "core/error.h"

namespace lathe {

std::vector<double> values_over(Runtime& rt, Device device, Communicator& group, double mine) {
  const Tensor in = rt.from_host(&mine, {1}, DType::F64, device);
  Tensor all = Tensor::empty({int64_t(group.size())}, DType::F64, rt.context(device).allocator);
  group.all_gather(in, all).wait();
  const Tensor host = device.is_cpu() ? all : rt.copy_to(all, Device::cpu());
  return std::vector<double>(host.data<double>(), host.data<double>() + group.size());
}

std::vector<double> summed_over(Runtime& rt, Device device, Communicator& group, const std::vector<double>& values) {
  Tensor t = rt.from_host(values.data(), {int64_t(values.size())}, DType::F64, device);
  group.all_reduce(t).wait();
  const Tensor host = device.is_cpu() ? t : rt.copy_to(t, Device::cpu());
  return std::vector<double>(host.data<double>(), host.data<double>() + values.size());
}

std::vector<std::vector<double>> gathered_values(Runtime& rt, Device device, Communicator& group,
                                                 const std::vector<double>& mine) {
  const std::vector<double> lengths = values_over(rt, device, group, double(mine.size()));
  const int64_t longest = int64_t(*std::max_element(lengths.begin(), lengths.end()));
  std::vector<std::vector<double>> out(lengths.size());
  if (longest == 0) return out;
  std::vector<double> padded(mine);
  padded.resize(size_t(longest), 0.0);
  const Tensor in = rt.from_host(padded.data(), {longest}, DType::F64, device);
  Tensor all = Tensor::empty({longest * int64_t(group.size())}, DType::F64, rt.context(device).allocator);
  group.all_gather(in, all).wait();
  const Tensor host = device.is_cpu() ? all : rt.copy_to(all, Device::cpu());
  const double* v = host.data<double>();
  for (size_t r = 0; r < out.size(); ++r)
    out[r].assign(v + int64_t(r) * longest, v + int64_t(r) * longest + int64_t(lengths[r]));
  return out;
}

void check_reduce_scatter(const Communicator& c, const Tensor& in, const Tensor& out) {
  LATHE_CHECK(in.dtype() == out.dtype() && in.numel() == out.numel() * c.size(),
              "comm: reduce_scatter on {}: input of {} elements for an output of {} on {} ranks", c.name(), in.numel(),
              out.numel(), c.size());
}

void check_all_gather(const Communicator& c, const Tensor& in, const Tensor& out) {
  LATHE_CHECK(in.dtype() == out.dtype() && out.numel() == in.numel() * c.size(),
              "comm: all_gather on {}: output of {} elements for inputs of {} on {} ranks", c.name(), out.numel(),
              in.numel(), c.size());
}

void check_all_to_all(const Communicator& c, const Tensor& in, const std::vector<int64_t>& send_counts, const Tensor& out,
                      const std::vector<int64_t>& recv_counts) {
  LATHE_CHECK(int(send_counts.size()) == c.size() && int(recv_counts.size()) == c.size(),
              "comm: all_to_all on {}: {} send and {} receive counts for {} ranks", c.name(), send_counts.size(),
              recv_counts.size(), c.size());
  const int64_t sent = std::accumulate(send_counts.begin(), send_counts.end(), int64_t(0));
  const int64_t received = std::accumulate(recv_counts.begin(), recv_counts.end(), int64_t(0));
  LATHE_CHECK(in.dtype() == out.dtype() && sent == in.numel() && received == out.numel(),
              "comm: all_to_all on {}: counts ({} sent, {} received) do not match the tensors ({} and {} elements)",
              c.name(), sent, received, in.numel(), out.numel());
}

}  // namespace lathe
