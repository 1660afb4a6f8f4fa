// The tiled matrix-product kernel behind gemm.cu (rectangular grid) and syrk.cu (lower-triangle grid).
//
// One 256-thread block computes a 128 x 128 tile of out = alpha * (A B) + beta * Y for one matrix of
// the batch, accumulating in fp32:
//   * the main loop double-buffers `depth`-deep slabs of A and B through shared memory (global loads of
//     slab k+1 are in flight while slab k is multiplied), both stored reduction-dim-major
//     ([depth][128]), so one loader serves every operand and every math mode;
//   * the math is a template parameter: WMMA on float16/bfloat16, WMMA TF32 with a hi/lo split (3xTF32)
//     or fp32 FMA with an 8 x 8 register tile per thread;
//   * the epilogue stages the accumulators through shared memory 32 rows at a time, so that it can
//     apply alpha, beta * Y and the dtype conversion per element, write coalesced, and (triangular
//     grid) write the mirrored element coalesced too.
#pragma once

#include <mma.h>

#include <type_traits>

#include "device.cuh"
#include "matmul.h"

namespace spectral_ops {
namespace tiled {

namespace wmma = nvcuda::wmma;

constexpr int kTile = 128;
constexpr int kThreads = 256;
constexpr int kStageRows = 32;
constexpr int kStageLd = kTile + 4;
// Rectangular grids walk tiles in groups of this many tile rows, so that concurrently running blocks
// share their A and B slabs in L2.
constexpr int64_t kGroupRows = 8;

template <MathMode kMode>
struct Traits {
  using Smem = float;
  static constexpr int kDepth = 16;
};
template <>
struct Traits<MathMode::kHalf> {
  using Smem = __half;
  static constexpr int kDepth = 32;
};
template <>
struct Traits<MathMode::kBf16> {
  using Smem = __nv_bfloat16;
  static constexpr int kDepth = 32;
};

// Elements per 16-byte shared-memory vector; also the row padding, which keeps WMMA fragment pointers
// 32-byte aligned while shifting consecutive rows across banks.
template <typename Smem>
constexpr int kVec = 16 / static_cast<int>(sizeof(Smem));
template <typename Smem>
constexpr int kLd = kTile + kVec<Smem>;

// One operand as the loader sees it: `rows` along the reduction dim, `cols` along the output dim.
struct TileSource {
  const char* base;
  DType dtype;
  int64_t row_stride;
  int64_t col_stride;
  int64_t rows;
  int64_t cols;
  bool vectorized;
};

template <typename Smem>
__device__ __forceinline__ Smem from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

struct alignas(8) Pack4x16 {
  unsigned short v[4];
};
struct alignas(16) Pack8x16 {
  unsigned short v[8];
};

__device__ __forceinline__ float bits_to_float(unsigned short bits, DType dtype) {
  return dtype == DType::kFloat16 ? __half2float(__ushort_as_half(bits))
                                  : __bfloat162float(__ushort_as_bfloat16(bits));
}

template <typename Smem>
struct Vector {
  Smem v[kVec<Smem>];
};

// kVec consecutive elements along a row (or, kDown, down a column) starting at (row, col), in one
// 16-byte (or 8-byte) load where the host found the view aligned for it, else one element at a time (also
// for a vector that crosses the matrix edge). Returned by value so the caller's registers stay registers.
template <typename Smem, bool kDown>
__device__ __forceinline__ Vector<Smem> fetch_vector(const TileSource& s, int64_t row, int64_t col) {
  constexpr int vec = kVec<Smem>;
  Vector<Smem> out;
  const int64_t size = element_size(s.dtype);
  const char* p = s.base + (row * s.row_stride + col * s.col_stride) * size;
  const int64_t left = kDown ? s.rows - row : s.cols - col;
  const bool inside = (kDown ? col < s.cols : row < s.rows) && left > 0;
  if (!inside || left < vec || !s.vectorized) {
    const int64_t step = (kDown ? s.row_stride : s.col_stride) * size;
#pragma unroll
    for (int l = 0; l < vec; ++l) {
      float x = 0.0f;
      if (inside && l < left) {
        if constexpr (std::is_same_v<Smem, float>) {
          x = load_as_float(p + l * step, s.dtype, 0);
        } else {
          out.v[l] = *reinterpret_cast<const Smem*>(p + l * step);
          continue;
        }
      }
      out.v[l] = from_float<Smem>(x);
    }
    return out;
  }
  if constexpr (std::is_same_v<Smem, float>) {
    if (s.dtype == DType::kFloat32) {
      const float4 q = *reinterpret_cast<const float4*>(p);
      out.v[0] = q.x;
      out.v[1] = q.y;
      out.v[2] = q.z;
      out.v[3] = q.w;
    } else {
      const Pack4x16 q = *reinterpret_cast<const Pack4x16*>(p);
#pragma unroll
      for (int l = 0; l < 4; ++l) out.v[l] = bits_to_float(q.v[l], s.dtype);
    }
  } else {
    const Pack8x16 q = *reinterpret_cast<const Pack8x16*>(p);
#pragma unroll
    for (int l = 0; l < 8; ++l) {
      if constexpr (std::is_same_v<Smem, __half>) {
        out.v[l] = __ushort_as_half(q.v[l]);
      } else {
        out.v[l] = __ushort_as_bfloat16(q.v[l]);
      }
    }
  }
  return out;
}

// Moves one ROWS x 128 slab global -> registers (fetch) and registers -> shared memory (store), so that
// the global loads of the next slab overlap the math on the current one. kDown (a template parameter of
// the kernel, so that each thread's few addresses are all the registers it spends on loading) puts the
// vectors down the columns, for operands whose reduction dim has unit stride; otherwise they run along
// the rows. Consecutive threads take consecutive vectors, so the accesses coalesce either way.
template <typename Smem, int ROWS, bool kDown>
struct SlabLoader {
  static constexpr int vec = kVec<Smem>;
  static constexpr int kVectors = ROWS * kTile / kThreads / vec;
  static_assert(kVectors * vec * kThreads == ROWS * kTile && ROWS % vec == 0, "a slab must split into whole vectors");
  Smem v[kVectors * vec];

  // First element of this thread's vector i.
  __device__ static void position(int i, int& row, int& col) {
    const int e = threadIdx.x + i * kThreads;
    if constexpr (kDown) {
      row = (e % (ROWS / vec)) * vec;
      col = e / (ROWS / vec);
    } else {
      row = e / (kTile / vec);
      col = (e % (kTile / vec)) * vec;
    }
  }

  __device__ void fetch(const TileSource& s, int64_t row0, int64_t col0) {
#pragma unroll
    for (int i = 0; i < kVectors; ++i) {
      int row, col;
      position(i, row, col);
      const Vector<Smem> q = fetch_vector<Smem, kDown>(s, row0 + row, col0 + col);
#pragma unroll
      for (int l = 0; l < vec; ++l) v[i * vec + l] = q.v[l];
    }
  }

  __device__ void store(Smem* slab) const {
#pragma unroll
    for (int i = 0; i < kVectors; ++i) {
      int row, col;
      position(i, row, col);
#pragma unroll
      for (int l = 0; l < vec; ++l) slab[(row + (kDown ? l : 0)) * kLd<Smem> + col + (kDown ? 0 : l)] = v[i * vec + l];
    }
  }
};

// fp32 FMA: thread (ty, tx) of a 16 x 16 grid owns rows {4ty..4ty+3, 64+4ty..} and the same columns
// with tx, so each k step reads four float4 from shared memory for 64 FMAs.
struct FmaAccumulator {
  float c[8][8];

  __device__ static int row(int i) { return (i < 4 ? 0 : 64) + (threadIdx.x / 16) * 4 + i % 4; }
  __device__ static int col(int j) { return (j < 4 ? 0 : 64) + (threadIdx.x % 16) * 4 + j % 4; }

  __device__ void zero() {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
#pragma unroll
      for (int j = 0; j < 8; ++j) c[i][j] = 0.0f;
    }
  }

  __device__ static void load8(const float* slab_row, int base, float (&v)[8]) {
    const float4 lo = *reinterpret_cast<const float4*>(slab_row + base);
    const float4 hi = *reinterpret_cast<const float4*>(slab_row + 64 + base);
    v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w;
    v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
  }

  template <int kDepth>
  __device__ void multiply(const float* a_slab, const float* b_slab) {
    const int a_base = (threadIdx.x / 16) * 4;
    const int b_base = (threadIdx.x % 16) * 4;
#pragma unroll
    for (int k = 0; k < kDepth; ++k) {
      float a[8], b[8];
      load8(a_slab + k * kLd<float>, a_base, a);
      load8(b_slab + k * kLd<float>, b_base, b);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
#pragma unroll
        for (int j = 0; j < 8; ++j) c[i][j] = fmaf(a[i], b[j], c[i][j]);
      }
    }
  }

  // Rows [32 chunk, 32 chunk + 32) of the tile into the staging buffer.
  __device__ void stage(float* staging, int chunk) const {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (row(i) / kStageRows != chunk) continue;
      float* dst = staging + (row(i) % kStageRows) * kStageLd;
      *reinterpret_cast<float4*>(dst + col(0)) = make_float4(c[i][0], c[i][1], c[i][2], c[i][3]);
      *reinterpret_cast<float4*>(dst + col(4)) = make_float4(c[i][4], c[i][5], c[i][6], c[i][7]);
    }
  }
};

// bf16 and tf32 WMMA exist from sm_80 on. A build that also targets an older GPU gets only the FMA
// kernels in that GPU's code; run_matmul refuses the other modes there (matmul_kernel traps).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define SPECTRAL_OPS_WMMA 0
#else
#define SPECTRAL_OPS_WMMA 1
#endif

#if SPECTRAL_OPS_WMMA
template <MathMode kMode>
struct WmmaTypes {
  using In = wmma::precision::tf32;
  static constexpr int kK = 8;
};
template <>
struct WmmaTypes<MathMode::kHalf> {
  using In = __half;
  static constexpr int kK = 16;
};
template <>
struct WmmaTypes<MathMode::kBf16> {
  using In = __nv_bfloat16;
  static constexpr int kK = 16;
};

// Tensor cores: 8 warps as 2 (rows) x 4 (cols), each owning a 64 x 32 block of 4 x 2 fragments.
// Slabs are [k][m] and [k][n], i.e. A fragments load col_major and B fragments row_major.
template <MathMode kMode>
struct WmmaAccumulator {
  using Types = WmmaTypes<kMode>;
  using FragA = wmma::fragment<wmma::matrix_a, 16, 16, Types::kK, typename Types::In, wmma::col_major>;
  using FragB = wmma::fragment<wmma::matrix_b, 16, 16, Types::kK, typename Types::In, wmma::row_major>;
  using FragC = wmma::fragment<wmma::accumulator, 16, 16, Types::kK, float>;
  FragC c[4][2];

  __device__ static int warp_row() { return (threadIdx.x / 32) / 4 * 64; }
  __device__ static int warp_col() { return (threadIdx.x / 32) % 4 * 32; }

  __device__ void zero() {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int j = 0; j < 2; ++j) wmma::fill_fragment(c[i][j], 0.0f);
    }
  }

  // 3xTF32: x = hi + lo with both parts exact in TF32 (to about 2^-22 of x); the lo * lo term is
  // dropped, and the small products go first so they are not absorbed by the large one.
  template <typename Frag>
  __device__ static void split(Frag& hi, Frag& lo) {
#pragma unroll
    for (int t = 0; t < hi.num_elements; ++t) {
      const float x = hi.x[t];
      const float h = wmma::__float_to_tf32(x);
      hi.x[t] = h;
      lo.x[t] = wmma::__float_to_tf32(x - h);
    }
  }

  template <typename Frag>
  __device__ static void round_to_tf32(Frag& f) {
#pragma unroll
    for (int t = 0; t < f.num_elements; ++t) f.x[t] = wmma::__float_to_tf32(f.x[t]);
  }

  template <int kDepth, typename Smem>
  __device__ void multiply(const Smem* a_slab, const Smem* b_slab) {
#pragma unroll
    for (int k = 0; k < kDepth; k += Types::kK) {
      // Both B fragments stay loaded; A fragments are loaded one at a time to save registers.
      FragB b[2], b_lo[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        wmma::load_matrix_sync(b[j], b_slab + k * kLd<Smem> + warp_col() + j * 16, kLd<Smem>);
        if constexpr (kMode == MathMode::kTf32x3) split(b[j], b_lo[j]);
        if constexpr (kMode == MathMode::kTf32) round_to_tf32(b[j]);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        FragA a, a_lo;
        wmma::load_matrix_sync(a, a_slab + k * kLd<Smem> + warp_row() + i * 16, kLd<Smem>);
        if constexpr (kMode == MathMode::kTf32x3) split(a, a_lo);
        if constexpr (kMode == MathMode::kTf32) round_to_tf32(a);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          if constexpr (kMode == MathMode::kTf32x3) {
            wmma::mma_sync(c[i][j], a_lo, b[j], c[i][j]);
            wmma::mma_sync(c[i][j], a, b_lo[j], c[i][j]);
          }
          wmma::mma_sync(c[i][j], a, b[j], c[i][j]);
        }
      }
    }
  }

  __device__ void stage(float* staging, int chunk) const {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = warp_row() + i * 16;
      if (row / kStageRows != chunk) continue;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        wmma::store_matrix_sync(staging + (row % kStageRows) * kStageLd + warp_col() + j * 16, c[i][j], kStageLd,
                                wmma::mem_row_major);
      }
    }
  }
};

template <MathMode kMode>
using Accumulator = std::conditional_t<kMode == MathMode::kFma, FmaAccumulator, WmmaAccumulator<kMode>>;
#else
template <MathMode kMode>
using Accumulator = FmaAccumulator;
#endif

template <MathMode kMode>
constexpr size_t kSharedBytes = std::max(
    static_cast<size_t>(2 * 2 * Traits<kMode>::kDepth * kLd<typename Traits<kMode>::Smem>) *
        sizeof(typename Traits<kMode>::Smem),
    static_cast<size_t>(kStageRows * kStageLd) * sizeof(float));

__device__ __forceinline__ void lower_triangle_tile(int64_t index, int64_t& tile_row, int64_t& tile_col) {
  // Row r of the lower triangle starts at r (r + 1) / 2; the float estimate is corrected exactly.
  int64_t r = static_cast<int64_t>((sqrt(8.0 * static_cast<double>(index) + 1.0) - 1.0) * 0.5);
  while (r * (r + 1) / 2 > index) --r;
  while ((r + 1) * (r + 2) / 2 <= index) ++r;
  tile_row = r;
  tile_col = index - r * (r + 1) / 2;
}

__device__ __forceinline__ void grouped_tile(int64_t index, int64_t tiles_m, int64_t tiles_n, int64_t& tile_row,
                                             int64_t& tile_col) {
  const int64_t per_group = kGroupRows * tiles_n;
  const int64_t first_row = index / per_group * kGroupRows;
  const int64_t rows = tiles_m - first_row < kGroupRows ? tiles_m - first_row : kGroupRows;
  const int64_t local = index % per_group;
  tile_row = first_row + local % rows;
  tile_col = local / rows;
}

// Rows [32 chunk, +32) of the tile, staged in shared memory, to `out`. Triangular grids process only
// the lower triangle (Y is read there only) and then write each strictly-lower element mirrored, with
// threads walking down the staged columns so that the mirrored writes coalesce too.
template <bool kTriangular>
__device__ void store_chunk(const MatmulParams& p, float* staging, int chunk, int64_t m0, int64_t n0, char* out,
                            const char* y, float alpha, float beta) {
  constexpr int kPerThread = kStageRows * kTile / kThreads;
#pragma unroll 4
  for (int i = 0; i < kPerThread; ++i) {
    const int e = threadIdx.x + i * kThreads;
    const int rr = e / kTile, cc = e % kTile;
    const int64_t row = m0 + chunk * kStageRows + rr, col = n0 + cc;
    if (row >= p.m || col >= p.n || (kTriangular && row < col)) continue;
    float v = alpha * staging[rr * kStageLd + cc];
    if (y != nullptr) v = fmaf(beta, load_as_float(y, p.y.dtype, row * p.y.row_stride + col * p.y.col_stride), v);
    store_from_float(out, p.out.dtype, row * p.out.row_stride + col * p.out.col_stride, v);
    if constexpr (kTriangular) staging[rr * kStageLd + cc] = v;
  }
  if constexpr (kTriangular) {
    __syncthreads();
#pragma unroll 4
    for (int i = 0; i < kPerThread; ++i) {
      const int e = threadIdx.x + i * kThreads;
      const int rr = e % kStageRows, cc = e / kStageRows;
      const int64_t row = m0 + chunk * kStageRows + rr, col = n0 + cc;
      if (row >= p.m || col >= p.n || row <= col) continue;
      store_from_float(out, p.out.dtype, col * p.out.row_stride + row * p.out.col_stride, staging[rr * kStageLd + cc]);
    }
  }
}

template <MathMode kMode, bool kTriangular, bool kADown, bool kBDown>
__device__ void matmul_tiles(const MatmulParams& p) {
  using Smem = typename Traits<kMode>::Smem;
  constexpr int kDepth = Traits<kMode>::kDepth;
  constexpr int kSlab = kDepth * kLd<Smem>;
  extern __shared__ __align__(128) unsigned char shared[];  // kSharedBytes<kMode>
  Smem* a_slabs = reinterpret_cast<Smem*>(shared);
  Smem* b_slabs = a_slabs + 2 * kSlab;
  float* staging = reinterpret_cast<float*>(shared);

  int64_t tile_row, tile_col;
  if constexpr (kTriangular) {
    lower_triangle_tile(blockIdx.x, tile_row, tile_col);
  } else {
    grouped_tile(blockIdx.x, (p.m + kTile - 1) / kTile, (p.n + kTile - 1) / kTile, tile_row, tile_col);
  }
  const int64_t m0 = tile_row * kTile, n0 = tile_col * kTile;
  const int64_t slabs = (p.k + kDepth - 1) / kDepth;

  for (int64_t b = blockIdx.y; b < p.batch.count; b += gridDim.y) {
    // A is read as its transpose (rows along k), B as it is.
    const TileSource a{matrix_base(p.a, p.batch, b), p.a.dtype, p.a.col_stride, p.a.row_stride, p.k, p.m,
                       p.a_vectorized};
    const TileSource bs{matrix_base(p.b, p.batch, b), p.b.dtype, p.b.row_stride, p.b.col_stride, p.k, p.n,
                        p.b_vectorized};
    SlabLoader<Smem, kDepth, kADown> a_loader;
    SlabLoader<Smem, kDepth, kBDown> b_loader;
    Accumulator<kMode> acc;
    acc.zero();

    a_loader.fetch(a, 0, m0);
    b_loader.fetch(bs, 0, n0);
    a_loader.store(a_slabs);
    b_loader.store(b_slabs);
    __syncthreads();
    for (int64_t s = 0; s < slabs; ++s) {
      const int current = static_cast<int>(s & 1);
      const bool more = s + 1 < slabs;
      if (more) {
        a_loader.fetch(a, (s + 1) * kDepth, m0);
        b_loader.fetch(bs, (s + 1) * kDepth, n0);
      }
      acc.template multiply<kDepth>(a_slabs + current * kSlab, b_slabs + current * kSlab);
      if (more) {
        // The other buffer was last read in step s - 1, before the barrier that ended it.
        a_loader.store(a_slabs + (1 - current) * kSlab);
        b_loader.store(b_slabs + (1 - current) * kSlab);
      }
      __syncthreads();
    }

    char* out = matrix_base(p.out, p.batch, b);
    const char* y = p.y.data == nullptr ? nullptr : matrix_base(p.y, p.batch, b);
    const float alpha = scale_of(p.alpha, b), beta = scale_of(p.beta, b);
    for (int chunk = 0; chunk < kTile / kStageRows; ++chunk) {
      if (m0 + chunk * kStageRows >= p.m) break;
      acc.stage(staging, chunk);
      __syncthreads();
      store_chunk<kTriangular>(p, staging, chunk, m0, n0, out, y, alpha, beta);
      __syncthreads();
    }
  }
}

template <MathMode kMode, bool kTriangular, bool kADown, bool kBDown>
__global__ void __launch_bounds__(kThreads) matmul_kernel(const MatmulParams p) {
  if constexpr (kMode == MathMode::kFma || SPECTRAL_OPS_WMMA) {
    matmul_tiles<kMode, kTriangular, kADown, kBDown>(p);
  } else {
    __trap();
  }
}

template <MathMode kMode, bool kTriangular, bool kADown, bool kBDown>
void launch(const MatmulPlan& plan, cudaStream_t stream) {
  const MatmulParams& p = plan.params;
  const int64_t tiles_m = (p.m + kTile - 1) / kTile;
  const int64_t tiles = kTriangular ? tiles_m * (tiles_m + 1) / 2 : tiles_m * ((p.n + kTile - 1) / kTile);
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(std::min<int64_t>(p.batch.count, 65535)));
  launch_kernel(matmul_kernel<kMode, kTriangular, kADown, kBDown>, grid, kThreads, kSharedBytes<kMode>, stream, p);
}

template <MathMode kMode, bool kTriangular>
void launch_directions(const MatmulPlan& plan, cudaStream_t stream) {
  const bool a_down = plan.params.a_down, b_down = plan.params.b_down;
  if (a_down && b_down) return launch<kMode, kTriangular, true, true>(plan, stream);
  if (a_down) return launch<kMode, kTriangular, true, false>(plan, stream);
  if (b_down) return launch<kMode, kTriangular, false, true>(plan, stream);
  launch<kMode, kTriangular, false, false>(plan, stream);
}

template <bool kTriangular>
void launch_mode(const MatmulPlan& plan, cudaStream_t stream) {
  switch (plan.mode) {
    case MathMode::kFma: launch_directions<MathMode::kFma, kTriangular>(plan, stream); break;
    case MathMode::kTf32x3: launch_directions<MathMode::kTf32x3, kTriangular>(plan, stream); break;
    case MathMode::kTf32: launch_directions<MathMode::kTf32, kTriangular>(plan, stream); break;
    case MathMode::kHalf: launch_directions<MathMode::kHalf, kTriangular>(plan, stream); break;
    case MathMode::kBf16: launch_directions<MathMode::kBf16, kTriangular>(plan, stream); break;
  }
}

}  // namespace tiled
}  // namespace spectral_ops
