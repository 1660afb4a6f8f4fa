// Dense batched product out = alpha * (A B) + beta * Y on a rectangular tile grid, and the validation
// shared with syrk.cu and poly_step.cu. The Y term makes the Polar Express update X <- a X + B X one
// launch (Y = X, beta = a): the accumulator starts from the product and a X joins it in fp32, in the
// epilogue, before the single rounding to out's dtype.
#include <limits>
#include <optional>

#include "matmul.h"
#include "ops.h"
#include "tiled_matmul.cuh"

namespace spectral_ops {
namespace {

constexpr const char* kMatmulDtypes = "use float32, float16 or bfloat16 (float64 products are left to torch/cuBLAS)";

int vector_elements(MathMode mode) { return mode == MathMode::kHalf || mode == MathMode::kBf16 ? 8 : 4; }

// `along` is the stride in the vectors' direction, `across` the other one (see MatmulParams).
bool vectorizable(const MatrixView& v, int batch_ndim, int64_t along, int64_t across, int vec) {
  const uint64_t bytes = static_cast<uint64_t>(vec * element_size(v.dtype));
  if (along != 1 || reinterpret_cast<uintptr_t>(v.data) % bytes != 0 || across % vec != 0) return false;
  for (int k = 0; k < batch_ndim; ++k) {
    if (v.batch_strides[k] % vec != 0) return false;
  }
  return true;
}

// The dtype a tensor-core mode's slabs hold; none for FMA (its loads convert every vector).
std::optional<DType> slab_dtype(MathMode mode) {
  switch (mode) {
    case MathMode::kHalf: return DType::kFloat16;
    case MathMode::kBf16: return DType::kBFloat16;
    case MathMode::kTf32x3:
    case MathMode::kTf32: return DType::kFloat32;
    case MathMode::kFma: break;
  }
  return std::nullopt;
}

// The interior path steps through an operand with int32 byte offsets of up to a tile's rows of either
// stride (see AsyncLoader::start_interior).
bool copyable(const MatrixView& v, bool vectorized, MathMode mode) {
  const int64_t limit = std::numeric_limits<int32_t>::max() / (tiled::kTile * element_size(v.dtype));
  return vectorized && slab_dtype(mode) == v.dtype && v.row_stride < limit && v.col_stride < limit;
}

}  // namespace

MatmulPlan prepare_matmul(const TensorDesc& a, const TensorDesc& b, const TensorDesc& out, const TensorDesc* y,
                          const ScaleArg& alpha, const ScaleArg& beta, int precision, bool triangular) {
  for (const TensorDesc* t : {&a, &b, &out, y}) {
    if (t == nullptr) continue;
    check_matrix_dims(*t);
    check_dtype(*t, {DType::kFloat32, DType::kFloat16, DType::kBFloat16}, kMatmulDtypes);
  }
  for (const TensorDesc* t : {&a, &b, y}) {
    if (t != nullptr) check_same_batch(out, *t);
  }
  const int64_t m = rows_of(a), k = cols_of(a), n = cols_of(b);
  const std::string product = std::string(a.name) + " @ " + b.name;
  if (rows_of(b) != k) {
    throw std::invalid_argument("inner dims differ in " + product + ": shapes " + format_dims(a.shape) + " and " +
                                format_dims(b.shape));
  }
  for (const TensorDesc* t : {&out, y}) {
    if (t != nullptr && (rows_of(*t) != m || cols_of(*t) != n)) {
      throw std::invalid_argument(std::string(t->name) + " has shape " + format_dims(t->shape) + " but " + product +
                                  " is " + std::to_string(m) + " x " + std::to_string(n));
    }
  }
  if (k > std::numeric_limits<int32_t>::max()) {
    throw std::invalid_argument("the reduction dim of " + product + " is " + std::to_string(k) +
                                "; the tiled kernel counts its slabs in int32, so it must stay below 2^31");
  }
  if (triangular && m != n) {
    throw std::invalid_argument("a symmetric product must be square, but " + product + " is " + std::to_string(m) +
                                " x " + std::to_string(n));
  }
  for (const TensorDesc* t : {&a, &b, y}) {
    if (t != nullptr) check_same_device(out, *t);
  }
  check_no_overlap(out);
  check_disjoint(out, a);
  check_disjoint(out, b);
  if (y != nullptr && !same_view(*y, out)) check_disjoint(out, *y);
  if (precision < static_cast<int>(Precision::kIeee) || precision > static_cast<int>(Precision::kTf32)) {
    throw std::invalid_argument("unknown precision code " + std::to_string(precision) + " (0=ieee, 1=tf32x3, 2=tf32)");
  }

  const std::vector<int> positions = batch_positions(out);
  MatmulPlan plan{};
  MatmulParams& p = plan.params;
  p.batch = make_batch(out, positions);
  p.alpha = make_scale("alpha", alpha, p.batch.count, out);
  p.beta = make_scale("beta", beta, p.batch.count, out);
  const int64_t tiles_m = (m + tiled::kTile - 1) / tiled::kTile, tiles_n = (n + tiled::kTile - 1) / tiled::kTile;
  const int64_t tiles = triangular ? tiles_m * (tiles_m + 1) / 2 : tiles_m * tiles_n;
  if (tiles > std::numeric_limits<int32_t>::max()) {
    throw std::invalid_argument(out.describe() + ": too many 128 x 128 tiles for one launch");
  }
  if (p.batch.count > tiled::kMaxGridYZ * tiled::kMaxGridYZ) {
    throw std::invalid_argument(out.describe() + ": too many matrices in the batch for one launch");
  }
  p.a = make_view(a, positions);
  p.b = make_view(b, positions);
  p.out = make_view(out, positions);
  p.y = y != nullptr ? make_view(*y, positions) : MatrixView{nullptr, out.dtype, 0, 0, {}};
  p.m = m;
  p.n = n;
  p.k = k;
  // Column-major outputs (the wide view of a tall weight) are written as the transposed problem,
  // out^T = B^T A^T, whose rows are contiguous. A symmetric output is the same either way.
  if (!triangular && p.out.col_stride != 1 && p.out.row_stride == 1) {
    std::swap(p.a, p.b);
    p.a = transposed(p.a);
    p.b = transposed(p.b);
    p.out = transposed(p.out);
    p.y = transposed(p.y);
    std::swap(p.m, p.n);
  }
  if (a.dtype == b.dtype && a.dtype == DType::kFloat16) {
    plan.mode = MathMode::kHalf;
  } else if (a.dtype == b.dtype && a.dtype == DType::kBFloat16) {
    plan.mode = MathMode::kBf16;
  } else {
    switch (static_cast<Precision>(precision)) {
      case Precision::kTf32x3: plan.mode = MathMode::kTf32x3; break;
      case Precision::kTf32: plan.mode = MathMode::kTf32; break;
      case Precision::kIeee: plan.mode = MathMode::kFma; break;
    }
  }
  // A's slabs run along its columns (the reduction dim k), B's along its rows.
  const int vec = vector_elements(plan.mode);
  p.a_down = p.a.col_stride == 1 && p.a.row_stride != 1;
  p.b_down = p.b.row_stride == 1 && p.b.col_stride != 1;
  p.a_vectorized = p.a_down ? vectorizable(p.a, p.batch.ndim, p.a.col_stride, p.a.row_stride, vec)
                            : vectorizable(p.a, p.batch.ndim, p.a.row_stride, p.a.col_stride, vec);
  p.b_vectorized = p.b_down ? vectorizable(p.b, p.batch.ndim, p.b.row_stride, p.b.col_stride, vec)
                            : vectorizable(p.b, p.batch.ndim, p.b.col_stride, p.b.row_stride, vec);
  p.a_copyable = copyable(p.a, p.a_vectorized, plan.mode);
  p.b_copyable = copyable(p.b, p.b_vectorized, plan.mode);
  plan.triangular = triangular;
  plan.device = out.device;
  plan.empty = p.batch.count == 0 || m == 0 || n == 0;
  return plan;
}

void run_matmul(const char* op, const MatmulPlan& plan, cudaStream_t stream) {
  if (plan.empty) return;
  if (plan.mode != MathMode::kFma) {
    int major = 0;
    SPECTRAL_OPS_CUDA_CHECK(op, cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, plan.device));
    if (major < 8) {
      throw std::runtime_error(std::string("spectral_ops._C.") + op + ": float16/bfloat16 operands and " +
                               "precision=tf32x3 use sm_80 tensor-core instructions; " +
                               format_device(plan.device) + " is older (use float32 with precision=ieee)");
    }
  }
  if (plan.triangular) {
    launch_triangular(op, plan, stream);
  } else {
    launch_rectangular(op, plan, stream);
  }
  SPECTRAL_OPS_CUDA_CHECK(op, cudaGetLastError());
}

void launch_rectangular(const char* op, const MatmulPlan& plan, cudaStream_t stream) {
  tiled::launch_mode<false>(op, plan, stream);
}

void gemm(const TensorDesc& a, const TensorDesc& b, const TensorDesc& out, const TensorDesc* y, const ScaleArg& alpha,
          const ScaleArg& beta, int precision, cudaStream_t stream) {
  const MatmulPlan plan = prepare_matmul(a, b, out, y, alpha, beta, precision, false);
  require_device("gemm", plan.device);
  if (plan.empty) return;
  DeviceGuard guard("gemm", plan.device);
  run_matmul("gemm", plan, stream);
}

}  // namespace spectral_ops
