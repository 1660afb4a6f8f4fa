// Symmetric products on a lower-triangle tile grid: X X^T, A A for symmetric A, and products of
// commuting symmetric matrices (powers of one Gram). Only tiles (i, j) with i >= j are launched, each
// stored twice (the second time mirrored), so the ceiling is half the work of a dense product.
#include "matmul.h"
#include "ops.h"
#include "tiled_matmul.cuh"

namespace spectral_ops {

void launch_triangular(const char* op, const MatmulPlan& plan, cudaStream_t stream) {
  tiled::launch_mode<true>(op, plan, stream);
}

void syrk(const TensorDesc& a, const TensorDesc& b, const TensorDesc& out, const TensorDesc* y, const ScaleArg& alpha,
          const ScaleArg& beta, int precision, cudaStream_t stream) {
  const MatmulPlan plan = prepare_matmul(a, b, out, y, alpha, beta, precision, true);
  require_device("syrk", plan.device);
  if (plan.empty) return;
  DeviceGuard guard("syrk", plan.device);
  run_matmul("syrk", plan, stream);
}

}  // namespace spectral_ops
