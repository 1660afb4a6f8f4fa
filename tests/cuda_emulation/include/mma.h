// WMMA for the CPU emulation (shadows CUDA's mma.h). A fragment is a warp-collective object; here
// every lane holds the whole tile, which has the same result as the hardware for code that, like
// csrc/, treats fragments as opaque apart from element-wise maps on x[]. The MMA itself is computed
// once per warp (emulation::warp_collective).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };
namespace precision {
struct tf32 {};
}  // namespace precision

// cvt.rna.tf32.f32: keep 10 mantissa bits, round to nearest, ties away from zero.
inline float __float_to_tf32(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0x1000u) & 0xffffe000u;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// What the tensor cores see of a tf32 operand: the low 13 bits are ignored.
inline float tf32_truncate(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  u &= 0xffffe000u;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

template <typename Use, int M, int N, int K>
struct Extent;
template <int M, int N, int K>
struct Extent<matrix_a, M, N, K> {
  static constexpr int rows = M, cols = K;
};
template <int M, int N, int K>
struct Extent<matrix_b, M, N, K> {
  static constexpr int rows = K, cols = N;
};
template <int M, int N, int K>
struct Extent<accumulator, M, N, K> {
  static constexpr int rows = M, cols = N;
};

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
  static constexpr int rows = Extent<Use, M, N, K>::rows;
  static constexpr int cols = Extent<Use, M, N, K>::cols;
  static constexpr int num_elements = rows * cols;
  float x[num_elements];  // row-major
};

inline float element(const float* p, int64_t i) { return p[i]; }
inline float element(const __half* p, int64_t i) { return __half2float(p[i]); }
inline float element(const __nv_bfloat16* p, int64_t i) { return __bfloat162float(p[i]); }

template <typename Use, int M, int N, int K, typename T, typename Layout, typename P>
void load_matrix_sync(fragment<Use, M, N, K, T, Layout>& f, const P* p, unsigned ldm) {
  using F = fragment<Use, M, N, K, T, Layout>;
  for (int r = 0; r < F::rows; ++r) {
    for (int c = 0; c < F::cols; ++c) {
      const int64_t i = std::is_same_v<Layout, col_major> ? r + static_cast<int64_t>(c) * ldm
                                                          : static_cast<int64_t>(r) * ldm + c;
      f.x[r * F::cols + c] = element(p, i);
    }
  }
}

template <int M, int N, int K, typename T>
void fill_fragment(fragment<accumulator, M, N, K, T>& f, float v) {
  for (float& x : f.x) x = v;
}

template <int M, int N, int K, typename T>
void store_matrix_sync(float* p, const fragment<accumulator, M, N, K, T>& f, unsigned ldm, layout_t layout) {
  for (int r = 0; r < M; ++r) {
    for (int c = 0; c < N; ++c) {
      const int64_t i = layout == mem_col_major ? r + static_cast<int64_t>(c) * ldm : static_cast<int64_t>(r) * ldm + c;
      p[i] = f.x[r * N + c];
    }
  }
}

template <int M, int N, int K, typename T, typename LA, typename LB>
void mma_sync(fragment<accumulator, M, N, K, float>& d, const fragment<matrix_a, M, N, K, T, LA>& a,
              const fragment<matrix_b, M, N, K, T, LB>& b, const fragment<accumulator, M, N, K, float>& c) {
  constexpr bool tf32 = std::is_same_v<T, precision::tf32>;
  // A sample of the operands is enough to catch lanes that loaded different tiles.
  double check = 0.0;
  for (int i = 0; i < M * K; i += 37) check += a.x[i] * (i + 1.0);
  for (int i = 0; i < K * N; i += 41) check += b.x[i] * (i + 0.5);
  for (int i = 0; i < M * N; i += 43) check += c.x[i] * (i + 0.25);
  const float* result = emulation::warp_collective(M * N, check, [&](float* out) {
    for (int i = 0; i < M; ++i) {
      for (int j = 0; j < N; ++j) {
        float acc = c.x[i * N + j];
        for (int k = 0; k < K; ++k) {
          const float x = tf32 ? tf32_truncate(a.x[i * K + k]) : a.x[i * K + k];
          const float y = tf32 ? tf32_truncate(b.x[k * N + j]) : b.x[k * N + j];
          acc += x * y;  // exact: both factors have at most 11 significant bits
        }
        out[i * N + j] = acc;
      }
    }
  });
  std::memcpy(d.x, result, sizeof(float) * M * N);
}

}  // namespace wmma
}  // namespace nvcuda
