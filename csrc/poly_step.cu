// The polynomial steps of Polar Express and of the matrix sign, as symmetric products with epilogues:
//   poly_step:  B = b A + c A A                        (one triangular launch, Y = A)
//   sign_step:  Z' = a Z + (b C + c C C) Z, C = Z Z     (three: C, then B, then B Z + a Z)
// B Z is symmetric because B is a polynomial in Z, so every launch computes half the tiles.
#include "matmul.h"
#include "ops.h"

namespace spectral_ops {
namespace {

// Every plan is validated before the device is touched; then all of them run.
void run_plans(const char* op, std::initializer_list<const MatmulPlan*> plans, cudaStream_t stream) {
  const int device = (*plans.begin())->device;
  require_device(op, device);
  if ((*plans.begin())->empty) return;
  DeviceGuard guard(op, device);
  for (const MatmulPlan* plan : plans) run_matmul(op, *plan, stream);
}

void check_square(const TensorDesc& t) {
  check_matrix_dims(t);
  if (rows_of(t) != cols_of(t)) {
    throw std::invalid_argument(t.describe() + ": must be square (..., r, r)");
  }
}

}  // namespace

void poly_step(const TensorDesc& a, const TensorDesc& out, double b, double c, int precision, cudaStream_t stream) {
  check_square(a);
  const MatmulPlan plan = prepare_matmul(a, a, out, &a, ScaleArg{c, std::nullopt}, ScaleArg{b, std::nullopt},
                                         precision, true);
  run_plans("poly_step", {&plan}, stream);
}

void sign_step(const TensorDesc& z, const TensorDesc& out, const TensorDesc& square, const TensorDesc& poly, double a,
               double b, double c, int precision, cudaStream_t stream) {
  check_square(z);
  // Each plan below checks its own launch; poly is also written before z's last read.
  check_disjoint(poly, z);
  const MatmulPlan gram = prepare_matmul(z, z, square, nullptr, ScaleArg{1.0, std::nullopt},
                                         ScaleArg{0.0, std::nullopt}, precision, true);
  const MatmulPlan polynomial = prepare_matmul(square, square, poly, &square, ScaleArg{c, std::nullopt},
                                               ScaleArg{b, std::nullopt}, precision, true);
  const MatmulPlan update = prepare_matmul(poly, z, out, &z, ScaleArg{1.0, std::nullopt}, ScaleArg{a, std::nullopt},
                                           precision, true);
  run_plans("sign_step", {&gram, &polynomial, &update}, stream);
}

}  // namespace spectral_ops
