// The execution model and the CUDA runtime, emulated on the CPU (see prelude.h).
#include <ucontext.h>

#include <algorithm>
#include <cstdlib>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

uint3 threadIdx;
uint3 blockIdx;
dim3 blockDim;
dim3 gridDim;

// Dynamic shared memory of the tiled kernels (csrc/tiled_matmul.cuh declares it `extern __shared__`).
namespace spectral_ops {
namespace tiled {
alignas(128) unsigned char shared[1 << 18];
}  // namespace tiled
}  // namespace spectral_ops

namespace emulation {
namespace {

constexpr size_t kStackBytes = 256 * 1024;

struct Fiber {
  ucontext_t context;
  std::vector<char> stack;
  uint3 index;
  bool done;
  size_t collective_calls;  // warp_collective calls made in the current block
};

struct Collective {
  double check;
  std::vector<float> result;
};
std::vector<std::vector<Collective>> warp_collectives;  // per warp of the current block, by call index

ucontext_t scheduler;
std::vector<Fiber> fibers;
size_t current = 0;
const std::function<void()>* body = nullptr;
uint64_t launches = 0;

void trampoline() {
  (*body)();
  fibers[current].done = true;
  swapcontext(&fibers[current].context, &scheduler);
}

// SPECTRAL_OPS_EMULATION_ORDER: 0 runs the threads of a phase in index order; any other value shuffles
// them, differently per phase, launch and seed. Results that depend on it reveal a missing barrier.
uint64_t order_seed() {
  const char* value = std::getenv("SPECTRAL_OPS_EMULATION_ORDER");
  return value == nullptr ? 0 : std::strtoull(value, nullptr, 10);
}

}  // namespace

void syncthreads() { swapcontext(&fibers[current].context, &scheduler); }

const float* warp_collective(size_t size, double check, const std::function<void(float*)>& compute) {
  std::vector<Collective>& calls = warp_collectives[current / 32];
  const size_t call = fibers[current].collective_calls++;
  if (call == calls.size()) {
    calls.push_back({check, std::vector<float>(size)});
    compute(calls.back().result.data());
  } else if (calls[call].check != check) {
    throw std::runtime_error("emulation: the lanes of a warp passed different operands to one WMMA call");
  }
  return calls[call].result.data();
}

void run(dim3 grid, dim3 block, const std::function<void()>& kernel) {
  const size_t threads = static_cast<size_t>(block.x) * block.y * block.z;
  if (fibers.size() < threads) fibers.resize(threads);
  const uint64_t seed = order_seed();
  std::mt19937_64 random(seed * 1000003u + launches++);
  std::vector<size_t> order(threads);
  body = &kernel;
  gridDim = grid;
  blockDim = block;
  for (unsigned z = 0; z < grid.z; ++z) {
    for (unsigned y = 0; y < grid.y; ++y) {
      for (unsigned x = 0; x < grid.x; ++x) {
        blockIdx = make_uint3(x, y, z);
        for (size_t t = 0; t < threads; ++t) {
          Fiber& f = fibers[t];
          f.stack.resize(kStackBytes);
          getcontext(&f.context);
          f.context.uc_stack.ss_sp = f.stack.data();
          f.context.uc_stack.ss_size = f.stack.size();
          f.context.uc_link = nullptr;
          makecontext(&f.context, trampoline, 0);
          f.index = make_uint3(static_cast<unsigned>(t % block.x), static_cast<unsigned>(t / block.x % block.y),
                               static_cast<unsigned>(t / (block.x * block.y)));
          f.done = false;
          f.collective_calls = 0;
        }
        warp_collectives.assign((threads + 31) / 32, {});
        for (;;) {
          std::iota(order.begin(), order.end(), size_t{0});
          if (seed != 0) std::shuffle(order.begin(), order.end(), random);
          for (size_t t : order) {
            current = t;
            threadIdx = fibers[t].index;
            swapcontext(&scheduler, &fibers[t].context);
          }
          const size_t done = std::count_if(fibers.begin(), fibers.begin() + threads, [](const Fiber& f) { return f.done; });
          if (done == threads) break;
          if (done != 0) throw std::runtime_error("emulation: some threads of a block left while others wait at a barrier");
        }
      }
    }
  }
}

}  // namespace emulation

// The runtime calls csrc/ makes, answered as by one device with an H100's shared memory.
extern "C" {

cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int) { return cudaSuccess; }
cudaError_t cudaGetLastError() { return cudaSuccess; }
cudaError_t cudaDriverGetVersion(int* version) {
  *version = CUDART_VERSION;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attribute, int) {
  switch (attribute) {
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = 232448; break;
    case cudaDevAttrComputeCapabilityMajor: *value = 9; break;
    default: *value = 0; break;
  }
  return cudaSuccess;
}
cudaError_t cudaFuncSetAttribute(const void*, cudaFuncAttribute, int) { return cudaSuccess; }
const char* cudaGetErrorName(cudaError_t) { return "cudaErrorEmulation"; }
const char* cudaGetErrorString(cudaError_t) { return "emulated runtime error"; }
}
