// The tiled matrix-product kernel behind gemm.cu (rectangular grid) and syrk.cu (lower-triangle grid).
//
// One block computes a 128 x 128 tile of out = alpha * (A B) + beta * Y for one matrix of the batch,
// accumulating in fp32. The math mode, a template parameter, picks the main loop:
//   * tensor cores (float16 and bfloat16 operands; fp32 operands as TF32, one pass, or 3xTF32 with a
//     hi/lo split): a kStages-deep cp.async pipeline of `depth`-deep slabs. Each operand's slab keeps
//     the operand's own layout -- k-contiguous ([128][depth]) when its reduction dim has unit stride,
//     else [depth][128] -- with its 16-byte chunks XOR-swizzled per row (SwizzledSlab), so that the
//     cp.async stores and the fragment loads are both free of bank conflicts. Fragments load with
//     ldmatrix.x4 (.trans from a 16-bit [depth][128] slab) and feed mma.sync m16n8k16 (f16, bf16) or
//     m16n8k8 (tf32). TF32 fragments load with ldmatrix from a k-contiguous slab (one 8 x 8 b16 matrix
//     is an 8 x 4 block of fp32, the tf32 fragment's layout) and with four swizzled, conflict-free
//     LDS.32 from a [depth][128] slab (a b16 .trans would swap the halves of each fp32).
//     128 threads, 2 x 2 warps of 64 x 64 (8 ldmatrix.x4 per 32 mma per k step).
//     A tile inside the matrix whose operands cp.async can copy takes the interior path for its whole
//     slabs: each thread's chunks are one pointer per operand plus constant steps, no edge checks.
//     Every other slab takes the checked path: a vector that cp.async cannot copy -- an operand of
//     another dtype than the slab's, or a view not aligned for 16-byte access -- is loaded, converted
//     and stored by the thread itself when its slab is issued, kStages - 1 slabs ahead of its use; a
//     vector cut by the matrix edge is copied short and zero-filled.
//   * fp32 FMA (precision=ieee; 16-bit operands converted on load): register-staged double buffering
//     of [depth][128] slabs (the global loads of slab k+1 are in flight while slab k is multiplied)
//     and an 8 x 8 register tile per thread of 256.
// __launch_bounds__(threads, 2): two blocks share an SM (FMA: at most 128 registers a thread, tensor
// cores 255).
// The epilogue stages the accumulators through shared memory 32 rows at a time, so that it can apply
// alpha, beta * Y and the dtype conversion per element, write coalesced, and (triangular grid) write
// the mirrored element coalesced too.
#pragma once

#include <algorithm>
#include <type_traits>

#include "device.cuh"
#include "matmul.h"
#include "mma_ptx.cuh"

namespace spectral_ops {
namespace tiled {

constexpr int kTile = 128;
constexpr int kFmaThreads = 256;
constexpr int kMmaThreads = 128;
// Blocks per SM the register allocation must allow: 65536 / (2 * threads) registers a thread.
constexpr int kMinBlocks = 2;
constexpr int kStageRows = 32;
constexpr int kStageLd = kTile + 4;
// The largest grid.y and grid.z: a launch covers up to kMaxGridYZ^2 matrices of a batch.
constexpr int64_t kMaxGridYZ = 65535;
// Rectangular grids walk tiles in groups of this many tile rows, so that concurrently running blocks
// share their A and B slabs in L2.
constexpr int64_t kGroupRows = 8;

// Elements per 16-byte shared-memory vector.
template <typename Smem>
constexpr int kVec = 16 / static_cast<int>(sizeof(Smem));
// Row length of an FMA slab: the padding shifts consecutive rows across banks and keeps float4 aligned.
constexpr int kFmaLd = kTile + kVec<float>;

// kStages slabs of each operand are resident: FMA double-buffers through registers, the tensor-core
// modes keep kStages - 1 slabs in flight. 4 stages of 16 KiB (A and B) leave room for two blocks per SM.
template <MathMode kMode>
struct Traits {
  using Smem = float;
  static constexpr int kDepth = 16;
  static constexpr int kStages = 4;
};
template <>
struct Traits<MathMode::kFma> {
  using Smem = float;
  static constexpr int kDepth = 16;
  static constexpr int kStages = 2;
};
// 16-bit operands: twice the depth in the same bytes per slab.
template <typename Half>
struct HalfTraits {
  using Smem = Half;
  static constexpr int kDepth = 32;
  static constexpr int kStages = 4;
};
template <>
struct Traits<MathMode::kHalf> : HalfTraits<__half> {};
template <>
struct Traits<MathMode::kBf16> : HalfTraits<__nv_bfloat16> {};

// Elements of one operand's slab: FMA's rows are padded, the tensor-core slabs swizzled instead.
template <MathMode kMode>
constexpr int kThreadsOf = kMode == MathMode::kFma ? kFmaThreads : kMmaThreads;

template <MathMode kMode>
constexpr int kSlabElems = Traits<kMode>::kDepth * (kMode == MathMode::kFma ? kFmaLd : kTile);

template <typename Smem>
constexpr DType kDTypeOf = DType::kFloat32;
template <>
constexpr DType kDTypeOf<__half> = DType::kFloat16;
template <>
constexpr DType kDTypeOf<__nv_bfloat16> = DType::kBFloat16;

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

// 16 bytes, aligned so that a vector moves to shared memory in one store.
template <typename Smem>
struct alignas(16) Vector {
  Smem v[kVec<Smem>];
};

// How many elements of the vector of `vec` elements at (row, col) lie inside the matrix (0 to vec);
// kDown: the vector runs down a column.
template <bool kDown>
__device__ __forceinline__ int64_t elements_inside(const TileSource& s, int64_t row, int64_t col, int vec) {
  const int64_t left = kDown ? s.rows - row : s.cols - col;
  const bool inside = (kDown ? col < s.cols : row < s.rows) && left > 0;
  return inside ? (left < vec ? left : vec) : 0;
}

// kVec consecutive elements along a row (or, kDown, down a column) starting at (row, col), converted to
// Smem, zero past the matrix edge: in one 16-byte (or 8-byte) load where the host found the view
// aligned for it, else one element at a time (also for a vector that crosses the edge). Returned by
// value so the caller's registers stay registers.
template <typename Smem, bool kDown>
__device__ __forceinline__ Vector<Smem> fetch_vector(const TileSource& s, int64_t row, int64_t col) {
  constexpr int vec = kVec<Smem>;
  Vector<Smem> out;
  const int64_t size = element_size(s.dtype);
  const char* p = s.base + (row * s.row_stride + col * s.col_stride) * size;
  const int64_t inside = elements_inside<kDown>(s, row, col, vec);
  if (inside < vec || !s.vectorized) {
    const int64_t step = (kDown ? s.row_stride : s.col_stride) * size;
#pragma unroll
    for (int l = 0; l < vec; ++l) {
      float x = 0.0f;
      if (l < inside) {
        if constexpr (std::is_same_v<Smem, float>) {
          x = load_as_float(p + l * step, s.dtype, 0);
        } else {
          out.v[l] = read_global<Smem>(p + l * step);
          continue;
        }
      }
      out.v[l] = from_float<Smem>(x);
    }
    return out;
  }
  if constexpr (std::is_same_v<Smem, float>) {
    if (s.dtype == DType::kFloat32) {
      const float4 q = read_global<float4>(p);
      out.v[0] = q.x;
      out.v[1] = q.y;
      out.v[2] = q.z;
      out.v[3] = q.w;
    } else {
      const Pack4x16 q = read_global<Pack4x16>(p);
#pragma unroll
      for (int l = 0; l < 4; ++l) out.v[l] = bits_to_float(q.v[l], s.dtype);
    }
  } else {
    const Pack8x16 q = read_global<Pack8x16>(p);
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

// fp32 FMA: moves one ROWS x 128 slab global -> registers (issue) and registers -> shared memory
// [ROWS][kFmaLd] (finish), so that the global loads of the next slab overlap the math on the current
// one. kDown (a template parameter of the kernel, so that each thread's few addresses are all the
// registers it spends on loading) puts the vectors down the columns, for operands whose reduction dim
// has unit stride; otherwise they run along the rows. Consecutive threads take consecutive vectors, so
// the accesses coalesce either way.
template <int ROWS, bool kDown>
struct RegisterLoader {
  static constexpr int vec = kVec<float>;
  static constexpr int kVectors = ROWS * kTile / kFmaThreads / vec;
  static_assert(kVectors * vec * kFmaThreads == ROWS * kTile && ROWS % vec == 0,
                "a slab must split into whole vectors");
  float v[kVectors * vec];

  // First element of this thread's vector i. The thread index is re-read (see AsyncLoader::issue).
  __device__ static void position(int i, int& row, int& col) {
    const int e = ptx::thread_index() + i * kFmaThreads;
    if constexpr (kDown) {
      row = (e % (ROWS / vec)) * vec;
      col = e / (ROWS / vec);
    } else {
      row = e / (kTile / vec);
      col = (e % (kTile / vec)) * vec;
    }
  }

  __device__ void issue(const TileSource& s, int64_t row0, int64_t col0, float*) {
#pragma unroll
    for (int i = 0; i < kVectors; ++i) {
      int row, col;
      position(i, row, col);
      const Vector<float> q = fetch_vector<float, kDown>(s, row0 + row, col0 + col);
#pragma unroll
      for (int l = 0; l < vec; ++l) v[i * vec + l] = q.v[l];
    }
  }

  __device__ void finish(float* slab) const {
#pragma unroll
    for (int i = 0; i < kVectors; ++i) {
      int row, col;
      position(i, row, col);
#pragma unroll
      for (int l = 0; l < vec; ++l) slab[(row + (kDown ? l : 0)) * kFmaLd + col + (kDown ? 0 : l)] = v[i * vec + l];
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

  __device__ void multiply(const float* a_slab, const float* b_slab) {
    constexpr int kDepth = Traits<MathMode::kFma>::kDepth;
    const int a_base = (threadIdx.x / 16) * 4;
    const int b_base = (threadIdx.x % 16) * 4;
#pragma unroll
    for (int k = 0; k < kDepth; ++k) {
      float a[8], b[8];
      load8(a_slab + k * kFmaLd, a_base, a);
      load8(b_slab + k * kFmaLd, b_base, b);
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

// ldmatrix, cp.async and mma.sync exist from sm_80 on. A build that also targets an older GPU gets
// only the FMA kernels in that GPU's code; run_matmul refuses the other modes there (matmul_kernel traps).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define SPECTRAL_OPS_TENSOR_CORES 0
#else
#define SPECTRAL_OPS_TENSOR_CORES 1
#endif

#if SPECTRAL_OPS_TENSOR_CORES
// One operand's slab in the operand's own layout: rows along the dim without unit stride, 16-byte
// chunks along the other, so [128 outer][kDepth] when kKContig, else [kDepth][128 outer]. Chunk c of
// row r is stored at c ^ swizzle(r). Shared memory serves a warp's 16-byte accesses 8 lanes (128 bytes,
// all 32 banks) at a time and its 4-byte accesses 32 lanes at a time. The accesses here: the cp.async
// stores (one row, 8 consecutive chunks), ldmatrix (8 consecutive rows, one chunk each) and, for fp32
// [kDepth][128] slabs, the LDS.32 of a tf32 fragment (4 consecutive rows, 2 chunks each); the swizzle
// spreads each of them over all 32 banks. Fragments step by 8 or 16 rows and by whole chunk bits, so
// the swizzle of a fragment is the one of fragment 0 and its address that one's XOR a constant.
template <typename T, int kDepth, bool kKContig>
struct SwizzledSlab {
  using Elem = T;
  static constexpr bool kKContiguous = kKContig;
  static constexpr int kChunkElems = kVec<T>;
  static constexpr int kRowElems = kKContig ? kDepth : kTile;
  static constexpr int kRows = kKContig ? kTile : kDepth;
  static constexpr int kChunks = kRowElems / kChunkElems;
  static constexpr int kElems = kRows * kRowElems;
  static_assert(kChunks == 4 || kChunks % 8 == 0, "rows of 64 bytes or of whole 128-byte lines");
  // Rows that one read touches together: ldmatrix reads 8, the tf32 LDS.32 of an fp32 [kDepth][128]
  // slab 4 (with 2 chunks each, hence the step of 2 between their swizzles).
  static constexpr int kReadRows = !kKContig && sizeof(T) == 4 ? 4 : 8;

  __device__ static int swizzle(int row) {
    if constexpr (kChunks == 4) {
      // Two 64-byte rows share each 128-byte line: shift the chunks of each line.
      return row / 2 % 4;
    } else {
      return row % kReadRows * (8 / kReadRows);
    }
  }

  // Element offset of chunk c of row `row`.
  __device__ static int chunk(int row, int c) { return row * kRowElems + (c ^ swizzle(row)) * kChunkElems; }

  __device__ static int at(int outer, int k) {
    const int row = kKContig ? outer : k, col = kKContig ? k : outer;
    return chunk(row, col / kChunkElems) + col % kChunkElems;
  }
};

// Issues one slab of one operand into its SwizzledSlab. Consecutive threads take consecutive 16-byte
// chunks along the rows (along the operand's unit-stride dim), so the global reads coalesce. A thread's
// chunks lie kRowStep slab rows apart, where the swizzle repeats: in shared memory they are a constant
// apart, in global memory a constant stride apart.
template <typename Smem, int kDepth, bool kKContig>
struct AsyncLoader {
  using Slab = SwizzledSlab<Smem, kDepth, kKContig>;
  static constexpr int kVectors = Slab::kElems / kVec<Smem> / kMmaThreads;
  static constexpr int kRowStep = kMmaThreads / Slab::kChunks;
  static_assert(kVectors * kVec<Smem> * kMmaThreads == Slab::kElems, "a slab must split into whole vectors");
  static_assert(kMmaThreads % Slab::kChunks == 0 && kRowStep % Slab::kReadRows == 0 &&
                    (Slab::kChunks != 4 || kRowStep % 8 == 0),
                "a thread's chunks must share one swizzle");

  // The interior path's state: this thread's first chunk of the next slab it issues, and the byte
  // steps between its chunks (int32: the host checked that 128 rows of either stride fit) and slabs;
  // the element offset of that chunk in a slab.
  const char* next;
  int chunk_step;
  int64_t slab_step;
  int slab_offset;

  __device__ void start_interior(const TileSource& s, int64_t outer0) {
    const int row = threadIdx.x / Slab::kChunks, c = threadIdx.x % Slab::kChunks;
    slab_offset = Slab::chunk(row, c);
    const int64_t k = kKContig ? c * kVec<Smem> : row, outer = outer0 + (kKContig ? row : c * kVec<Smem>);
    next = s.base + (k * s.row_stride + outer * s.col_stride) * static_cast<int64_t>(sizeof(Smem));
    chunk_step = static_cast<int>(kRowStep * (kKContig ? s.col_stride : s.row_stride) * sizeof(Smem));
    slab_step = kDepth * s.row_stride * static_cast<int64_t>(sizeof(Smem));
  }

  // The next whole slab of a tile inside the matrix, whose operand cp.async can copy.
  __device__ void issue_interior(Smem* slab) {
    Smem* dst = slab + slab_offset;
#pragma unroll
    for (int i = 0; i < kVectors; ++i) {
      ptx::cp_async_16(dst + i * kRowStep * Slab::kRowElems, next + i * chunk_step, 16);
    }
    next += slab_step;
  }

  // Any slab: checks each vector against the matrix edge, and converts where cp.async cannot copy.
  __device__ void issue(const TileSource& s, int64_t k0, int64_t outer0, Smem* slab) const {
    const bool direct = s.vectorized && s.dtype == kDTypeOf<Smem>;
    // Re-read per slab so that the compiler recomputes this thread's addresses (a few integer
    // operations) instead of holding them, 64-bit, in registers through the math.
    const int thread = ptx::thread_index();
#pragma unroll
    for (int i = 0; i < kVectors; ++i) {
      const int e = thread + i * kMmaThreads;
      const int row = e / Slab::kChunks, c = e % Slab::kChunks;
      const int64_t k = k0 + (kKContig ? c * kVec<Smem> : row);
      const int64_t outer = outer0 + (kKContig ? row : c * kVec<Smem>);
      Smem* dst = slab + Slab::chunk(row, c);
      if (direct) {
        const int64_t inside = elements_inside<kKContig>(s, k, outer, kVec<Smem>);
        const char* src = inside > 0 ? s.base + (k * s.row_stride + outer * s.col_stride) * sizeof(Smem) : s.base;
        ptx::cp_async_16(dst, src, static_cast<int>(inside * sizeof(Smem)));
      } else {
        *reinterpret_cast<Vector<Smem>*>(dst) = fetch_vector<Smem, kKContig>(s, k, outer);
      }
    }
  }

  __device__ void finish(Smem*) const {}
};

// The 16 (outer) x 16-byte (k) block at (outer0, k0) of a slab as four 8 x 8 b16 matrices; of each,
// lane l holds outer l / 4 and the 4 bytes at 4 (l % 4) along k. In A order -- (outer 0-7, k low),
// (outer 8-15, k low), (outer 0-7, k high), (outer 8-15, k high) -- that is the A fragment of
// mma.m16n8k16 (f16, bf16: k 0-7 and 8-15) and of mma.m16n8k8 (tf32: k 0-3 and 4-7). In B order --
// (outer 0-7, k low), (outer 0-7, k high), (outer 8-15, k low), (outer 8-15, k high) -- it is two B
// fragments of 8 columns, registers 0-1 and 2-3: each pair already where the mma reads it (no copies).
template <typename Slab, bool kBOrder>
__device__ __forceinline__ void load_block(uint32_t (&r)[4], const typename Slab::Elem* slab, int outer0, int k0) {
  const int lane = threadIdx.x % 32;
  constexpr int kHalf = Slab::kChunkElems;
  // The matrix whose row address this lane supplies (ldmatrix), and its two halves.
  const int matrix = lane / 8;
  const int outer_half = kBOrder ? matrix / 2 : matrix % 2, k_half = kBOrder ? matrix % 2 : matrix / 2;
  if constexpr (Slab::kKContiguous) {
    ptx::ldmatrix_x4<false>(r, slab + Slab::at(outer0 + lane % 8 + outer_half * 8, k0 + k_half * kHalf));
  } else if constexpr (sizeof(typename Slab::Elem) == 2) {
    // Rows are k here: each matrix is read as 8 k-rows of 8 outer elements and transposed.
    ptx::ldmatrix_x4<true>(r, slab + Slab::at(outer0 + outer_half * 8, k0 + lane % 8 + k_half * 8));
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int outer = kBOrder ? i / 2 : i % 2, k = kBOrder ? i % 2 : i / 2;
      r[i] = __float_as_uint(slab[Slab::at(outer0 + lane / 4 + outer * 8, k0 + lane % 4 + k * 4)]);
    }
  }
}

// Tensor cores: 4 warps as 2 x 2, each owning a 64 x 64 block as 4 x 8 mma tiles of 16 x 8. Accumulator
// element e of tile (i, j) is row 16 i + lane / 4 + 8 (e / 2), column 8 j + 2 (lane % 4) + e % 2 of the
// warp's block.
template <MathMode kMode, bool kAKContig, bool kBKContig>
struct MmaAccumulator {
  using Smem = typename Traits<kMode>::Smem;
  static constexpr int kDepth = Traits<kMode>::kDepth;
  using ASlab = SwizzledSlab<Smem, kDepth, kAKContig>;
  using BSlab = SwizzledSlab<Smem, kDepth, kBKContig>;
  static constexpr bool kTf32 = kMode == MathMode::kTf32 || kMode == MathMode::kTf32x3;
  static constexpr int kK = kTf32 ? 8 : 16;
  static constexpr int kWarpTile = 64;
  static constexpr int kRowTiles = kWarpTile / 16, kColTiles = kWarpTile / 8;
  static_assert(kMmaThreads / 32 * kWarpTile * kWarpTile == kTile * kTile, "the warps cover the tile");
  float c[kRowTiles][kColTiles][4];

  __device__ static int warp_row() { return (threadIdx.x / 32) / 2 * kWarpTile; }
  __device__ static int warp_col() { return (threadIdx.x / 32) % 2 * kWarpTile; }

  __device__ void zero() {
#pragma unroll
    for (int i = 0; i < kRowTiles; ++i) {
#pragma unroll
      for (int j = 0; j < kColTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) c[i][j][e] = 0.0f;
      }
    }
  }

  // Operands as the mode uses them. 3xTF32: x = hi + lo with both parts exact in TF32 (to about 2^-22
  // of x); one-pass TF32: x rounded to nearest.
  template <int N>
  __device__ static void prepare(uint32_t (&x)[N], uint32_t (&lo)[N]) {
#pragma unroll
    for (int t = 0; t < N; ++t) {
      const float v = __uint_as_float(x[t]);
      if constexpr (kMode == MathMode::kTf32x3) {
        const float hi = ptx::to_tf32(v);
        x[t] = __float_as_uint(hi);
        lo[t] = __float_as_uint(ptx::to_tf32(v - hi));
      } else if constexpr (kMode == MathMode::kTf32) {
        x[t] = __float_as_uint(ptx::to_tf32(v));
      }
    }
  }

  __device__ static void mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    if constexpr (kTf32) {
      ptx::mma_m16n8k8_tf32(d, a, b);
    } else {
      ptx::mma_m16n8k16<Smem>(d, a, b);
    }
  }

  __device__ void multiply(const Smem* a_slab, const Smem* b_slab) {
#pragma unroll
    for (int k = 0; k < kDepth; k += kK) {
      // The eight B fragments stay loaded; A fragments are loaded one at a time to save registers.
      uint32_t b[kColTiles][2], b_lo[kColTiles][2];
#pragma unroll
      for (int pair = 0; pair < kColTiles / 2; ++pair) {
        uint32_t r[4];
        load_block<BSlab, true>(r, b_slab, warp_col() + 16 * pair, k);
        b[2 * pair][0] = r[0], b[2 * pair][1] = r[1];
        b[2 * pair + 1][0] = r[2], b[2 * pair + 1][1] = r[3];
      }
#pragma unroll
      for (int j = 0; j < kColTiles; ++j) prepare(b[j], b_lo[j]);
#pragma unroll
      for (int i = 0; i < kRowTiles; ++i) {
        uint32_t a[4], a_lo[4];
        load_block<ASlab, false>(a, a_slab, warp_row() + 16 * i, k);
        prepare(a, a_lo);
#pragma unroll
        for (int j = 0; j < kColTiles; ++j) {
          // 3xTF32 drops lo * lo, and adds the small products first so the large one cannot absorb them.
          if constexpr (kMode == MathMode::kTf32x3) {
            mma(c[i][j], a_lo, b[j]);
            mma(c[i][j], a, b_lo[j]);
          }
          mma(c[i][j], a, b[j]);
        }
      }
    }
  }

  // Rows [32 chunk, 32 chunk + 32) of the tile into the staging buffer.
  __device__ void stage(float* staging, int chunk) const {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int i = 0; i < kRowTiles; ++i) {
      const int row = warp_row() + i * 16 + lane / 4;
      if (row / kStageRows != chunk) continue;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float* dst = staging + (row % kStageRows + 8 * half) * kStageLd + warp_col() + 2 * (lane % 4);
#pragma unroll
        for (int j = 0; j < kColTiles; ++j) {
          *reinterpret_cast<float2*>(dst + 8 * j) = make_float2(c[i][j][2 * half], c[i][j][2 * half + 1]);
        }
      }
    }
  }
};

template <MathMode kMode, bool kADown, bool kBDown>
using Accumulator =
    std::conditional_t<kMode == MathMode::kFma, FmaAccumulator, MmaAccumulator<kMode, kADown, kBDown>>;
template <MathMode kMode, bool kDown>
using Loader = std::conditional_t<kMode == MathMode::kFma, RegisterLoader<Traits<kMode>::kDepth, kDown>,
                                  AsyncLoader<typename Traits<kMode>::Smem, Traits<kMode>::kDepth, kDown>>;
#else
template <MathMode kMode, bool kADown, bool kBDown>
using Accumulator = FmaAccumulator;
template <MathMode kMode, bool kDown>
using Loader = RegisterLoader<Traits<kMode>::kDepth, kDown>;
#endif

// Where the block's tile starts, kept in shared memory rather than in registers through the main
// loop, which needs it once per slab: the accumulators and fragments take all but a few of a thread's
// 128 registers.
struct TileOrigin {
  const char* a;  // the block's matrices of the batch
  const char* b;
  int64_t m0, n0;
};

template <MathMode kMode>
constexpr size_t kSlabBytes = static_cast<size_t>(2 * Traits<kMode>::kStages * kSlabElems<kMode>) *
                              sizeof(typename Traits<kMode>::Smem);
// The slabs, overlapped by the epilogue's staging buffer, then the TileOrigin.
template <MathMode kMode>
constexpr size_t kOriginOffset = std::max(kSlabBytes<kMode>, static_cast<size_t>(kStageRows * kStageLd) * sizeof(float));
template <MathMode kMode>
constexpr size_t kSharedBytes = kOriginOffset<kMode> + sizeof(TileOrigin);

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
template <bool kTriangular, int kThreads>
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
  constexpr int kStages = Traits<kMode>::kStages;
  constexpr int kSlab = kSlabElems<kMode>;
  constexpr bool kAsync = kMode != MathMode::kFma;
  extern __shared__ __align__(128) unsigned char shared[];  // kSharedBytes<kMode>
  Smem* a_slabs = reinterpret_cast<Smem*>(shared);
  Smem* b_slabs = a_slabs + kStages * kSlab;
  float* staging = reinterpret_cast<float*>(shared);
  TileOrigin& origin = *reinterpret_cast<TileOrigin*>(shared + kOriginOffset<kMode>);

  // One matrix of the batch per block: grid.y * grid.z covers the batch (see launch).
  const int64_t b = static_cast<int64_t>(blockIdx.z) * gridDim.y + blockIdx.y;
  if (b >= p.batch.count) return;
  if (threadIdx.x == 0) {
    int64_t tile_row, tile_col;
    if constexpr (kTriangular) {
      lower_triangle_tile(blockIdx.x, tile_row, tile_col);
    } else {
      grouped_tile(blockIdx.x, (p.m + kTile - 1) / kTile, (p.n + kTile - 1) / kTile, tile_row, tile_col);
    }
    origin = {matrix_base(p.a, p.batch, b), matrix_base(p.b, p.batch, b), tile_row * kTile, tile_col * kTile};
  }
  __syncthreads();
  // A is read as its transpose (rows along k), B as it is.
  const auto a = [&] {
    return TileSource{origin.a, p.a.dtype, p.a.col_stride, p.a.row_stride, p.k, p.m, p.a_vectorized};
  };
  const auto bs = [&] {
    return TileSource{origin.b, p.b.dtype, p.b.row_stride, p.b.col_stride, p.k, p.n, p.b_vectorized};
  };
  // The host keeps k below 2^31 (prepare_matmul), so slab indices are int.
  const int slabs = static_cast<int>((p.k + kDepth - 1) / kDepth);
  Loader<kMode, kADown> a_loader;
  Loader<kMode, kBDown> b_loader;
  Accumulator<kMode, kADown, kBDown> acc;
  acc.zero();
  // The whole slabs of a tile inside the matrix take the interior path where the host found both
  // operands copyable by cp.async with 32-bit steps.
  int interior_slabs = 0;
  if constexpr (kAsync) {
    if (origin.m0 + kTile <= p.m && origin.n0 + kTile <= p.n && p.a_copyable && p.b_copyable) {
      interior_slabs = static_cast<int>(p.k / kDepth);
      a_loader.start_interior(a(), origin.m0);
      b_loader.start_interior(bs(), origin.n0);
    }
  }
  // Slab `slab` into buffer `stage`; the interior path is taken for slabs 0, 1, ... in order.
  const auto issue = [&](int slab, int stage) {
    Smem* a_slab = a_slabs + stage * kSlab;
    Smem* b_slab = b_slabs + stage * kSlab;
    if constexpr (kAsync) {
      if (slab < interior_slabs) {
        a_loader.issue_interior(a_slab);
        b_loader.issue_interior(b_slab);
        return;
      }
    }
    a_loader.issue(a(), static_cast<int64_t>(slab) * kDepth, origin.m0, a_slab);
    b_loader.issue(bs(), static_cast<int64_t>(slab) * kDepth, origin.n0, b_slab);
  };

  // Slab s goes to buffer s % kStages. One cp.async group is committed per slab, empty past the end,
  // so that "all but the newest kStages - 2 groups have landed" always means "slab s has".
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < slabs) {
      issue(s, s);
      a_loader.finish(a_slabs + s * kSlab);
      b_loader.finish(b_slabs + s * kSlab);
    }
    if constexpr (kAsync) ptx::cp_async_commit();
  }
  for (int s = 0; s < slabs; ++s) {
    if constexpr (kAsync) ptx::cp_async_wait<kStages - 2>();
    // Slab s is complete for every thread, and every warp is done with slab s - 1, whose buffer
    // the next slab refills.
    __syncthreads();
    const int next = s + kStages - 1, next_stage = next % kStages;
    if (next < slabs) issue(next, next_stage);
    if constexpr (kAsync) ptx::cp_async_commit();
    acc.multiply(a_slabs + s % kStages * kSlab, b_slabs + s % kStages * kSlab);
    if (next < slabs) {
      a_loader.finish(a_slabs + next_stage * kSlab);
      b_loader.finish(b_slabs + next_stage * kSlab);
    }
  }
  // Every warp is done with the slabs that the staging buffer overlaps, and (the last wait above
  // left only empty groups in flight) no copy is still landing there.
  __syncthreads();

  const int64_t m0 = origin.m0, n0 = origin.n0;
  char* out = matrix_base(p.out, p.batch, b);
  const char* y = p.y.data == nullptr ? nullptr : matrix_base(p.y, p.batch, b);
  const float alpha = scale_of(p.alpha, b), beta = scale_of(p.beta, b);
  for (int chunk = 0; chunk < kTile / kStageRows; ++chunk) {
    if (m0 + chunk * kStageRows >= p.m) break;
    acc.stage(staging, chunk);
    __syncthreads();
    store_chunk<kTriangular, kThreadsOf<kMode>>(p, staging, chunk, m0, n0, out, y, alpha, beta);
    __syncthreads();
  }
}

template <MathMode kMode, bool kTriangular, bool kADown, bool kBDown>
__global__ void __launch_bounds__(kThreadsOf<kMode>, kMinBlocks) matmul_kernel(const MatmulParams p) {
  if constexpr (kMode == MathMode::kFma || SPECTRAL_OPS_TENSOR_CORES) {
    matmul_tiles<kMode, kTriangular, kADown, kBDown>(p);
  } else {
    __trap();
  }
}

template <MathMode kMode, bool kTriangular, bool kADown, bool kBDown>
void launch(const char* op, const MatmulPlan& plan, cudaStream_t stream) {
  const MatmulParams& p = plan.params;
  const int64_t tiles_m = (p.m + kTile - 1) / kTile;
  const int64_t tiles = kTriangular ? tiles_m * (tiles_m + 1) / 2 : tiles_m * ((p.n + kTile - 1) / kTile);
  const int64_t ys = std::min(p.batch.count, kMaxGridYZ);
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(ys),
                  static_cast<unsigned>((p.batch.count + ys - 1) / ys));
  // Above 48 KiB of dynamic shared memory a kernel must opt in, per kernel (every sm_80+ GPU has room
  // for kSharedBytes).
  const auto kernel = matmul_kernel<kMode, kTriangular, kADown, kBDown>;
  SPECTRAL_OPS_CUDA_CHECK(op, cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                                                   cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                   static_cast<int>(kSharedBytes<kMode>)));
  launch_kernel(kernel, grid, kThreadsOf<kMode>, kSharedBytes<kMode>, stream, p);
}

template <MathMode kMode, bool kTriangular>
void launch_directions(const char* op, const MatmulPlan& plan, cudaStream_t stream) {
  const bool a_down = plan.params.a_down, b_down = plan.params.b_down;
  if (a_down && b_down) return launch<kMode, kTriangular, true, true>(op, plan, stream);
  if (a_down) return launch<kMode, kTriangular, true, false>(op, plan, stream);
  if (b_down) return launch<kMode, kTriangular, false, true>(op, plan, stream);
  launch<kMode, kTriangular, false, false>(op, plan, stream);
}

template <bool kTriangular>
void launch_mode(const char* op, const MatmulPlan& plan, cudaStream_t stream) {
  switch (plan.mode) {
    case MathMode::kFma: launch_directions<MathMode::kFma, kTriangular>(op, plan, stream); break;
    case MathMode::kTf32x3: launch_directions<MathMode::kTf32x3, kTriangular>(op, plan, stream); break;
    case MathMode::kTf32: launch_directions<MathMode::kTf32, kTriangular>(op, plan, stream); break;
    case MathMode::kHalf: launch_directions<MathMode::kHalf, kTriangular>(op, plan, stream); break;
    case MathMode::kBf16: launch_directions<MathMode::kBf16, kTriangular>(op, plan, stream); break;
  }
}

}  // namespace tiled
}  // namespace spectral_ops
