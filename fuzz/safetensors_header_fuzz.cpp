// libFuzzer target for the safetensors header validation in src/io/safetensors.cpp.
// Convention: each input is tried twice, as a whole file image (8-byte size + header + data) and as bare
// header JSON over a 4 KiB data region; an accepted header must satisfy every documented invariant.
// Only lathe::Error may escape the parser: anything else (crash, other exception, hang) is a finding.
// Built and run by fuzz/run.sh; fuzz/README.md explains the corpus.
#include <cstdint>
#include <cstdlib>
#include <set>
#include <vector>

#include "core/error.h"
#include "io/safetensors.h"

namespace {

using lathe::io::SafetensorsHeader;
using lathe::io::SafetensorsTensor;

void require(bool ok) {
  if (!ok) std::abort();
}

// The invariants a caller relies on once parsing succeeded.
void check_header(const SafetensorsHeader& h, uint64_t data_size) {
  std::set<std::string> names;
  const SafetensorsTensor* previous = nullptr;
  uint64_t furthest_end = 0;
  for (const SafetensorsTensor& t : h.tensors) {
    require(names.insert(t.name).second);
    require(t.data_begin <= t.data_end && t.data_end <= data_size);
    uint64_t numel = 1;
    for (int64_t d : t.shape) {
      require(d >= 0);
      numel *= uint64_t(d);  // cannot overflow: the parser checked it (or a dimension is 0)
    }
    require(numel == uint64_t(t.numel));
    require(t.byte_size() == numel * lathe::dtype_size(t.dtype));
    if (previous) require(previous->data_begin <= t.data_begin);  // file order
    if (t.byte_size() > 0) {
      require(t.data_begin >= furthest_end);  // no overlap
      furthest_end = t.data_end;
    }
    previous = &t;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    SafetensorsHeader h = lathe::io::parse_safetensors_bytes({data, size}, "fuzz");
    require(h.data_offset <= size);
    check_header(h, size - h.data_offset);
    // Read every tensor back through the converter, as a loader would (ASan checks the bounds).
    for (SafetensorsTensor& t : h.tensors) {
      t.data = data + h.data_offset + t.data_begin;
      const lathe::DType dst = lathe::is_floating(t.dtype) ? lathe::DType::F32 : t.dtype;
      std::vector<uint8_t> out(size_t(t.numel) * lathe::dtype_size(dst));
      lathe::io::convert_tensor(t, dst, out.data(), out.size(), "fuzz");
    }
  } catch (const lathe::Error&) {
  }

  constexpr uint64_t kDataSize = 4096;
  try {
    const std::string_view json(reinterpret_cast<const char*>(data), size);
    check_header(lathe::io::parse_safetensors_header(json, kDataSize, "fuzz"), kDataSize);
  } catch (const lathe::Error&) {
  }
  return 0;
}
