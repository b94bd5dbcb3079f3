// dlpack.hpp: the DLPack structs (dmlc/dlpack include/dlpack/dlpack.h, ABI version 0.x, the
// one NumPy 1.24 and PyTorch 1.13 exchange), restated here because Debian ships no header.
// A producer's __dlpack__() returns a PyCapsule named "dltensor" holding a DLManagedTensor; a
// consumer that keeps the memory renames it "used_dltensor" and calls `deleter` when done.
#pragma once

#include <cstdint>

namespace attend_python {

enum DLDeviceType : int32_t { kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3 };

struct DLDevice {
  int32_t device_type;
  int32_t device_id;
};

enum DLDataTypeCode : uint8_t { kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLBfloat = 4, kDLBool = 6 };

struct DLDataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};

struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; null means C-contiguous
  uint64_t byte_offset;
};

struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};

}  // namespace attend_python
