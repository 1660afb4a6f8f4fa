// The tiled product out = alpha * (A B) + beta * Y behind gemm.cu, syrk.cu and poly_step.cu.
//
// Ops validate with prepare_matmul (no CUDA call) for every launch they will make, then check the
// device, then run_matmul each plan: a composite op (sign_step) never fails half-way for a bad argument.
#pragma once

#include "layout.h"

namespace spectral_ops {

// ABI codes (spectral_ops/_extension.py PRECISION_CODES): how float32 operands use the tensor cores.
// float16 and bfloat16 operands always run on them (exact products, fp32 accumulation).
enum class Precision : int {
  kIeee = 0,    // FMA on the CUDA cores: the fp32 result as torch computes it without TF32
  kTf32x3 = 1,  // each operand split into two TF32 parts, three MMAs: about fp32 accuracy on tensor cores
  kTf32 = 2,    // each operand rounded to TF32, one MMA: a 10-bit mantissa, the fastest fp32 mode
};

enum class MathMode : int {
  kFma,     // fp32 operands (either dtype converted on load), fp32 FMA
  kTf32x3,  // fp32 operands in shared memory, split hi + lo at fragment load
  kTf32,    // fp32 operands in shared memory, rounded to TF32 at fragment load
  kHalf,    // both operands float16
  kBf16,    // both operands bfloat16
};

struct MatmulParams {
  MatrixView a;  // m x k
  MatrixView b;  // k x n
  MatrixView y;  // m x n; data is null without a Y term
  MatrixView out;
  BatchShape batch;
  int64_t m, n, k;
  DeviceScale alpha, beta;
  // How each operand's slabs (depth rows along the reduction dim x 128 columns) are read: in vectors
  // down the columns when the reduction dim has unit stride, else along the rows; as 16-byte (8-byte for
  // 16-bit data into fp32 slabs) loads when the view is aligned for them, else element by element.
  bool a_down, b_down;
  bool a_vectorized, b_vectorized;
  // Whether cp.async copies every whole vector of the operand (tensor-core modes: vectorized and of the
  // slab's dtype) and 128 rows of either of its strides span under 2^31 bytes: its whole slabs in
  // tiles inside the matrix then take the interior path (int32 steps, no edge checks).
  bool a_copyable, b_copyable;
};

struct MatmulPlan {
  MatmulParams params;
  MathMode mode;
  bool triangular;  // out = A B is symmetric: compute lower-triangle tiles only and mirror them
  int device;
  bool empty;
};

// Validates everything (dtypes, shapes, batch, devices, aliasing, scales, precision) and picks the math
// mode and access patterns; throws ValueError/TypeError-mapped exceptions, makes no CUDA call.
// `y` may be null. With `triangular`, Y is read on the lower triangle only (it must be symmetric),
// which lets Y be `out` itself.
MatmulPlan prepare_matmul(const TensorDesc& a, const TensorDesc& b, const TensorDesc& out, const TensorDesc* y,
                          const ScaleArg& alpha, const ScaleArg& beta, int precision, bool triangular);

// Launches a prepared plan on the current device (the caller has run require_device and a DeviceGuard).
void run_matmul(const char* op, const MatmulPlan& plan, cudaStream_t stream);

// One per grid shape, each in its own translation unit (gemm.cu, syrk.cu).
void launch_rectangular(const char* op, const MatmulPlan& plan, cudaStream_t stream);
void launch_triangular(const char* op, const MatmulPlan& plan, cudaStream_t stream);

}  // namespace spectral_ops
