// Checks of the emulation itself, built with runtime.cpp into an executable by build.selftest() and
// run by tests/test_cuda_emulation.py: the PTX semantics that csrc/mma_ptx.cuh documents, the
// cp.async model (a copy lands at its wait, not before), and the runtime's refusal of a block whose
// threads stop at different kinds of collectives. Prints one line per failed check; exit status 1 if any.
#include <cstdio>
#include <stdexcept>
#include <string>

#include "mma_ptx.cuh"

namespace spectral_ops {
namespace tiled {
extern unsigned char shared[];  // runtime.cpp
}  // namespace tiled
}  // namespace spectral_ops

namespace {

namespace ptx = spectral_ops::ptx;
unsigned char* const shared = spectral_ops::tiled::shared;
int failures = 0;

void check(bool ok, const std::string& what) {
  if (!ok) {
    std::printf("FAIL %s\n", what.c_str());
    ++failures;
  }
}

// 16-bit element (row, col) of a 16 x 16 matrix, as its code row * 16 + col.
uint16_t code(int row, int col) { return static_cast<uint16_t>(row * 16 + col); }

// Lane l of ldmatrix.x4 gets, of matrix i, row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1, or with
// .trans column l / 4, rows 2 (l % 4) and 2 (l % 4) + 1; matrix i is the 8 x 8 block whose rows lanes
// 8 i to 8 i + 7 address. Here lane l addresses row l % 8 of block (l / 8 % 2, l / 16) of a 16 x 16
// row-major matrix of codes.
void check_ldmatrix() {
  uint16_t* m = reinterpret_cast<uint16_t*>(shared);
  for (int r = 0; r < 16; ++r) {
    for (int c = 0; c < 16; ++c) m[r * 16 + c] = code(r, c);
  }
  uint32_t got[2][32][4];
  spectral_ops::launch_kernel(
      +[](uint32_t (*out)[32][4]) {
        const int l = ptx::lane();
        const uint16_t* row = reinterpret_cast<const uint16_t*>(shared) + (l % 8 + l / 8 % 2 * 8) * 16 + l / 16 * 8;
        ptx::ldmatrix_x4<false>(out[0][l], row);
        ptx::ldmatrix_x4<true>(out[1][l], row);
      },
      dim3(1), dim3(32), 0, nullptr, got);
  for (int l = 0; l < 32; ++l) {
    for (int i = 0; i < 4; ++i) {
      const int r0 = i % 2 * 8, c0 = i / 2 * 8;
      const uint32_t plain = code(r0 + l / 4, c0 + 2 * (l % 4)) | code(r0 + l / 4, c0 + 2 * (l % 4) + 1) << 16;
      const uint32_t trans = code(r0 + 2 * (l % 4), c0 + l / 4) | code(r0 + 2 * (l % 4) + 1, c0 + l / 4) << 16;
      check(got[0][l][i] == plain, "ldmatrix lane " + std::to_string(l) + " matrix " + std::to_string(i));
      check(got[1][l][i] == trans, "ldmatrix.trans lane " + std::to_string(l) + " matrix " + std::to_string(i));
    }
  }
}

// A copy is performed at the wait that covers its group, not at a barrier; groups land oldest first.
void check_async_copies() {
  static int source[2] = {7, 9};
  int seen[4] = {};
  int* value = reinterpret_cast<int*>(shared);
  value[0] = value[1] = value[4] = -1;
  spectral_ops::launch_kernel(
      +[](int* seen) {
        int* value = reinterpret_cast<int*>(shared);
        if (threadIdx.x == 0) {
          ptx::cp_async_16(value, source, 4);  // 4 bytes copied, 12 zero-filled
          ptx::cp_async_commit();
          ptx::cp_async_16(value + 4, source + 1, 4);
          ptx::cp_async_commit();
        }
        __syncthreads();
        if (threadIdx.x == 1) seen[0] = value[0];
        __syncthreads();
        if (threadIdx.x == 0) ptx::cp_async_wait<1>();
        __syncthreads();
        if (threadIdx.x == 1) seen[1] = value[0], seen[2] = value[1], seen[3] = value[4];
        __syncthreads();
        if (threadIdx.x == 0) ptx::cp_async_wait<0>();
      },
      dim3(1), dim3(32), 0, nullptr, seen);
  check(seen[0] == -1, "a copy landed before its wait");
  check(seen[1] == 7 && seen[2] == 0, "cp.async.wait_group 1 did not land the older group, zero-filled");
  check(seen[3] == -1, "cp.async.wait_group 1 landed the newest group");
}

void check_mismatch_is_refused() {
  std::string error;
  try {
    spectral_ops::launch_kernel(
        +[] {
          uint32_t r[4];
          if (threadIdx.x < 32) {
            ptx::ldmatrix_x4<false>(r, shared);
          } else {
            __syncthreads();
          }
        },
        dim3(1), dim3(64), 0, nullptr);
  } catch (const std::runtime_error& e) {
    error = e.what();
  }
  check(error.find("__syncthreads() and others at a warp exchange") != std::string::npos,
        "a block mixing a barrier and a warp exchange in one phase was not refused: '" + error + "'");
}

}  // namespace

int main() {
  check_ldmatrix();
  check_async_copies();
  check_mismatch_is_refused();
  return failures == 0 ? 0 : 1;
}
