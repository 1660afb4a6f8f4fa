// Host entry points of the kernel families, one block per csrc/<family>.cu file.
// Each one validates every argument before its first CUDA runtime call (see common.h).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common.h"

namespace spectral_ops {

// decay_epilogue.cu: W <- alpha * W + beta * D, in place, elementwise over any batch shape.
//   w: float32, float16, bfloat16 or float64; any non-overlapping strides (views are fine).
//   d: contiguous, same shape, float32 or w's dtype.
// Math is fp32 (fp64 when w is float64). Stores round to nearest even, or, with stochastic_rounding
// and a float16/bfloat16 w, stochastically: element i (row-major) draws its bits from
// hash(seed, offset + i), so a call is deterministic for a given (seed, offset). Advance offset by
// w.numel() between calls to draw fresh bits under one seed. Wider dtypes do not round, so for them
// the flag has no effect.
void decay_epilogue_(const TensorDesc& w, const TensorDesc& d, double alpha, double beta, bool stochastic_rounding,
                     uint64_t seed, uint64_t offset, cudaStream_t stream);

}  // namespace spectral_ops
