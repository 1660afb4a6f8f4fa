// Device-side helpers shared by the kernel families: dtype conversion, batch offsets, scales.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <utility>

#include "layout.h"

namespace spectral_ops {

// A global-memory element or vector of type T at p. Every global access of the matrix kernels goes
// through here (cp.async through ptx::cp_async_16), so that the CPU emulation can check each against
// the tensors of the launch (tests/cuda_emulation); on a GPU it is a plain access.
template <typename T>
__device__ __forceinline__ T read_global(const void* p) {
#ifdef SPECTRAL_OPS_EMULATION
  emulation::check_global(p, sizeof(T));
#endif
  return *static_cast<const T*>(p);
}

template <typename T>
__device__ __forceinline__ void write_global(void* p, T value) {
#ifdef SPECTRAL_OPS_EMULATION
  emulation::check_global(p, sizeof(T));
#endif
  *static_cast<T*>(p) = value;
}

// Operands of the matrix kernels are float32, float16 or bfloat16, chosen at run time: the branch is
// uniform across a launch, and it keeps one kernel per math mode instead of one per dtype combination.
__device__ __forceinline__ float load_as_float(const void* base, DType dtype, int64_t offset) {
  switch (dtype) {
    case DType::kFloat16: return __half2float(read_global<__half>(static_cast<const __half*>(base) + offset));
    case DType::kBFloat16:
      return __bfloat162float(read_global<__nv_bfloat16>(static_cast<const __nv_bfloat16*>(base) + offset));
    default: return read_global<float>(static_cast<const float*>(base) + offset);
  }
}

// Round to nearest even: the one rounding an fp32 result gets on its way to a 16-bit tensor.
__device__ __forceinline__ void store_from_float(void* base, DType dtype, int64_t offset, float value) {
  switch (dtype) {
    case DType::kFloat16: write_global(static_cast<__half*>(base) + offset, __float2half_rn(value)); break;
    case DType::kBFloat16:
      write_global(static_cast<__nv_bfloat16*>(base) + offset, __float2bfloat16_rn(value));
      break;
    default: write_global(static_cast<float*>(base) + offset, value); break;
  }
}

// Element offset of matrix `b` (row-major over the batch dims). Indexed by unrolled constants only, so
// the strides stay in the kernel's parameter bank.
__device__ __forceinline__ int64_t batch_offset(const BatchShape& batch, const int64_t (&strides)[kMaxBatchDims],
                                                int64_t b) {
  int64_t offset = 0;
#pragma unroll
  for (int k = kMaxBatchDims - 1; k >= 0; --k) {
    if (k < batch.ndim) {
      offset += (b % batch.sizes[k]) * strides[k];
      b /= batch.sizes[k];
    }
  }
  return offset;
}

// Byte address of matrix `b` of a view.
__device__ __forceinline__ char* matrix_base(const MatrixView& view, const BatchShape& batch, int64_t b) {
  return static_cast<char*>(view.data) + batch_offset(batch, view.batch_strides, b) * element_size(view.dtype);
}

__device__ __forceinline__ float scale_of(const DeviceScale& scale, int64_t matrix) {
  return scale.per_matrix ? scale.value * scale.per_matrix[matrix] : scale.value;
}

// Every kernel launch goes through here: one <<<>>> site, which the CPU emulation of the kernels
// (tests/cuda_emulation) replaces.
#ifndef SPECTRAL_OPS_EMULATION
template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream,
                   Args&&... args) {
  kernel<<<grid, block, shared_bytes, stream>>>(std::forward<Args>(args)...);
}
#endif

}  // namespace spectral_ops
