// Host-side types shared by the kernel families in csrc/ and by bindings.cpp.
//
// spectral_ops._C does not link libtorch. A tensor crosses the ABI as a TensorDesc built from
// (data pointer as uint64, shape, strides in elements, dtype code, device index) and the caller's
// stream as an integer cudaStream_t; spectral_ops/_extension.py builds the Python side.
//
// Error convention, relied on by bindings.cpp and the Python tests:
//   std::invalid_argument -> ValueError   (bad shape, strides, alignment, device)
//   spectral_ops::TypeError -> TypeError  (bad dtype)
//   std::runtime_error    -> RuntimeError (no device, CUDA errors)
// Every op validates all of its arguments before its first CUDA runtime call, so the validation is
// testable on machines without a GPU.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace spectral_ops {

// Dtype codes; spectral_ops/_extension.py has the same table (DTYPE_CODES). They are ABI: append only.
enum class DType : int {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
  kFloat64 = 3,
  // Only the random bits of a stochastic rounding (decay_epilogue_'s noise): no kernel computes on it.
  kInt16 = 4,
};

inline const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat64: return "float64";
    case DType::kInt16: return "int16";
  }
  return "unknown";
}

// Also called from device code (csrc/device.cuh).
__host__ __device__ inline int64_t element_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
    case DType::kBFloat16:
    case DType::kInt16: return 2;
    case DType::kFloat32: return 4;
    case DType::kFloat64: return 8;
  }
  return 0;
}

class TypeError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// Most dimensions a kernel walks after merging (see the layout code of each family).
constexpr int kMaxDims = 8;

inline std::string format_dims(const std::vector<int64_t>& dims) {
  std::string out = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    out += (i ? ", " : "") + std::to_string(dims[i]);
  }
  return out + "]";
}

inline std::string format_device(int device) {
  return device < 0 ? std::string("cpu") : "cuda:" + std::to_string(device);
}

struct TensorDesc {
  const char* name;  // the argument's name, for error messages
  uint64_t data;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;  // in elements
  DType dtype;
  int device;  // CUDA ordinal; -1 for host memory

  int ndim() const { return static_cast<int>(shape.size()); }

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t size : shape) n *= size;
    return n;
  }

  template <typename T>
  T* ptr() const {
    return reinterpret_cast<T*>(static_cast<uintptr_t>(data));
  }

  std::string describe() const {
    return std::string(name) + " (" + dtype_name(dtype) + ", shape " + format_dims(shape) + ", strides " +
           format_dims(strides) + ")";
  }
};

// Builds a descriptor and checks everything that can be checked about one tensor on its own.
inline TensorDesc make_tensor_desc(const char* name, uint64_t data, std::vector<int64_t> shape,
                                   std::vector<int64_t> strides, int dtype_code, int device) {
  if (dtype_code < 0 || dtype_code > static_cast<int>(DType::kInt16)) {
    throw TypeError(std::string(name) + ": unknown dtype code " + std::to_string(dtype_code) +
                    " (0=float32, 1=float16, 2=bfloat16, 3=float64, 4=int16)");
  }
  TensorDesc desc{name, data, std::move(shape), std::move(strides), static_cast<DType>(dtype_code), device};
  if (desc.shape.size() != desc.strides.size()) {
    throw std::invalid_argument(std::string(name) + ": shape " + format_dims(desc.shape) + " and strides " +
                                format_dims(desc.strides) + " differ in length");
  }
  int64_t numel = 1;
  int64_t max_offset = 0;
  int64_t span = 0;
  for (int i = 0; i < desc.ndim(); ++i) {
    const int64_t size = desc.shape[i];
    const int64_t stride = desc.strides[i];
    if (size < 0) {
      throw std::invalid_argument(std::string(name) + ": negative size in shape " + format_dims(desc.shape));
    }
    if (stride < 0) {
      throw std::invalid_argument(desc.describe() + ": negative strides are not supported");
    }
    // Sizes and offsets are int64 throughout; a shape that overflows them is corrupt, not large.
    if (size > 0 && (__builtin_mul_overflow(numel, size, &numel) ||
                     __builtin_mul_overflow(size - 1, stride, &span) ||
                     __builtin_add_overflow(max_offset, span, &max_offset))) {
      throw std::invalid_argument(desc.describe() + ": size or extent overflows int64");
    }
  }
  if (desc.device < 0) {
    throw std::invalid_argument(std::string(name) + ": not a CUDA tensor (device index " +
                                std::to_string(desc.device) + ")");
  }
  if (desc.data == 0 && desc.numel() > 0) {
    throw std::invalid_argument(std::string(name) + ": null data pointer");
  }
  if (desc.data % static_cast<uint64_t>(element_size(desc.dtype)) != 0) {
    char address[24];
    std::snprintf(address, sizeof(address), "0x%llx", static_cast<unsigned long long>(desc.data));
    throw std::invalid_argument(std::string(name) + ": data pointer " + address +
                                " is not aligned to its element size (" +
                                std::to_string(element_size(desc.dtype)) + " bytes for " +
                                dtype_name(desc.dtype) + ")");
  }
  return desc;
}

inline const char* file_basename(const char* path) {
  const char* slash = std::strrchr(path, '/');
  return slash ? slash + 1 : path;
}

[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* op, const char* call, const char* file,
                                          int line) {
  throw std::runtime_error(std::string("spectral_ops._C.") + op + ": " + call + " failed: " +
                           cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ") at " +
                           file_basename(file) + ":" + std::to_string(line));
}

// SPECTRAL_OPS_CUDA_CHECK("decay_epilogue_", cudaGetLastError());
#define SPECTRAL_OPS_CUDA_CHECK(op, call)                                         \
  do {                                                                            \
    const cudaError_t spectral_ops_err_ = (call);                                 \
    if (spectral_ops_err_ != cudaSuccess) {                                       \
      ::spectral_ops::throw_cuda_error(spectral_ops_err_, op, #call, __FILE__, __LINE__); \
    }                                                                             \
  } while (0)

// Why cudaGetDeviceCount found no usable device; clears the error so that it does not resurface
// from a later, unrelated runtime call.
inline std::string no_device_message(cudaError_t err) {
  std::string detail = err == cudaSuccess ? "0 devices" : cudaGetErrorString(err);
  if (err == cudaErrorInsufficientDriver) {
    // Also what a machine without any NVIDIA driver reports, since the runtime is linked statically.
    detail += "; the module needs an NVIDIA driver for CUDA " + std::to_string(CUDART_VERSION / 1000) + "." +
              std::to_string(CUDART_VERSION % 1000 / 10) + " or newer";
  }
  (void)cudaGetLastError();
  return "no CUDA device available (cudaGetDeviceCount: " + detail + ")";
}

// Fails with a readable RuntimeError when no device is usable, else checks `device` exists.
inline void require_device(const char* op, int device) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    throw std::runtime_error("spectral_ops._C: " + no_device_message(err));
  }
  if (device >= count) {
    throw std::invalid_argument(std::string("spectral_ops._C.") + op + ": tensors are on cuda:" +
                                std::to_string(device) + " but only " + std::to_string(count) +
                                " CUDA device(s) are visible");
  }
}

// Makes `device` current for the launch (the caller's stream belongs to it) and restores the
// previous device afterwards, as torch.cuda.device does.
class DeviceGuard {
 public:
  DeviceGuard(const char* op, int device) {
    SPECTRAL_OPS_CUDA_CHECK(op, cudaGetDevice(&previous_));
    if (previous_ != device) SPECTRAL_OPS_CUDA_CHECK(op, cudaSetDevice(device));
  }
  ~DeviceGuard() {
    int current = previous_;
    if (cudaGetDevice(&current) == cudaSuccess && current != previous_) (void)cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace spectral_ops
