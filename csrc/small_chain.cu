// The per-head fused chain: out = S_p(W) for a stack of wide matrices with a small side
// r <= 128 (per-head weights, e.g. [heads, 64, 256]), one thread block per matrix from start to finish.
//
// Composed from separate products, each of the ~30 launches of a Polar Express chain covers one tile
// per matrix, so a stack of small matrices is bound by launch latency. Here the r x r Gram lives in
// shared memory and the big side streams through in 32-column chunks:
//   1. one pass over W builds G = X X^T; ||X||_F^2 is its trace; Gn = G / ||X||^2 (GramPlan's unit-norm
//      Gram, which is also the first Polar Express step's A up to the 1/1.01^2 margin);
//   2. even p: Polar Express. Per step, B = b A + c A A in place in shared memory, then one pass
//      X <- a X + B X over the chunks (an fp32 workspace in global memory, L2-resident for a head)
//      that also accumulates the next step's A = X X^T from the fresh chunk, so each step reads and
//      writes X once. Step one reads W itself, scaled by 1 / (1.01 ||X||);
//   3. p >= 2: M = Gn^(p // 2) by repeated squaring in shared memory (Gn was parked in a global
//      workspace during step 2);
//   4. a last pass writes out = ||X||^p M Z, Z = Q (even p) or X / ||X|| (odd p), staged through
//      shared memory so that the stores coalesce. A chunk is read completely before it is written,
//      and no other block touches the matrix, so out may be W itself.
// All math is fp32 FMA. Thread (ty, tx) of a 16 x 16 grid owns an R/16 x R/16 block of each R x R
// product and an R/16 x 2 block of each R x 32 chunk product (R = r rounded up to 32, 64 or 128; the
// padding is zero and stays zero).
#include <array>
#include <limits>

#include "device.cuh"
#include "ops.h"

namespace spectral_ops {
namespace {

constexpr const char* kOp = "small_chain";
constexpr int kThreads = 256;
constexpr int kChunk = 32;
// torch.finfo(torch.float32).tiny, the guard GramPlan adds to norms.
constexpr float kTiny = 1.17549435e-38f;

struct ChainCoefficients {
  int steps;
  float abc[3 * kSmallChainMaxSteps];
};

struct ChainParams {
  MatrixView w;
  MatrixView out;
  BatchShape batch;
  int64_t r, n;
  float* x_ws;  // [batch, r, n] contiguous: the Polar Express iterate (even p)
  float* g_ws;  // [batch, r, r] contiguous: Gn, parked during the iteration (even p >= 2)
  float shrink;  // 1 / the normalisation margin
  int p;
  int buffers;  // R x R shared buffers: 2 when Gn^(p // 2) needs a product besides the squarings
  bool w_rows_contiguous, out_rows_contiguous;
  ChainCoefficients coef;
};

// One r x n matrix of the batch as chunk loads and stores see it.
struct ChunkView {
  char* base;
  DType dtype;
  int64_t row_stride, col_stride;
  bool rows_contiguous;
};

template <int R>
struct Chain {
  static constexpr int kTM = R / 16;
  static constexpr int kGroup = kTM < 4 ? kTM : 4;
  static constexpr int kXcLd = kChunk + 2;  // chunk as [row][column]: the padding spreads column loads over banks
  static constexpr int kYtLd = R + 4;       // chunk as [column][row], for X X^T
  static constexpr int kChunkFloats = R * kXcLd > kChunk * kYtLd ? R * kXcLd : kChunk * kYtLd;
  static constexpr int kPerThread = R * kChunk / kThreads;
  using Square = float[kTM][kTM];
  using Block = float[kTM][2];

  __device__ static int ty() { return threadIdx.x / 16; }
  __device__ static int tx() { return threadIdx.x % 16; }
  // Row (or column) of element e of thread t's R/16 indices: groups of up to 4 consecutive ones, so
  // that shared memory is read in float4 (float2 for R = 32).
  __device__ static int index(int t, int e) { return (e / kGroup) * (16 * kGroup) + t * kGroup + e % kGroup; }

  __device__ static void load_group(const float* row, int t, float (&v)[kTM]) {
#pragma unroll
    for (int g = 0; g < kTM / kGroup; ++g) {
      const float* src = row + g * 16 * kGroup + t * kGroup;
      if constexpr (kGroup == 4) {
        const float4 q = *reinterpret_cast<const float4*>(src);
        v[4 * g] = q.x, v[4 * g + 1] = q.y, v[4 * g + 2] = q.z, v[4 * g + 3] = q.w;
      } else {
        const float2 q = *reinterpret_cast<const float2*>(src);
        v[2 * g] = q.x, v[2 * g + 1] = q.y;
      }
    }
  }

  __device__ static void store_group(float* row, int t, const float (&v)[kTM]) {
#pragma unroll
    for (int g = 0; g < kTM / kGroup; ++g) {
      float* dst = row + g * 16 * kGroup + t * kGroup;
      if constexpr (kGroup == 4) {
        *reinterpret_cast<float4*>(dst) = make_float4(v[4 * g], v[4 * g + 1], v[4 * g + 2], v[4 * g + 3]);
      } else {
        *reinterpret_cast<float2*>(dst) = make_float2(v[2 * g], v[2 * g + 1]);
      }
    }
  }

  __device__ static void zero(Square& acc) {
#pragma unroll
    for (int i = 0; i < kTM; ++i) {
#pragma unroll
      for (int j = 0; j < kTM; ++j) acc[i][j] = 0.0f;
    }
  }

  __device__ static void outer_add(Square& acc, const float (&a)[kTM], const float (&b)[kTM]) {
#pragma unroll
    for (int i = 0; i < kTM; ++i) {
#pragma unroll
      for (int j = 0; j < kTM; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
  }

  // acc = L Rm for R x R matrices with L symmetric, so that column i of L is read as its row i.
  __device__ static void square_product(const float* L, const float* Rm, Square& acc) {
    zero(acc);
#pragma unroll 2
    for (int k = 0; k < R; ++k) {
      float a[kTM], b[kTM];
      load_group(L + k * R, ty(), a);
      load_group(Rm + k * R, tx(), b);
      outer_add(acc, a, b);
    }
  }

  // acc += Y Y^T over the kChunk columns of a chunk stored as [column][row].
  __device__ static void gram_accumulate(const float* columns, Square& acc) {
#pragma unroll 2
    for (int c = 0; c < kChunk; ++c) {
      float a[kTM], b[kTM];
      load_group(columns + c * kYtLd, ty(), a);
      load_group(columns + c * kYtLd, tx(), b);
      outer_add(acc, a, b);
    }
  }

  // y = M X for symmetric M and a chunk stored as [row][column].
  __device__ static void chunk_product(const float* M, const float* rows, Block& y) {
#pragma unroll
    for (int i = 0; i < kTM; ++i) y[i][0] = y[i][1] = 0.0f;
#pragma unroll 4
    for (int k = 0; k < R; ++k) {
      float a[kTM];
      load_group(M + k * R, ty(), a);
      const float2 x = *reinterpret_cast<const float2*>(rows + k * kXcLd + tx() * 2);
#pragma unroll
      for (int i = 0; i < kTM; ++i) {
        y[i][0] = fmaf(a[i], x.x, y[i][0]);
        y[i][1] = fmaf(a[i], x.y, y[i][1]);
      }
    }
  }

  // ----- this thread's own elements of an R x R buffer (no barrier needed between them) -----

  __device__ static void write_square(float* dst, const Square& acc) {
#pragma unroll
    for (int i = 0; i < kTM; ++i) store_group(dst + index(ty(), i) * R, tx(), acc[i]);
  }

  // dst = keep * dst + add * acc
  __device__ static void combine_square(float* dst, float keep, float add, const Square& acc) {
#pragma unroll
    for (int i = 0; i < kTM; ++i) {
      float v[kTM];
      load_group(dst + index(ty(), i) * R, tx(), v);
#pragma unroll
      for (int j = 0; j < kTM; ++j) v[j] = fmaf(add, acc[i][j], keep * v[j]);
      store_group(dst + index(ty(), i) * R, tx(), v);
    }
  }

  __device__ static void copy_square(float* dst, const float* src) {
#pragma unroll
    for (int i = 0; i < kTM; ++i) {
      float v[kTM];
      load_group(src + index(ty(), i) * R, tx(), v);
      store_group(dst + index(ty(), i) * R, tx(), v);
    }
  }

  __device__ static void park_square(float* global, int64_t r, const Square& acc) {
#pragma unroll
    for (int i = 0; i < kTM; ++i) {
#pragma unroll
      for (int j = 0; j < kTM; ++j) {
        const int row = index(ty(), i), col = index(tx(), j);
        if (row < r && col < r) global[row * r + col] = acc[i][j];
      }
    }
  }

  __device__ static void unpark_square(float* dst, const float* global, int64_t r) {
#pragma unroll
    for (int i = 0; i < kTM; ++i) {
      float v[kTM];
#pragma unroll
      for (int j = 0; j < kTM; ++j) {
        const int row = index(ty(), i), col = index(tx(), j);
        v[j] = row < r && col < r ? global[row * r + col] : 0.0f;
      }
      store_group(dst + index(ty(), i) * R, tx(), v);
    }
  }

  // ----- chunks -----

  // Rows [0, R) x columns [k0, k0 + 32) of src as fp32, zero outside the r x n matrix; element (i, c)
  // lands at dst[i * ld_row + c * ld_col]. Consecutive threads walk src's unit-stride dim.
  __device__ static void load_chunk(const ChunkView& src, int64_t r, int64_t n, int64_t k0, float* dst, int ld_row,
                                    int ld_col) {
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int e = threadIdx.x + j * kThreads;
      const int i = src.rows_contiguous ? e % R : e / kChunk;
      const int c = src.rows_contiguous ? e / R : e % kChunk;
      const int64_t col = k0 + c;
      dst[i * ld_row + c * ld_col] =
          i < r && col < n ? load_as_float(src.base, src.dtype, i * src.row_stride + col * src.col_stride) : 0.0f;
    }
  }

  // out = the staged chunk, in out's coalescing order.
  __device__ static void store_chunk(const ChunkView& out, int64_t r, int64_t n, int64_t k0, const float* rows) {
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int e = threadIdx.x + j * kThreads;
      const int i = out.rows_contiguous ? e % R : e / kChunk;
      const int c = out.rows_contiguous ? e / R : e % kChunk;
      const int64_t col = k0 + c;
      if (i >= r || col >= n) continue;
      store_from_float(out.base, out.dtype, i * out.row_stride + col * out.col_stride, rows[i * kXcLd + c]);
    }
  }

  __device__ static void read_own(const float* rows, Block& y) {
#pragma unroll
    for (int i = 0; i < kTM; ++i) {
      const float2 x = *reinterpret_cast<const float2*>(rows + index(ty(), i) * kXcLd + tx() * 2);
      y[i][0] = x.x;
      y[i][1] = x.y;
    }
  }

  // y = scale_y * y + scale_x * (this thread's elements of the chunk)
  __device__ static void add_own(const float* rows, float scale_y, float scale_x, Block& y) {
    Block x;
    read_own(rows, x);
#pragma unroll
    for (int i = 0; i < kTM; ++i) {
#pragma unroll
      for (int q = 0; q < 2; ++q) y[i][q] = fmaf(scale_x, x[i][q], scale_y * y[i][q]);
    }
  }

  __device__ static void write_own(float* rows, float scale, const Block& y) {
#pragma unroll
    for (int i = 0; i < kTM; ++i) {
      *reinterpret_cast<float2*>(rows + index(ty(), i) * kXcLd + tx() * 2) = make_float2(scale * y[i][0], scale * y[i][1]);
    }
  }

  __device__ static void write_own_columns(float* columns, const Block& y) {
#pragma unroll
    for (int i = 0; i < kTM; ++i) {
#pragma unroll
      for (int q = 0; q < 2; ++q) columns[(tx() * 2 + q) * kYtLd + index(ty(), i)] = y[i][q];
    }
  }

  __device__ static void store_own(float* x_ws, int64_t r, int64_t n, int64_t k0, const Block& y) {
#pragma unroll
    for (int i = 0; i < kTM; ++i) {
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int row = index(ty(), i);
        const int64_t col = k0 + tx() * 2 + q;
        if (row < r && col < n) x_ws[row * n + col] = y[i][q];
      }
    }
  }

  // Polar Express from X0 = W * s0 (s0 = shrink / ||X||); `square` holds Gn on entry. Leaves Q in x_ws.
  __device__ static void polar(const ChainParams& p, float* square, float* chunk, const ChunkView& w,
                               const ChunkView& x, float* x_ws, float s0) {
    for (int t = 0; t < p.coef.steps; ++t) {
      const float a = p.coef.abc[3 * t];
      float b = p.coef.abc[3 * t + 1], c = p.coef.abc[3 * t + 2];
      if (t == 0) {  // A0 = shrink^2 Gn, folded into the coefficients
        b *= p.shrink * p.shrink;
        c *= p.shrink * p.shrink * p.shrink * p.shrink;
      }
      Square acc;
      square_product(square, square, acc);
      __syncthreads();
      combine_square(square, b, c, acc);  // B = b A + c A A
      __syncthreads();

      const bool gram_next = t + 1 < p.coef.steps;
      zero(acc);
      const float scale_y = t == 0 ? s0 : 1.0f;
      const ChunkView src = t == 0 ? w : x;
      for (int64_t k0 = 0; k0 < p.n; k0 += kChunk) {
        load_chunk(src, p.r, p.n, k0, chunk, kXcLd, 1);
        __syncthreads();
        Block y;
        chunk_product(square, chunk, y);
        add_own(chunk, scale_y, a * scale_y, y);
        store_own(x_ws, p.r, p.n, k0, y);
        if (gram_next) {
          __syncthreads();
          write_own_columns(chunk, y);
          __syncthreads();
          gram_accumulate(chunk, acc);
        }
        __syncthreads();
      }
      if (gram_next) {
        write_square(square, acc);
        __syncthreads();
      }
    }
  }

  // Gn^k by repeated squaring; `square` holds Gn and is squared in place. Returns the buffer with
  // the result (`spare` when k has more than one bit set).
  __device__ static const float* gram_power(float* square, float* spare, int k) {
    float* result = nullptr;
    Square acc;
    for (int bits = k;;) {
      if (bits & 1) {
        if (result == nullptr) {
          result = square;
        } else {
          square_product(result, square, acc);
          __syncthreads();
          write_square(result, acc);
          __syncthreads();
        }
      }
      bits >>= 1;
      if (bits == 0) break;
      if (result == square) {  // keep the partial product before squaring over it
        copy_square(spare, square);
        result = spare;
      }
      square_product(square, square, acc);
      __syncthreads();
      write_square(square, acc);
      __syncthreads();
    }
    return result;
  }
};

__device__ __forceinline__ float integer_power(float x, int p) {
  float result = 1.0f;
  for (; p > 0; p >>= 1, x *= x) {
    if (p & 1) result *= x;
  }
  return result;
}

template <int R>
__global__ void __launch_bounds__(kThreads) small_chain_kernel(const ChainParams p) {
  using C = Chain<R>;
  extern __shared__ __align__(16) float shared[];
  float* square = shared;
  float* spare = shared + R * R;
  float* chunk = shared + p.buffers * R * R;
  float* trace = chunk + C::kChunkFloats;
  const int64_t b = blockIdx.x;
  const ChunkView w{matrix_base(p.w, p.batch, b), p.w.dtype, p.w.row_stride, p.w.col_stride, p.w_rows_contiguous};
  const ChunkView out{matrix_base(p.out, p.batch, b), p.out.dtype, p.out.row_stride, p.out.col_stride,
                      p.out_rows_contiguous};
  const bool even = p.p % 2 == 0;
  const int k = p.p / 2;
  float* x_ws = even ? p.x_ws + b * p.r * p.n : nullptr;
  const ChunkView x{reinterpret_cast<char*>(x_ws), DType::kFloat32, p.n, 1, false};

  // 1. G = X X^T and ||X||_F^2 = trace(G), then Gn.
  typename C::Square acc;
  C::zero(acc);
  for (int64_t k0 = 0; k0 < p.n; k0 += kChunk) {
    C::load_chunk(w, p.r, p.n, k0, chunk, 1, C::kYtLd);
    __syncthreads();
    C::gram_accumulate(chunk, acc);
    __syncthreads();
  }
  C::write_square(square, acc);
  __syncthreads();
  // Once per matrix; R additions by one thread are noise next to the passes over W.
  if (threadIdx.x == 0) {
    float sum = 0.0f;
    for (int i = 0; i < R; ++i) sum += square[i * R + i];
    *trace = sum;
  }
  __syncthreads();
  const float norm_sq = *trace;
  const float norm = sqrtf(norm_sq);
  const float inv = 1.0f / (norm + kTiny);
  // norm_sq + tiny, not inv^2: for a zero matrix inv^2 overflows and 0 * inf is NaN.
  const float gram_scale = 1.0f / (norm_sq + kTiny);
#pragma unroll
  for (int i = 0; i < C::kTM; ++i) {
#pragma unroll
    for (int j = 0; j < C::kTM; ++j) acc[i][j] *= gram_scale;
  }
  C::write_square(square, acc);
  if (even && k > 0) C::park_square(p.g_ws + b * p.r * p.r, p.r, acc);
  __syncthreads();

  // 2. The polar factor, for even p.
  if (even) {
    C::polar(p, square, chunk, w, x, x_ws, inv * p.shrink);
    if (k > 0) {
      C::unpark_square(square, p.g_ws + b * p.r * p.r, p.r);
      __syncthreads();
    }
  }

  // 3. M = Gn^k.
  const float* m = k > 0 ? C::gram_power(square, spare, k) : nullptr;

  // 4. out = ||X||^p M Z.
  float factor = integer_power(norm, p.p);
  if (!even) factor *= inv;
  const ChunkView z = even ? x : w;
  for (int64_t k0 = 0; k0 < p.n; k0 += kChunk) {
    C::load_chunk(z, p.r, p.n, k0, chunk, C::kXcLd, 1);
    __syncthreads();
    typename C::Block y;
    if (m != nullptr) {
      C::chunk_product(m, chunk, y);
    } else {
      C::read_own(chunk, y);
    }
    __syncthreads();
    C::write_own(chunk, factor, y);
    __syncthreads();
    C::store_chunk(out, p.r, p.n, k0, chunk);
    __syncthreads();
  }
}

int padded_side(int64_t r) { return r <= 32 ? 32 : r <= 64 ? 64 : 128; }

int square_buffers(int p) { return __builtin_popcount(static_cast<unsigned>(p / 2)) >= 2 ? 2 : 1; }

template <int R>
size_t shared_bytes_for(int p) {
  return (static_cast<size_t>(square_buffers(p)) * R * R + Chain<R>::kChunkFloats + 1) * sizeof(float);
}

// A row-major mapping coalesces for unit column stride; the column walk for the transposed view of
// a tall weight.
bool rows_contiguous(const TensorDesc& t) { return t.strides[t.ndim() - 2] == 1 && t.strides[t.ndim() - 1] != 1; }

void check_workspace(const TensorDesc* ws, const char* name, const std::vector<int64_t>& shape,
                     const TensorDesc& w) {
  if (ws == nullptr) {
    throw std::invalid_argument(std::string(name) + " is required for this p (a float32 tensor of shape " +
                                format_dims(shape) + ")");
  }
  check_dtype(*ws, {DType::kFloat32}, "workspaces are float32");
  check_same_device(w, *ws);
  if (ws->shape != shape) {
    throw std::invalid_argument(ws->describe() + ": expected shape " + format_dims(shape));
  }
  check_contiguous(*ws);
}

template <int R>
void launch(const ChainParams& params, size_t bytes, cudaStream_t stream) {
  // Above 48 KiB of dynamic shared memory a kernel must opt in, per kernel.
  SPECTRAL_OPS_CUDA_CHECK(kOp, cudaFuncSetAttribute(reinterpret_cast<const void*>(&small_chain_kernel<R>),
                                                    cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                    static_cast<int>(bytes)));
  launch_kernel(small_chain_kernel<R>, static_cast<unsigned>(params.batch.count), kThreads, bytes, stream, params);
}

}  // namespace

size_t small_chain_shared_bytes(int64_t r, int p) {
  switch (padded_side(r)) {
    case 32: return shared_bytes_for<32>(p);
    case 64: return shared_bytes_for<64>(p);
    default: return shared_bytes_for<128>(p);
  }
}

void small_chain(const TensorDesc& w, const TensorDesc& out, const TensorDesc* x_ws, const TensorDesc* g_ws, int p,
                 const std::vector<std::array<double, 3>>& coefficients, double shrink, cudaStream_t stream) {
  constexpr const char* kDtypes = "use float32, float16 or bfloat16 (float64 is left to torch)";
  check_matrix_dims(w);
  check_dtype(w, {DType::kFloat32, DType::kFloat16, DType::kBFloat16}, kDtypes);
  check_dtype(out, {DType::kFloat32, DType::kFloat16, DType::kBFloat16}, kDtypes);
  if (out.shape != w.shape) {
    throw std::invalid_argument("shape mismatch: w has shape " + format_dims(w.shape) + " but out has shape " +
                                format_dims(out.shape));
  }
  const int64_t r = rows_of(w), n = cols_of(w);
  if (r > kSmallChainMaxSide) {
    throw std::invalid_argument(w.describe() + ": the small side (rows, in the wide orientation) is " +
                                std::to_string(r) + "; the chain takes at most " +
                                std::to_string(kSmallChainMaxSide));
  }
  if (p < 0) throw std::invalid_argument("p must be a non-negative integer, got " + std::to_string(p));
  const bool even = p % 2 == 0;
  if (coefficients.size() > static_cast<size_t>(kSmallChainMaxSteps) || (even && coefficients.empty())) {
    throw std::invalid_argument("the chain takes 1 to " + std::to_string(kSmallChainMaxSteps) +
                                " Polar Express steps (an even p needs at least one), got " +
                                std::to_string(coefficients.size()));
  }
  ChainParams params{};
  params.coef.steps = static_cast<int>(coefficients.size());
  for (size_t t = 0; t < coefficients.size(); ++t) {
    for (int j = 0; j < 3; ++j) {
      const float value = static_cast<float>(coefficients[t][j]);
      if (!std::isfinite(value)) {
        throw std::invalid_argument("Polar Express coefficient " + std::to_string(coefficients[t][j]) + " of step " +
                                    std::to_string(t) + " is not a finite float32 number");
      }
      params.coef.abc[3 * t + j] = value;
    }
  }
  if (!(shrink > 0.0 && shrink <= 1.0)) {
    throw std::invalid_argument("shrink must be in (0, 1], got " + std::to_string(shrink));
  }
  check_same_device(w, out);
  check_no_overlap(out);
  if (!same_view(out, w)) check_disjoint(out, w);
  std::vector<int64_t> r_by_r = batch_dims(w);
  r_by_r.push_back(r);
  r_by_r.push_back(r);
  if (even) {
    check_workspace(x_ws, "x_workspace", w.shape, w);
    for (const TensorDesc* t : {&w, &out}) check_disjoint(*x_ws, *t);
  }
  if (even && p >= 2) {
    check_workspace(g_ws, "gram_workspace", r_by_r, w);
    for (const TensorDesc* t : {&w, &out, x_ws}) check_disjoint(*g_ws, *t);
  }
  const std::vector<int> positions = batch_positions(w);
  params.batch = make_batch(w, positions);
  if (params.batch.count > std::numeric_limits<int32_t>::max()) {
    throw std::invalid_argument(w.describe() + ": more matrices than one launch can take (2^31 - 1)");
  }
  params.w = make_view(w, positions);
  params.out = make_view(out, positions);
  params.r = r;
  params.n = n;
  params.x_ws = even ? x_ws->ptr<float>() : nullptr;
  params.g_ws = even && p >= 2 ? g_ws->ptr<float>() : nullptr;
  params.shrink = static_cast<float>(shrink);
  params.p = p;
  params.buffers = square_buffers(p);
  params.w_rows_contiguous = rows_contiguous(w);
  params.out_rows_contiguous = rows_contiguous(out);

  require_device(kOp, w.device);
  if (params.batch.count == 0 || r == 0 || n == 0) return;
  DeviceGuard guard(kOp, w.device);
  const size_t bytes = small_chain_shared_bytes(r, p);
  int available = 0;
  SPECTRAL_OPS_CUDA_CHECK(kOp, cudaDeviceGetAttribute(&available, cudaDevAttrMaxSharedMemoryPerBlockOptin, w.device));
  if (bytes > static_cast<size_t>(available)) {
    throw std::runtime_error("spectral_ops._C.small_chain: r = " + std::to_string(r) + ", p = " + std::to_string(p) +
                             " needs " + std::to_string(bytes) + " bytes of shared memory per block; " +
                             format_device(w.device) + " allows " + std::to_string(available));
  }
  switch (padded_side(r)) {
    case 32: launch<32>(params, bytes, stream); break;
    case 64: launch<64>(params, bytes, stream); break;
    default: launch<128>(params, bytes, stream); break;
  }
  SPECTRAL_OPS_CUDA_CHECK(kOp, cudaGetLastError());
}

}  // namespace spectral_ops
