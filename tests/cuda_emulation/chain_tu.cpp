// small_chain.cu's dynamic shared memory lives in its unnamed namespace, so it is defined here, in
// the same translation unit.
namespace spectral_ops {
namespace {
alignas(16) float shared[1 << 16];
}  // namespace
}  // namespace spectral_ops
#include "small_chain.cu"
