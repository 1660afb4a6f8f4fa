// The in-place decay epilogue W <- keep * W + step * D; the contract is in ops.h.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "common.h"
#include "device.cuh"
#include "ops.h"

namespace spectral_ops {
namespace {

constexpr const char* kOp = "decay_epilogue_";
constexpr int kThreads = 256;
// Far more resident blocks than any GPU has; bigger tensors are walked grid-stride.
constexpr int64_t kMaxBlocks = int64_t{1} << 16;

// W's dims, innermost first. Kernels index it only through unrolled constants, so it stays in the
// parameter bank instead of being copied to local memory.
struct StridedLayout {
  int ndim;
  int64_t sizes[kMaxDims];
  int64_t strides[kMaxDims];
};

// fp64 weights keep fp64 math: rounding them through fp32 would destroy what fp64 is for.
template <typename W>
using Math = std::conditional_t<std::is_same_v<W, double>, double, float>;

// The scalars of one call; with kPerMatrix each is also multiplied by its matrix's entry of a float32
// device vector (matrix = row-major element index / matrix_numel).
template <typename W>
struct Scales {
  Math<W> keep, step;
  const float* keep_per_matrix;
  const float* step_per_matrix;
  int64_t matrix_numel;

  __device__ __forceinline__ Math<W> keep_of(int64_t matrix) const {
    return keep_per_matrix ? keep * static_cast<Math<W>>(keep_per_matrix[matrix]) : keep;
  }
  __device__ __forceinline__ Math<W> step_of(int64_t matrix) const {
    return step_per_matrix ? step * static_cast<Math<W>>(step_per_matrix[matrix]) : step;
  }
};

template <typename T, int N>
struct alignas(sizeof(T) * N < 16 ? sizeof(T) * N : 16) Pack {
  T v[N];
};

// 16-byte accesses to W; D (possibly fp32 under an fp16 W) follows W's element count.
template <typename W>
constexpr int kVec = 16 / static_cast<int>(sizeof(W));

__device__ __forceinline__ float to_math(float v) { return v; }
__device__ __forceinline__ double to_math(double v) { return v; }
__device__ __forceinline__ float to_math(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_math(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename W>
__device__ __forceinline__ W round_nearest(Math<W> v);
template <>
__device__ __forceinline__ float round_nearest<float>(float v) { return v; }
template <>
__device__ __forceinline__ double round_nearest<double>(double v) { return v; }
template <>
__device__ __forceinline__ __half round_nearest<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 round_nearest<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Stochastic rounding: round away from zero with probability (|v| - |toward-zero neighbour|) / gap,
// so the stored value is unbiased. `bits` is the element's 16 random bits (unsigned); the rule is the
// torch provider's round_stochastic, bit for bit.
template <typename W>
__device__ __forceinline__ W round_stochastic(float v, uint32_t bits);

template <>
__device__ __forceinline__ __nv_bfloat16 round_stochastic<__nv_bfloat16>(float v, uint32_t bits) {
  uint32_t u = __float_as_uint(v);
  // Noise in the low bits of a NaN could carry it into an infinity.
  if ((u & 0x7f800000u) == 0x7f800000u) return __float2bfloat16_rn(v);
  // bfloat16 is float32 without the low 16 bits: add 16 noise bits there and let the carry decide.
  u += bits;
  return __ushort_as_bfloat16(static_cast<unsigned short>(u >> 16));
}

template <>
__device__ __forceinline__ __half round_stochastic<__half>(float v, uint32_t bits) {
  // Beyond the largest half (and for Inf/NaN) round-to-nearest decides whether to overflow.
  if (!(fabsf(v) <= 65504.0f)) return __float2half_rn(v);
  const __half toward_zero = __float2half_rz(v);
  const float low = __half2float(toward_zero);
  // Exact: v and low share sign and exponent range (Sterbenz), or low is 0.
  const float residual = fabsf(v - low);
  const __half away = __ushort_as_half(static_cast<unsigned short>(__half_as_ushort(toward_zero) + 1));
  const float gap = fabsf(__half2float(away) - low);
  const float uniform = static_cast<float>(bits) * 0x1p-16f;
  return uniform * gap < residual ? away : toward_zero;
}

template <typename W, typename D, bool kStochastic>
__device__ __forceinline__ W decay_element(W w, D d, Math<W> keep, Math<W> step, const int16_t* noise, int64_t i) {
  const Math<W> v = fma(step, static_cast<Math<W>>(to_math(d)), keep * to_math(w));
  if constexpr (kStochastic) {
    return round_stochastic<W>(v, static_cast<uint16_t>(noise[i]));
  } else {
    return round_nearest<W>(v);
  }
}

template <typename W, typename D, bool kStochastic, bool kPerMatrix>
__global__ void __launch_bounds__(kThreads)
    decay_contiguous_kernel(W* w, const D* d, int64_t n, Scales<W> scales, const int16_t* noise) {
  constexpr int vec = kVec<W>;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t n_packs = n / vec;
  for (int64_t p = first; p < n_packs; p += stride) {
    Pack<W, vec> wp = reinterpret_cast<const Pack<W, vec>*>(w)[p];
    const Pack<D, vec> dp = reinterpret_cast<const Pack<D, vec>*>(d)[p];
    // One division per pack; a pack crosses into the next matrices only at their first elements.
    int64_t matrix = kPerMatrix ? p * vec / scales.matrix_numel : 0;
    int64_t next = (matrix + 1) * scales.matrix_numel;
#pragma unroll
    for (int j = 0; j < vec; ++j) {
      if constexpr (kPerMatrix) {
        for (; p * vec + j >= next; next += scales.matrix_numel) ++matrix;
      }
      wp.v[j] = decay_element<W, D, kStochastic>(wp.v[j], dp.v[j], scales.keep_of(matrix), scales.step_of(matrix),
                                                 noise, p * vec + j);
    }
    reinterpret_cast<Pack<W, vec>*>(w)[p] = wp;
  }
  // Fewer than `vec` elements are left after the last whole pack.
  const int64_t i = n_packs * vec + first;
  const int64_t matrix = kPerMatrix ? i / scales.matrix_numel : 0;
  if (i < n) {
    w[i] = decay_element<W, D, kStochastic>(w[i], d[i], scales.keep_of(matrix), scales.step_of(matrix), noise, i);
  }
}

template <typename W, typename D, bool kStochastic, bool kPerMatrix>
__global__ void __launch_bounds__(kThreads) decay_strided_kernel(W* w, const D* d, int64_t n, StridedLayout layout,
                                                                 Scales<W> scales, const int16_t* noise) {
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = first; i < n; i += stride) {
    int64_t rest = i;
    int64_t w_offset = 0;
#pragma unroll
    for (int k = 0; k < kMaxDims; ++k) {
      if (k < layout.ndim) {
        w_offset += (rest % layout.sizes[k]) * layout.strides[k];
        rest /= layout.sizes[k];
      }
    }
    const int64_t matrix = kPerMatrix ? i / scales.matrix_numel : 0;
    w[w_offset] = decay_element<W, D, kStochastic>(w[w_offset], d[i], scales.keep_of(matrix), scales.step_of(matrix),
                                                   noise, i);
  }
}

int blocks_for(int64_t items) {
  return static_cast<int>(std::clamp<int64_t>((items + kThreads - 1) / kThreads, 1, kMaxBlocks));
}

// One validated call; the launch helpers below only pick template arguments.
struct Call {
  const TensorDesc& w;
  const TensorDesc& d;
  std::vector<Dim> dims;
  double keep, step;
  const float* keep_per_matrix;
  const float* step_per_matrix;
  int64_t matrix_numel;
  const int16_t* noise;  // null: round to nearest
  cudaStream_t stream;
};

template <typename W, typename D, bool kStochastic, bool kPerMatrix>
void launch(const Call& call) {
  const int64_t n = call.w.numel();
  const Scales<W> scales{static_cast<Math<W>>(call.keep), static_cast<Math<W>>(call.step), call.keep_per_matrix,
                         call.step_per_matrix, call.matrix_numel};
  const std::vector<Dim>& dims = call.dims;
  const bool contiguous = dims.empty() || (dims.size() == 1 && dims[0].stride == 1);
  const bool aligned =
      call.w.data % alignof(Pack<W, kVec<W>>) == 0 && call.d.data % alignof(Pack<D, kVec<W>>) == 0;
  if (contiguous && aligned) {
    launch_kernel(decay_contiguous_kernel<W, D, kStochastic, kPerMatrix>, blocks_for(n / kVec<W>), kThreads, 0,
                  call.stream, call.w.ptr<W>(), call.d.ptr<const D>(), n, scales, call.noise);
  } else {
    StridedLayout layout{};
    layout.ndim = static_cast<int>(dims.size());
    for (int k = 0; k < layout.ndim; ++k) {
      layout.sizes[k] = dims[dims.size() - 1 - k].size;
      layout.strides[k] = dims[dims.size() - 1 - k].stride;
    }
    launch_kernel(decay_strided_kernel<W, D, kStochastic, kPerMatrix>, blocks_for(n), kThreads, 0, call.stream,
                  call.w.ptr<W>(), call.d.ptr<const D>(), n, layout, scales, call.noise);
  }
}

template <typename W, typename D, bool kStochastic>
void launch_scales(const Call& call) {
  if (call.keep_per_matrix != nullptr || call.step_per_matrix != nullptr) {
    launch<W, D, kStochastic, true>(call);
  } else {
    launch<W, D, kStochastic, false>(call);
  }
}

template <typename W, typename D>
void launch_rounding(const Call& call) {
  if constexpr (std::is_same_v<W, __half> || std::is_same_v<W, __nv_bfloat16>) {
    if (call.noise != nullptr) return launch_scales<W, D, true>(call);
  }
  launch_scales<W, D, false>(call);
}

template <typename W>
void launch_typed(const Call& call) {
  if (call.d.dtype == DType::kFloat32) {
    launch_rounding<W, float>(call);
  } else {
    launch_rounding<W, W>(call);
  }
}

}  // namespace

void decay_epilogue_(const TensorDesc& w, const TensorDesc& d, const ScaleArg& keep, const ScaleArg& step,
                     const TensorDesc* noise, cudaStream_t stream) {
  check_dtype(w, {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat64},
              "w is a float32, float16, bfloat16 or float64 weight");
  if (d.dtype != DType::kFloat32 && d.dtype != w.dtype) {
    throw TypeError(std::string("d: dtype ") + dtype_name(d.dtype) + " must be float32 or w's dtype (" +
                    dtype_name(w.dtype) + ")");
  }
  if (w.shape != d.shape) {
    throw std::invalid_argument("shape mismatch: w has shape " + format_dims(w.shape) + " but d has shape " +
                                format_dims(d.shape));
  }
  check_same_device(w, d);
  if (noise != nullptr) {
    check_dtype(*noise, {DType::kInt16}, "noise holds 16 random bits per element of w");
    if (noise->shape != w.shape) {
      throw std::invalid_argument("shape mismatch: w has shape " + format_dims(w.shape) + " but noise has shape " +
                                  format_dims(noise->shape));
    }
    check_same_device(w, *noise);
    if (noise->numel() > 0) check_contiguous(*noise);
  }
  const std::vector<Dim> dims = merged_dims(w);
  // An empty tensor has no elements to overlap or to order.
  if (w.numel() > 0) {
    check_no_overlap(w);
    check_contiguous(d);
    if (dims.size() > static_cast<size_t>(kMaxDims)) {
      throw std::invalid_argument(w.describe() + ": its layout has " + std::to_string(dims.size()) +
                                  " dims that cannot be merged; at most " + std::to_string(kMaxDims) +
                                  " are supported");
    }
  }
  int64_t matrix_numel = 1, matrices = 1;
  if (keep.per_matrix || step.per_matrix) {
    if (w.ndim() < 2) {
      throw std::invalid_argument(w.describe() + ": per-matrix scales need a (..., rows, cols) tensor");
    }
    matrix_numel = rows_of(w) * cols_of(w);
    for (int64_t size : batch_dims(w)) matrices *= size;
  }
  // The scalar parts stay double until launch: fp64 weights keep fp64 coefficients.
  const float* keep_per_matrix = per_matrix_pointer(keep, matrices, w);
  const float* step_per_matrix = per_matrix_pointer(step, matrices, w);

  require_device(kOp, w.device);
  if (w.numel() == 0) return;
  DeviceGuard guard(kOp, w.device);
  const Call call{w, d, dims, keep.value, step.value, keep_per_matrix, step_per_matrix, matrix_numel,
                  noise == nullptr ? nullptr : noise->ptr<const int16_t>(), stream};
  switch (w.dtype) {
    case DType::kFloat32: launch_typed<float>(call); break;
    case DType::kFloat16: launch_typed<__half>(call); break;
    case DType::kBFloat16: launch_typed<__nv_bfloat16>(call); break;
    case DType::kFloat64: launch_typed<double>(call); break;
    case DType::kInt16: break;  // refused above
  }
  SPECTRAL_OPS_CUDA_CHECK(kOp, cudaGetLastError());
}

}  // namespace spectral_ops
