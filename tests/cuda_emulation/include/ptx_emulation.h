// csrc/mma_ptx.cuh's instructions for the CPU emulation, with the semantics the PTX ISA documents.
//
// ldmatrix and mma.sync are warp collectives whose lanes pass different operands: each lane deposits
// its own with emulation::warp_exchange (prelude.h) and computes its own result from all 32. cp.async
// copies are queued per thread and land at the cp.async.wait_group that covers them -- not at a
// barrier -- so that a read of shared memory before that wait sees stale data, as it may on a GPU.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace spectral_ops {
namespace ptx {

inline int lane() {
  return static_cast<int>((threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)) % 32);
}

inline int thread_index() { return static_cast<int>(threadIdx.x); }

// The 32 lanes' values of `mine`, in lane order, once every lane of the warp has passed its own.
template <typename T>
inline void exchange(const T& mine, T (&lanes)[32]) {
  static_assert(std::is_trivially_copyable_v<T>, "lanes exchange plain values");
  std::memcpy(lanes, emulation::warp_exchange(&mine, sizeof mine), sizeof lanes);
}

template <bool kTrans>
inline void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  const void* rows[32];
  exchange(row, rows);
  const int l = lane();
  for (int m = 0; m < 4; ++m) {
    // Matrix m's row j is the 16 bytes at the address lane 8 m + j passed.
    const void* const* matrix = rows + 8 * m;
    if constexpr (kTrans) {
      // Column l / 4 of rows 2 (l % 4) and 2 (l % 4) + 1.
      uint16_t lo, hi;
      std::memcpy(&lo, static_cast<const char*>(matrix[2 * (l % 4)]) + 2 * (l / 4), sizeof lo);
      std::memcpy(&hi, static_cast<const char*>(matrix[2 * (l % 4) + 1]) + 2 * (l / 4), sizeof hi);
      r[m] = lo | static_cast<uint32_t>(hi) << 16;
    } else {
      // Bytes 4 (l % 4) to 4 (l % 4) + 3 of row l / 4.
      std::memcpy(&r[m], static_cast<const char*>(matrix[l / 4]) + 4 * (l % 4), sizeof r[m]);
    }
  }
}

struct MmaOperands {
  uint32_t a[4];
  uint32_t b[2];
};

// What the tensor cores see of a tf32 operand: the low 13 bits are ignored.
inline float tf32_truncate(uint32_t bits) { return __uint_as_float(bits & 0xffffe000u); }

template <typename T>
inline float half_of(uint32_t reg, int high) {
  const unsigned short bits = static_cast<unsigned short>(high ? reg >> 16 : reg & 0xffffu);
  if constexpr (std::is_same_v<T, __half>) {
    return __half2float(__ushort_as_half(bits));
  } else {
    return __bfloat162float(__ushort_as_bfloat16(bits));
  }
}

// d(row, col) += sum over k of A(row, k) B(k, col) for this lane's four elements of D: rows
// lane / 4 and lane / 4 + 8, columns 2 (lane % 4) and 2 (lane % 4) + 1. `a_at(lanes, row, k)` and
// `b_at(lanes, k, col)` read the operands from the lanes' fragments. The products are exact (at most
// 11 significant bits per factor); the sums are rounded in k order, where the hardware's order is its
// own, a difference the tests' tolerances absorb.
template <int kK, typename AAt, typename BAt>
inline void mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], AAt a_at, BAt b_at) {
  MmaOperands lanes[32];
  exchange(MmaOperands{{a[0], a[1], a[2], a[3]}, {b[0], b[1]}}, lanes);
  const int l = lane();
  float rows[2][kK], cols[2][kK];  // the two rows of A and columns of B that this lane's D needs
  for (int h = 0; h < 2; ++h) {
    for (int k = 0; k < kK; ++k) {
      rows[h][k] = a_at(lanes, l / 4 + 8 * h, k);
      cols[h][k] = b_at(lanes, k, 2 * (l % 4) + h);
    }
  }
  for (int e = 0; e < 4; ++e) {
    float acc = d[e];
    for (int k = 0; k < kK; ++k) acc += rows[e / 2][k] * cols[e % 2][k];
    d[e] = acc;
  }
}

// PTX ISA, mma.m16n8k16 (.f16, .bf16): A(row, k) is half k % 2 of register row / 8 + 2 (k / 8) of
// lane 4 (row % 8) + (k % 8) / 2; B(k, col) half k % 2 of register k / 8 of lane 4 col + (k % 8) / 2.
template <typename T>
inline void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  mma<16>(
      d, a, b,
      [](const MmaOperands* lanes, int row, int k) {
        return half_of<T>(lanes[4 * (row % 8) + k % 8 / 2].a[row / 8 + 2 * (k / 8)], k % 2);
      },
      [](const MmaOperands* lanes, int k, int col) {
        return half_of<T>(lanes[4 * col + k % 8 / 2].b[k / 8], k % 2);
      });
}

// PTX ISA, mma.m16n8k8 (.tf32): A(row, k) is register row / 8 + 2 (k / 4) of lane 4 (row % 8) + k % 4;
// B(k, col) register k / 4 of lane 4 col + k % 4.
inline void mma_m16n8k8_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  mma<8>(
      d, a, b,
      [](const MmaOperands* lanes, int row, int k) {
        return tf32_truncate(lanes[4 * (row % 8) + k % 4].a[row / 8 + 2 * (k / 4)]);
      },
      [](const MmaOperands* lanes, int k, int col) { return tf32_truncate(lanes[4 * col + k % 4].b[k / 4]); });
}

// cvt.rna.tf32.f32: keep 10 mantissa bits, round to nearest, ties away from zero.
inline float to_tf32(float x) {
  uint32_t u = __float_as_uint(x);
  if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0x1000u) & 0xffffe000u;
  return __uint_as_float(u);
}

inline void cp_async_16(void* shared, const void* global, int src_bytes) {
  emulation::cp_async(shared, global, 16, static_cast<size_t>(src_bytes));
}

inline void cp_async_commit() { emulation::cp_async_commit(); }

template <int kPending>
inline void cp_async_wait() {
  emulation::cp_async_wait(kPending);
}

}  // namespace ptx
}  // namespace spectral_ops
