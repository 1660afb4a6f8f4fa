// The sm_80 warp-level instructions the tiled product is built from, as inline PTX (PTX ISA, "Warp
// Level Matrix Multiply-Accumulate Instructions" and "cp.async"):
//   * ldmatrix.x4: four 8 x 8 b16 matrices from shared memory; lane l supplies the address of row
//     l % 8 of matrix l / 8 (16 bytes each), and every lane receives, of each matrix, the 4 bytes at
//     4 (l % 4) of row l / 4 -- or, with .trans, the two b16 at column l / 4 of rows 2 (l % 4) and
//     2 (l % 4) + 1;
//   * mma.sync m16n8k16 (f16, bf16) and m16n8k8 (tf32) with fp32 accumulators, in place: d = a b + d,
//     fragments as the PTX ISA lays them out (see MmaAccumulator in tiled_matmul.cuh);
//   * cp.async.cg 16 bytes global -> shared, zero-filling what is past `src_bytes`, with commit_group
//     and wait_group.
// The CPU emulation (tests/cuda_emulation) swaps in definitions with the same documented semantics.
#pragma once

#include <cstdint>

#ifdef SPECTRAL_OPS_EMULATION
#include "ptx_emulation.h"
#else

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

namespace spectral_ops {
namespace ptx {

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

template <bool kTrans>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  if constexpr (kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row)));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row)));
  }
}

// d += a b for a 16 x 16 A fragment (four b32 of two halves) and a 16 x 8 B fragment (two b32).
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>, "f16 or bf16 operands");
  if constexpr (std::is_same_v<T, __half>) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

// d += a b for a 16 x 8 tf32 A fragment (four b32) and an 8 x 8 B fragment (two b32). The tensor
// cores ignore the low 13 mantissa bits of each operand: round them first (to_tf32).
__device__ __forceinline__ void mma_m16n8k8_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// threadIdx.x, read where it is called: the compiler cannot hoist what is computed from it out of a loop.
__device__ __forceinline__ int thread_index() {
  int x;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(x));
  return x;
}

// cvt.rna.tf32.f32: keep 10 mantissa bits, round to nearest, ties away from zero.
__device__ __forceinline__ float to_tf32(float x) {
  uint32_t bits;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(bits) : "f"(x));
  return __uint_as_float(bits);
}

// 16 bytes global -> shared, of which the first `src_bytes` (0 to 16) are read and the rest zeroed.
// Both addresses are 16-byte aligned; `global` must be a valid address even when nothing is read.
__device__ __forceinline__ void cp_async_16(void* shared, const void* global, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(shared)), "l"(global),
               "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Returns once at most kPending of this thread's committed groups are still in flight. Other threads'
// copies are visible only after a barrier that follows their own wait.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

}  // namespace ptx
}  // namespace spectral_ops

#endif  // SPECTRAL_OPS_EMULATION
