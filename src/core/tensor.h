// Tensor: a typed, strided view of reference-counted storage on one device.
// Strides and offsets count elements, not bytes. Views (view, transpose, permute, narrow, expand) share
// storage; copies and device transfers are ops (ops/ops.h) or Runtime::to_device, never implicit.
// Covered by tests/unit/test_core.cpp.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "core/dtype.h"
#include "core/error.h"

namespace lathe {

using Shape = std::vector<int64_t>;

int64_t shape_numel(const Shape& shape);
Shape contiguous_strides(const Shape& shape);
std::string shape_str(const Shape& shape);  // "[2, 3]"

// A block of bytes obtained from an allocator, returned to it on destruction.
class Storage {
 public:
  Storage(Allocator& allocator, size_t nbytes);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }
  Device device() const { return allocator_->device(); }
  Allocator& allocator() const { return *allocator_; }

 private:
  Allocator* allocator_;
  void* data_;
  size_t nbytes_;
};

class Tensor {
 public:
  Tensor() = default;  // undefined tensor: defined() is false
  Tensor(std::shared_ptr<Storage> storage, Shape shape, Shape strides, int64_t offset, DType dtype);

  static Tensor empty(const Shape& shape, DType dtype, Allocator& allocator);

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  int64_t offset() const { return offset_; }
  int dim() const { return int(shape_.size()); }
  int64_t size(int d) const;  // negative d counts from the end
  int64_t numel() const { return shape_numel(shape_); }
  DType dtype() const { return dtype_; }
  size_t itemsize() const { return dtype_size(dtype_); }
  size_t nbytes() const { return size_t(numel()) * itemsize(); }
  Device device() const;
  const std::shared_ptr<Storage>& storage() const { return storage_; }
  bool is_contiguous() const;

  void* data_ptr() const;
  template <typename T> T* data() const {
    LATHE_CHECK(DTypeOf<T>::value == dtype_, "tensor: data<{}>() on a {} tensor",
                dtype_name(DTypeOf<T>::value), dtype_name(dtype_));
    return static_cast<T*>(data_ptr());
  }

  // Views sharing storage.
  Tensor view(Shape shape) const;  // contiguous tensors only; one dimension may be -1
  Tensor transpose(int d0, int d1) const;
  Tensor permute(const std::vector<int>& dims) const;
  Tensor narrow(int d, int64_t start, int64_t length) const;
  Tensor unsqueeze(int d) const;
  Tensor expand(const Shape& shape) const;  // broadcast size-1 (or missing leading) dims with stride 0

  std::string describe() const;  // "bf16[2, 3] on cuda:0"

 private:
  int wrap_dim(int d) const;

  std::shared_ptr<Storage> storage_;
  Shape shape_;
  Shape strides_;
  int64_t offset_ = 0;
  DType dtype_ = DType::F32;
};

// A 2-D tensor whose rows are contiguous and at least a row apart: a matrix, or a column slice of a wider one (one
// projection's columns of a fused output; a row padded so that the next starts on a 16-byte boundary). Kernels that
// take this layout address it by its leading dimension.
bool rows_contiguous(const Tensor& t);
int64_t leading_dim(const Tensor& t);  // elements from one row of such a tensor to the next (>= its row length, >= 1)

// A (rows, cols) tensor whose rows start a multiple of 64 elements apart (a column slice of a wider buffer), so
// that GEMMs and vector kernels take whole 16-byte packs whatever `cols` is: a vocabulary of 151,669 as the LM
// head's leading dimension slowed its GEMMs fivefold (docs/benchmarks.md, session 16).
Tensor empty_padded_rows(int64_t rows, int64_t cols, DType dtype, Allocator& allocator);

}  // namespace lathe
