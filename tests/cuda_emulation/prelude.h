// Force-included (g++ -include) before every source of the CPU emulation build; see build.py.
//
// The kernels in csrc/ compile as plain C++: the CUDA qualifiers become no-ops, each CUDA thread of a
// block is a fiber, __syncthreads() ends a phase in which every fiber of the block runs up to its next
// barrier (in a shuffled order, so a missing barrier changes results), and the CUDA runtime calls the
// host code makes are answered by runtime.cpp as if one device were present. Device pointers are host
// pointers (CPU tensors). The warp-level PTX of csrc/mma_ptx.cuh is emulated in include/ptx_emulation.h.
#pragma once

#define SPECTRAL_OPS_EMULATION 1

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <utility>

#undef __global__
#undef __device__
#undef __host__
#undef __shared__
#undef __launch_bounds__
#undef __forceinline__
#define __global__
#define __device__
#define __host__
#define __shared__
#define __launch_bounds__(...)
#define __forceinline__ inline

// float overloads, as device code gets them.
using std::fma;
using std::sqrt;

extern uint3 threadIdx;
extern uint3 blockIdx;
extern dim3 blockDim;
extern dim3 gridDim;

namespace emulation {
void syncthreads();
void run(dim3 grid, dim3 block, const std::function<void()>& kernel);
// Each lane of the calling thread's warp passes `bytes` at `mine`; returns the 32 lanes' values, in
// lane order, once all of them have (valid until the thread's next exchange). The thread waits by
// yielding its fiber, which here ends a phase for the whole block, as a barrier does: that is right
// only where every thread of the block runs the same sequence of barriers and warp exchanges (the
// tiled main loop does), and run() throws when the threads of a block stop at different ones.
const void* warp_exchange(const void* mine, size_t bytes);
// cp.async: queued per thread, grouped at each commit; a wait performs every group but the newest
// `pending`, in order. A thread that ends with a copy never waited for is an error.
void cp_async(void* dst, const void* src, size_t bytes, size_t src_bytes);
void cp_async_commit();
void cp_async_wait(size_t pending);
// Fails the launch unless [p, p + bytes) lies inside one of the spans allowed by
// spectral_ops_emulation_allow (runtime.cpp); no check while none is allowed.
void check_global(const void* p, size_t bytes);
}  // namespace emulation

inline void __syncthreads() { emulation::syncthreads(); }

[[noreturn]] inline void __trap() { std::abort(); }

inline unsigned int __float_as_uint(float x) {
  unsigned int u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

inline float __uint_as_float(unsigned int u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

namespace spectral_ops {
// csrc/device.cuh's launch helper, run on the fibers.
template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t, cudaStream_t, Args&&... args) {
  emulation::run(grid, block, [&] { kernel(args...); });
}
}  // namespace spectral_ops
