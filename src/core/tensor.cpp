#include "core/tensor.h"

#include <algorithm>

namespace lathe {

int64_t shape_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

Shape contiguous_strides(const Shape& shape) {
  Shape strides(shape.size());
  int64_t s = 1;
  for (int i = int(shape.size()) - 1; i >= 0; --i) {
    strides[i] = s;
    s *= shape[i];
  }
  return strides;
}

std::string shape_str(const Shape& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

Storage::Storage(Allocator& allocator, size_t nbytes)
    : allocator_(&allocator), data_(allocator.allocate(nbytes)), nbytes_(nbytes) {}

Storage::~Storage() { allocator_->deallocate(data_, nbytes_); }

Tensor::Tensor(std::shared_ptr<Storage> storage, Shape shape, Shape strides, int64_t offset, DType dtype)
    : storage_(std::move(storage)), shape_(std::move(shape)), strides_(std::move(strides)),
      offset_(offset), dtype_(dtype) {
  LATHE_ASSERT(shape_.size() == strides_.size());
  for (int64_t s : shape_) LATHE_CHECK(s >= 0, "tensor: negative dimension in shape {}", shape_str(shape_));
}

Tensor Tensor::empty(const Shape& shape, DType dtype, Allocator& allocator) {
  for (int64_t s : shape) LATHE_CHECK(s >= 0, "tensor: negative dimension in shape {}", shape_str(shape));
  auto storage = std::make_shared<Storage>(allocator, size_t(shape_numel(shape)) * dtype_size(dtype));
  return Tensor(std::move(storage), shape, contiguous_strides(shape), 0, dtype);
}

int Tensor::wrap_dim(int d) const {
  const int n = dim();
  const int w = d < 0 ? d + n : d;
  LATHE_CHECK(w >= 0 && w < n, "tensor: dimension {} out of range for a {}-d tensor", d, n);
  return w;
}

int64_t Tensor::size(int d) const { return shape_[wrap_dim(d)]; }

Device Tensor::device() const { return storage_ ? storage_->device() : Device::cpu(); }

bool Tensor::is_contiguous() const {
  int64_t expected = 1;
  for (int i = dim() - 1; i >= 0; --i) {
    if (shape_[i] != 1 && strides_[i] != expected) return false;
    expected *= shape_[i];
  }
  return true;
}

bool rows_contiguous(const Tensor& t) {
  return t.dim() == 2 && (t.size(1) <= 1 || t.strides()[1] == 1) && (t.size(0) <= 1 || t.strides()[0] >= t.size(1));
}

int64_t leading_dim(const Tensor& t) { return std::max<int64_t>({t.size(0) > 1 ? t.strides()[0] : 0, t.size(1), 1}); }

Tensor empty_padded_rows(int64_t rows, int64_t cols, DType dtype, Allocator& allocator) {
  const int64_t ld = (cols + 63) / 64 * 64;
  return Tensor::empty({rows, ld}, dtype, allocator).narrow(1, 0, cols);
}

void* Tensor::data_ptr() const {
  LATHE_CHECK(defined(), "tensor: data of an undefined tensor");
  return static_cast<char*>(storage_->data()) + offset_ * int64_t(itemsize());
}

Tensor Tensor::view(Shape shape) const {
  LATHE_CHECK(is_contiguous(), "tensor: view() of a non-contiguous tensor {}", describe());
  int infer = -1;
  int64_t known = 1;
  for (int i = 0; i < int(shape.size()); ++i) {
    if (shape[i] == -1) {
      LATHE_CHECK(infer < 0, "tensor: view shape {} has more than one -1", shape_str(shape));
      infer = i;
    } else {
      known *= shape[i];
    }
  }
  if (infer >= 0) {
    LATHE_CHECK(known > 0 && numel() % known == 0, "tensor: cannot view {} as {}", describe(), shape_str(shape));
    shape[infer] = numel() / known;
  }
  LATHE_CHECK(shape_numel(shape) == numel(), "tensor: cannot view {} as {}", describe(), shape_str(shape));
  return Tensor(storage_, shape, contiguous_strides(shape), offset_, dtype_);
}

Tensor Tensor::transpose(int d0, int d1) const {
  std::vector<int> dims(dim());
  for (int i = 0; i < dim(); ++i) dims[i] = i;
  std::swap(dims[wrap_dim(d0)], dims[wrap_dim(d1)]);
  return permute(dims);
}

Tensor Tensor::permute(const std::vector<int>& dims) const {
  LATHE_CHECK(int(dims.size()) == dim(), "tensor: permute with {} dims of a {}-d tensor", dims.size(), dim());
  Shape shape(dim()), strides(dim());
  std::vector<bool> seen(dim(), false);
  for (int i = 0; i < dim(); ++i) {
    const int d = wrap_dim(dims[i]);
    LATHE_CHECK(!seen[d], "tensor: permute repeats dimension {}", d);
    seen[d] = true;
    shape[i] = shape_[d];
    strides[i] = strides_[d];
  }
  return Tensor(storage_, shape, strides, offset_, dtype_);
}

Tensor Tensor::narrow(int d, int64_t start, int64_t length) const {
  const int w = wrap_dim(d);
  LATHE_CHECK(start >= 0 && length >= 0 && start + length <= shape_[w],
              "tensor: narrow({}, {}, {}) out of range for {}", d, start, length, describe());
  Shape shape = shape_;
  shape[w] = length;
  return Tensor(storage_, shape, strides_, offset_ + start * strides_[w], dtype_);
}

Tensor Tensor::unsqueeze(int d) const {
  const int w = d < 0 ? d + dim() + 1 : d;
  LATHE_CHECK(w >= 0 && w <= dim(), "tensor: unsqueeze({}) of a {}-d tensor", d, dim());
  Shape shape = shape_, strides = strides_;
  shape.insert(shape.begin() + w, 1);
  strides.insert(strides.begin() + w, w < dim() ? strides_[w] * shape_[w] : 1);
  return Tensor(storage_, shape, strides, offset_, dtype_);
}

Tensor Tensor::expand(const Shape& shape) const {
  LATHE_CHECK(shape.size() >= shape_.size(), "tensor: cannot expand {} to {}", describe(), shape_str(shape));
  const size_t lead = shape.size() - shape_.size();
  Shape strides(shape.size(), 0);
  for (size_t i = 0; i < shape_.size(); ++i) {
    if (shape_[i] == shape[lead + i]) {
      strides[lead + i] = strides_[i];
    } else {
      LATHE_CHECK(shape_[i] == 1, "tensor: cannot expand {} to {}", describe(), shape_str(shape));
    }
  }
  return Tensor(storage_, shape, strides, offset_, dtype_);
}

std::string Tensor::describe() const {
  if (!defined()) return "undefined tensor";
  return fmt::format("{}{} on {}", dtype_name(dtype_), shape_str(shape_), device().str());
}

}  // namespace lathe
