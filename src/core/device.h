// Where data lives: the host (CPU) or one CUDA device.
// Covered by tests/unit/test_core.cpp.
#pragma once

#include <cstdint>
#include <string>

namespace lathe {

enum class DeviceType : uint8_t { CPU, CUDA };

struct Device {
  DeviceType type = DeviceType::CPU;
  int index = 0;

  static Device cpu() { return {DeviceType::CPU, 0}; }
  static Device cuda(int index) { return {DeviceType::CUDA, index}; }
  bool is_cpu() const { return type == DeviceType::CPU; }
  bool is_cuda() const { return type == DeviceType::CUDA; }
  bool operator==(const Device&) const = default;
  std::string str() const;  // "cpu" or "cuda:N"
};

const char* device_type_name(DeviceType t);
Device parse_device(const std::string& text);  // "cpu", "cuda", "cuda:1"; throws on anything else

}  // namespace lathe
