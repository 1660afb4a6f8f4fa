// The execution model and the CUDA runtime, emulated on the CPU (see prelude.h).
#include <setjmp.h>
#include <ucontext.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
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
constexpr size_t kWarp = 32;

// Where a fiber handed control back in the current phase.
enum class Stop { kBarrier, kExchange };

struct AsyncCopy {
  void* dst;
  const void* src;
  size_t bytes;
  size_t src_bytes;  // the rest of `bytes` is zero-filled
};

// A fiber starts on its own stack through makecontext/setcontext; after that, switches use
// _setjmp/_longjmp, which unlike swapcontext leave the signal mask alone and so make no system call.
struct Fiber {
  ucontext_t context;
  jmp_buf jump;
  bool started;
  std::vector<char> stack;
  uint3 index;
  bool done;
  Stop stop;
  size_t exchanges;  // warp_exchange calls made in the current block
  std::vector<AsyncCopy> uncommitted;
  std::deque<std::vector<AsyncCopy>> groups;  // committed, oldest first
};

// The deposits of one warp exchange. All lanes of a warp make their n-th exchange in the same phase
// and read it back at the start of the next, where a lane that has read may already deposit its
// (n + 1)-th: two slots, by call parity, keep the two apart.
struct Exchange {
  size_t call = SIZE_MAX;
  size_t bytes = 0;
  size_t deposits = 0;
  std::vector<unsigned char> data;
};
std::vector<std::array<Exchange, 2>> exchanges;  // per warp of the current block

jmp_buf scheduler;
std::vector<Fiber> fibers;
size_t threads = 0;
size_t current = 0;
const std::function<void()>* body = nullptr;
uint64_t launches = 0;
std::string failure;  // set by a fiber that cannot go on, thrown by run()

void yield(Stop stop) {
  Fiber& f = fibers[current];
  f.stop = stop;
  if (_setjmp(f.jump) == 0) _longjmp(scheduler, 1);
}

// Runs `f` up to its next stop.
void resume(Fiber& f) {
  if (_setjmp(scheduler) != 0) return;
  if (!f.started) {
    f.started = true;
    setcontext(&f.context);
  }
  _longjmp(f.jump, 1);
}

// Ends the launch with `message`: the fiber is never resumed, and run() throws.
[[noreturn]] void fail(std::string message) {
  failure = std::move(message);
  _longjmp(scheduler, 1);
}

void trampoline() {
  (*body)();
  Fiber& f = fibers[current];
  bool waited = f.uncommitted.empty();
  for (const std::vector<AsyncCopy>& group : f.groups) waited = waited && group.empty();
  if (!waited) fail("emulation: a thread ended with a cp.async copy that no cp.async.wait_group waited for");
  f.done = true;
  _longjmp(scheduler, 1);
}

// SPECTRAL_OPS_EMULATION_ORDER: 0 runs the threads of a phase in index order; any other value shuffles
// them, differently per phase, launch and seed. Results that depend on it reveal a missing barrier.
uint64_t order_seed() {
  const char* value = std::getenv("SPECTRAL_OPS_EMULATION_ORDER");
  return value == nullptr ? 0 : std::strtoull(value, nullptr, 10);
}

size_t lanes_of_warp(size_t warp) { return std::min(kWarp, threads - warp * kWarp); }

// After a phase: every thread has left, or every thread waits at the same kind of point.
void check_phase() {
  size_t done = 0, barriers = 0;
  for (size_t t = 0; t < threads; ++t) {
    done += fibers[t].done;
    barriers += !fibers[t].done && fibers[t].stop == Stop::kBarrier;
  }
  if (done != 0 && done != threads) {
    throw std::runtime_error("emulation: some threads of a block left while others wait at a barrier or warp exchange");
  }
  if (barriers != 0 && barriers != threads - done) {
    throw std::runtime_error(
        "emulation: in one phase some threads of a block wait at __syncthreads() and others at a warp exchange "
        "(ldmatrix, mma.sync); the emulation needs every thread to run the same sequence of the two");
  }
}

// The byte spans [begin, end) the kernels may access in global memory, set by a test; empty: unchecked.
std::vector<std::pair<uintptr_t, uintptr_t>> allowed_spans;

}  // namespace

void check_global(const void* p, size_t bytes) {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p), end = begin + bytes;
  if (allowed_spans.empty() || bytes == 0) return;
  for (const auto& [first, last] : allowed_spans) {
    if (first <= begin && end <= last) return;
  }
  char where[96];
  std::snprintf(where, sizeof where, "%zu bytes at 0x%llx", bytes, static_cast<unsigned long long>(begin));
  fail(std::string("emulation: global access outside every tensor of the launch: ") + where + " (block " +
       std::to_string(blockIdx.x) + "," + std::to_string(blockIdx.y) + "," + std::to_string(blockIdx.z) +
       ", thread " + std::to_string(threadIdx.x) + ")");
}

void syncthreads() { yield(Stop::kBarrier); }

const void* warp_exchange(const void* mine, size_t bytes) {
  Fiber& f = fibers[current];
  const size_t call = f.exchanges++;
  Exchange& x = exchanges[current / kWarp][call % 2];
  if (x.call != call) {
    x.call = call;
    x.bytes = bytes;
    x.deposits = 0;
    x.data.resize(kWarp * bytes);
  } else if (x.bytes != bytes) {
    fail("emulation: the lanes of a warp passed operands of different sizes to one warp exchange");
  }
  std::memcpy(x.data.data() + current % kWarp * bytes, mine, bytes);
  ++x.deposits;
  yield(Stop::kExchange);
  if (x.deposits != lanes_of_warp(current / kWarp)) {
    fail("emulation: not every lane of a warp reached a warp exchange");
  }
  return x.data.data();
}

void cp_async(void* dst, const void* src, size_t bytes, size_t src_bytes) {
  check_global(src, std::min(src_bytes, bytes));
  fibers[current].uncommitted.push_back({dst, src, bytes, std::min(src_bytes, bytes)});
}

void cp_async_commit() {
  Fiber& f = fibers[current];
  f.groups.push_back(std::move(f.uncommitted));
  f.uncommitted.clear();
}

void cp_async_wait(size_t pending) {
  Fiber& f = fibers[current];
  for (; f.groups.size() > pending; f.groups.pop_front()) {
    for (const AsyncCopy& c : f.groups.front()) {
      std::memcpy(c.dst, c.src, c.src_bytes);
      std::memset(static_cast<char*>(c.dst) + c.src_bytes, 0, c.bytes - c.src_bytes);
    }
  }
}

void run(dim3 grid, dim3 block, const std::function<void()>& kernel) {
  threads = static_cast<size_t>(block.x) * block.y * block.z;
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
          f.started = false;
          f.done = false;
          f.exchanges = 0;
          f.uncommitted.clear();
          f.groups.clear();
        }
        exchanges.assign((threads + kWarp - 1) / kWarp, {});
        for (;;) {
          std::iota(order.begin(), order.end(), size_t{0});
          if (seed != 0) std::shuffle(order.begin(), order.end(), random);
          for (size_t t : order) {
            current = t;
            threadIdx = fibers[t].index;
            resume(fibers[t]);
            if (!failure.empty()) throw std::runtime_error(std::exchange(failure, {}));
          }
          check_phase();
          if (fibers[0].done) break;
        }
      }
    }
  }
}

}  // namespace emulation

// The runtime calls csrc/ makes, answered as by one device with an H100's shared memory; and the
// bounds check's spans, set by the tests through ctypes.
extern "C" {

void spectral_ops_emulation_allow(uintptr_t begin, uintptr_t end) { emulation::allowed_spans.emplace_back(begin, end); }
void spectral_ops_emulation_allow_none() { emulation::allowed_spans.clear(); }

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
