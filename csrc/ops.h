// Host entry points of the kernel families, one block per csrc/<family>.cu file.
// Each one validates every argument before its first CUDA runtime call (see common.h), launches on
// `stream` (the caller's current stream, passed as an integer from Python) and turns launch errors into
// RuntimeError. Scales (ScaleArg, layout.h) are a number times an optional float32 device vector with
// one value per matrix of the batch, so no argument ever needs a host sync.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <vector>

#include "common.h"
#include "layout.h"

namespace spectral_ops {

// decay_epilogue.cu: W <- keep * W + step * D, in place, elementwise over any batch shape.
//   w: float32, float16, bfloat16 or float64; any non-overlapping strides (views are fine).
//   d: contiguous, same shape, float32 or w's dtype.
// keep and step may carry a per-matrix vector (w must then have >= 2 dims; matrix = the leading
// index, row-major). Math is fp32 (fp64 when w is float64). Stores round to nearest even, or, given
// noise (int16, contiguous, w's shape) and a float16/bfloat16 w, stochastically: element i (row-major)
// decides with the 16 bits noise[i], read as unsigned, by the rule of the torch provider's
// round_stochastic (spectral_ops/backends/torch_backend.py), so every provider rounds alike for the
// same bits. The caller draws them (torch's generator: seeded, and capturable in a CUDA graph). Wider
// dtypes do not round, so for them noise has no effect.
void decay_epilogue_(const TensorDesc& w, const TensorDesc& d, const ScaleArg& keep, const ScaleArg& step,
                     const TensorDesc* noise, cudaStream_t stream);

// gemm.cu: out = alpha * (a @ b) + beta * y, batched over equal leading dims, fp32 accumulation.
//   a (..., m, k), b (..., k, n), out and y (..., m, n): float32, float16 or bfloat16, any strides;
//   y is optional and may be out itself; out must not overlap a or b.
//   precision (Precision in matmul.h) applies to float32 operands: 0 = fp32 FMA, 1 = 3xTF32 tensor
//   cores. Two float16 (or two bfloat16) operands always use the tensor cores.
void gemm(const TensorDesc& a, const TensorDesc& b, const TensorDesc& out, const TensorDesc* y, const ScaleArg& alpha,
          const ScaleArg& beta, int precision, cudaStream_t stream);

// syrk.cu: the same product when a @ b is symmetric (x @ x^T, A A for symmetric A, commuting symmetric
// factors): only lower-triangle tiles are computed, and stored mirrored. y is read on the lower
// triangle only, so it must be symmetric.
void syrk(const TensorDesc& a, const TensorDesc& b, const TensorDesc& out, const TensorDesc* y, const ScaleArg& alpha,
          const ScaleArg& beta, int precision, cudaStream_t stream);

// poly_step.cu: out = b A + c A A for symmetric a (..., r, r).
void poly_step(const TensorDesc& a, const TensorDesc& out, double b, double c, int precision, cudaStream_t stream);

// poly_step.cu: one step of the symmetric matrix-sign iteration, out = Z (a I + b Z^2 + c Z^4), e.g.
// (3, -16/5, 6/5). square and poly are (..., r, r) workspaces (C = Z Z and B = b C + c C C).
void sign_step(const TensorDesc& z, const TensorDesc& out, const TensorDesc& square, const TensorDesc& poly, double a,
               double b, double c, int precision, cudaStream_t stream);

// small_chain.cu: out = S_p(w) for wide w (..., r, n) with r <= kSmallChainMaxSide, one thread block per
// matrix, fp32 math. Even p runs Polar Express with `coefficients` ((a, b, c) per
// step) from w / (||w||_F / shrink); it needs x_ws (float32, w's shape, contiguous) and, for p >= 2,
// g_ws (float32, (..., r, r), contiguous). out may be w itself; otherwise nothing may overlap.
constexpr int kSmallChainMaxSide = 128;
constexpr int kSmallChainMaxSteps = 64;
void small_chain(const TensorDesc& w, const TensorDesc& out, const TensorDesc* x_ws, const TensorDesc* g_ws, int p,
                 const std::vector<std::array<double, 3>>& coefficients, double shrink, cudaStream_t stream);
// Dynamic shared memory one block of small_chain needs for this r and p.
size_t small_chain_shared_bytes(int64_t r, int p);

}  // namespace spectral_ops
