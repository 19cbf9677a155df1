// Safetensors files: a validating reader (memory-mapped), an atomic writer, and Hugging Face
// sharded model folders (model-0000i-of-0000N.safetensors + model.safetensors.index.json).
// Convention: every header is fully validated before any tensor is exposed, and every failure is a
// lathe::Error starting with "safetensors: <file>:"; data offsets are relative to the data region.
// Covered by tests/io/test_safetensors.cpp and fuzz/safetensors_header_fuzz.cpp; format notes in
// docs/safetensors.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"

namespace lathe::io {

// Headers larger than this are refused (the same cap as the reference Rust implementation).
inline constexpr uint64_t kMaxHeaderBytes = 100'000'000;

// One validated header entry. `data` is null in a bare parsed header and points into the file
// mapping for a tensor of an open SafetensorsFile (not aligned to the element size).
struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;  // empty for a scalar
  int64_t numel = 0;
  uint64_t data_begin = 0;  // byte range [data_begin, data_end) relative to the data region
  uint64_t data_end = 0;
  const uint8_t* data = nullptr;

  uint64_t byte_size() const { return data_end - data_begin; }
};

struct SafetensorsHeader {
  std::vector<SafetensorsTensor> tensors;  // sorted by (data_begin, data_end, name): file order
  std::map<std::string, std::string> metadata;  // "__metadata__", empty when absent
  uint64_t data_offset = 0;  // file offset of the data region: 8 + header size
};

// Validates a header (the JSON text after the 8-byte size) against a data region of `data_size`
// bytes. Pure: never reads outside `json`; `source_label` (a path) starts every error message.
SafetensorsHeader parse_safetensors_header(std::string_view json, uint64_t data_size,
                                           std::string_view source_label);

// Validates a whole file held in memory: the 8-byte size, then the header against the rest.
SafetensorsHeader parse_safetensors_bytes(std::span<const uint8_t> bytes, std::string_view source_label);

// Converts a tensor's elements into `out` (exactly numel * dtype_size(dst) bytes). Any dtype copies to
// itself; otherwise only floating -> floating (F32/F64/BF16/F16, rounding to nearest even).
void convert_tensor(const SafetensorsTensor& tensor, DType dst, void* out, size_t out_bytes,
                    std::string_view source_label);

// A read-only memory-mapped .safetensors file. Movable, not copyable; tensor data pointers stay
// valid until the file is destroyed (moving does not change them).
class SafetensorsFile {
 public:
  static SafetensorsFile open(const std::string& path);

  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();

  const std::string& path() const { return path_; }
  const std::vector<SafetensorsTensor>& tensors() const { return header_.tensors; }  // file order
  const std::map<std::string, std::string>& metadata() const { return header_.metadata; }

  const SafetensorsTensor* find(std::string_view name) const;  // null when absent
  const SafetensorsTensor& get(std::string_view name) const;   // throws naming file and tensor
  std::vector<float> read_as_f32(std::string_view name) const;
  void read_into(std::string_view name, DType dst, void* out, size_t out_bytes) const;
  // The box [offset, offset + box) of a tensor viewed as 2-D (dim 0 by the product of the others), row-major, as
  // `dst`: only the box's bytes are read from the mapping (a tensor-parallel slice: its rows, or its columns of every
  // row).
  void read_box_into(std::string_view name, const std::vector<int64_t>& offset, const std::vector<int64_t>& box,
                     DType dst, void* out, size_t out_bytes) const;

 private:
  SafetensorsFile() = default;
  void unmap();

  std::string path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  SafetensorsHeader header_;
  std::map<std::string, size_t, std::less<>> by_name_;  // name -> index into header_.tensors
};

// A tensor to write. `byte_size` is the size of the buffer at `data` and must equal
// numel * dtype_size(dtype); `data` may be null only when byte_size is 0.
struct TensorRef {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  size_t byte_size = 0;
};

// Writes one file atomically (temp file, fsync, rename, fsync of the folder). Tensors are laid out
// sorted by name; the header is padded with spaces to a multiple of 8 bytes.
void write_safetensors(const std::string& path, std::vector<TensorRef> tensors,
                       const std::map<std::string, std::string>& metadata = {});

// Writes a Hugging Face model folder (created if missing): tensors sorted by name, packed greedily
// into shards of at most `max_shard_bytes` tensor bytes (a larger tensor gets a shard of its own).
// One shard -> "model.safetensors" and no index; otherwise "model-0000i-of-0000N.safetensors" and
// "model.safetensors.index.json". Files of an earlier save that the new one does not use
// (stale shards, index or single file) are removed afterwards. `metadata` goes into every file;
// Hugging Face transformers only loads files whose metadata has {"format": "pt"}.
void write_sharded_safetensors(const std::string& dir, std::vector<TensorRef> tensors,
                               uint64_t max_shard_bytes,
                               const std::map<std::string, std::string>& metadata = {});

inline constexpr const char* kSafetensorsSingleFile = "model.safetensors";
inline constexpr const char* kSafetensorsIndexFile = "model.safetensors.index.json";

// A Hugging Face model folder: the index and its shards if the index exists, else model.safetensors.
class SafetensorsModel {
 public:
  static SafetensorsModel open(const std::string& dir);

  const std::string& dir() const { return dir_; }
  const std::vector<SafetensorsFile>& files() const { return files_; }
  std::vector<std::string> names() const;  // sorted

  const SafetensorsTensor* find(std::string_view name) const;  // null when absent
  const SafetensorsTensor& get(std::string_view name) const;   // throws naming the folder
  const SafetensorsFile& file_of(std::string_view name) const;
  std::vector<float> read_as_f32(std::string_view name) const;
  void read_into(std::string_view name, DType dst, void* out, size_t out_bytes) const;
  void read_box_into(std::string_view name, const std::vector<int64_t>& offset, const std::vector<int64_t>& box,
                     DType dst, void* out, size_t out_bytes) const;

 private:
  std::string dir_;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, size_t, std::less<>> file_of_;  // tensor name -> index into files_
};

}  // namespace lathe::io
