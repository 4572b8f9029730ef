// What a chain of dependent memory steps costs inside one kernel timed the way `epcomm bench`
// times an op: CUDA events around the launch, the L2 flushed (a 256 MiB memset) right before
// the start event. A low-latency op is such a chain (its sequence state, the routing, the rows,
// the publication, the wait for the peers, the counts, the packing: docs/low-latency.md), so
// the cost of one step bounds from below what an op of N steps can take. Cases, each for
// k = 0, 1, 2, 4, 8 and 16 steps, in a kernel of --blocks blocks of --threads threads:
//
//   chase   block 0's thread 0 follows k pointers through memory the flush evicted (each load's
//           address is the previous load's value): k DRAM round trips, nothing else
//   relay   blocks 0..k-1 in a line: block i waits (acquire load, polled) for its flag, then
//           stores (release) the next block's flag; block 0 starts at once. Each step is a
//           publication seen by a waiter on another SM: the shape of "publish, then the peer's
//           wait ends". The flags start out of L2 (flushed)
//   fenced  block 0's thread 0 makes k (store, then __threadfence) pairs: a release fence per
//           step, as a publication after the rows takes
//
// For each case it prints the median over --iters calls of every k, in microseconds, and the
// least-squares slope (us per step) and intercept. Build and run (any CUDA 12/13 toolkit):
//
//   nvcc -O3 -arch=sm_90 -cudart static -o round_trips benches/floor/round_trips.cu
//   ./round_trips --blocks 132 --threads 512 --iters 200
//
// It measures the GPU, not epcomm: docs/benchmarks.md compares it with the low-latency ops.
#include <cuda_runtime.h>

#include "check.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

constexpr size_t kFlushBytes = 256ull << 20;
constexpr size_t kChaseBytes = 64ull << 20;
// One pointer per 4 KiB page of the chase buffer, visited in a shuffled order.
constexpr size_t kChaseStride = 4096 / sizeof(unsigned long long);
// Each flag on a line of its own.
constexpr int kFlagStride = 32;
constexpr int kSteps[] = {0, 1, 2, 4, 8, 16};

__device__ __forceinline__ unsigned int ld_acquire(const unsigned int* p) {
  unsigned int v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release(unsigned int* p, unsigned int v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// `sink[0]` gets the chase's last value when it is a value no pointer has (never): keeps the
// loads alive.
__global__ void chase_kernel(const unsigned long long* start, int k, unsigned long long* sink) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  const unsigned long long* p = start;
  for (int i = 0; i < k; ++i)
    p = reinterpret_cast<const unsigned long long*>(*reinterpret_cast<const volatile unsigned long long*>(p));
  if (reinterpret_cast<unsigned long long>(p) == 1ull) sink[0] = 1;
}

// Flags are epoch-tagged: call `epoch` waits for the value `epoch`, so nothing is reset between
// calls. A wait gives up after one second of the GPU clock and sets `sink[1]`.
__global__ void relay_kernel(unsigned int* flags, int k, unsigned int epoch,
                             unsigned long long* sink) {
  const int b = blockIdx.x;
  if (b >= k || threadIdx.x != 0) return;
  if (b > 0) {
    const unsigned int* mine = flags + b * kFlagStride;
    const unsigned long long t0 = now_ns();
    while (ld_acquire(mine) < epoch) {
      if (now_ns() - t0 > 1000000000ull) {
        atomicExch(sink + 1, 1ull);
        return;
      }
    }
  }
  st_release(flags + (b + 1) * kFlagStride, epoch);
}

__global__ void fenced_kernel(unsigned int* words, int k, unsigned int epoch, unsigned long long*) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  for (int i = 0; i < k; ++i) {
    *reinterpret_cast<volatile unsigned int*>(words + i * kFlagStride) = epoch;
    __threadfence();
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

struct Args {
  int blocks = 132, threads = 512, iters = 200;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const int v = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--blocks")) a.blocks = v;
    else if (!std::strcmp(argv[i], "--threads")) a.threads = v;
    else if (!std::strcmp(argv[i], "--iters")) a.iters = v;
    else {
      std::fprintf(stderr, "unknown flag %s (--blocks, --threads, --iters)\n", argv[i]);
      std::exit(2);
    }
  }
  if (a.blocks < 16 || a.threads < 32 || a.iters < 1) {
    std::fprintf(stderr, "need --blocks >= 16 (the relay's longest line), --threads >= 32, --iters >= 1\n");
    std::exit(2);
  }
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  void *flush, *chase, *flags;
  unsigned long long* sink;
  CHECK(cudaMalloc(&flush, kFlushBytes));
  CHECK(cudaMalloc(&chase, kChaseBytes));
  CHECK(cudaMalloc(&flags, 64 * kFlagStride * sizeof(unsigned int)));
  CHECK(cudaMalloc(&sink, 2 * sizeof(unsigned long long)));
  CHECK(cudaMemset(flags, 0, 64 * kFlagStride * sizeof(unsigned int)));
  CHECK(cudaMemset(sink, 0, 2 * sizeof(unsigned long long)));

  // The chase: one pointer per page, a single cycle through the pages in a shuffled order
  // (a fixed LCG, so runs repeat).
  const size_t pages = kChaseBytes / 4096;
  std::vector<size_t> order(pages);
  for (size_t i = 0; i < pages; ++i) order[i] = i;
  unsigned long long seed = 2025;
  for (size_t i = pages - 1; i > 0; --i) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    std::swap(order[i], order[(seed >> 33) % (i + 1)]);
  }
  std::vector<unsigned long long> host(kChaseBytes / sizeof(unsigned long long), 0);
  const auto base = reinterpret_cast<unsigned long long>(chase);
  for (size_t i = 0; i < pages; ++i)
    host[order[i] * kChaseStride] = base + order[(i + 1) % pages] * 4096;
  CHECK(cudaMemcpy(chase, host.data(), kChaseBytes, cudaMemcpyHostToDevice));

  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("round_trips: %s, %d SMs; kernel of %d blocks x %d threads; median of %d calls, "
              "L2 flushed (256 MiB) before each\n",
              prop.name, prop.multiProcessorCount, a.blocks, a.threads, a.iters);

  const char* names[] = {"chase", "relay", "fenced"};
  unsigned int epoch = 0;
  for (int c = 0; c < 3; ++c) {
    std::printf("%-7s", names[c]);
    std::vector<double> xs, ys;
    for (int k : kSteps) {
      std::vector<double> t;
      for (int i = 0; i < a.iters + 3; ++i) {
        ++epoch;
        CHECK(cudaMemsetAsync(flush, i & 0xff, kFlushBytes, s));
        CHECK(cudaEventRecord(e0, s));
        const auto* start = reinterpret_cast<const unsigned long long*>(
            base + order[(static_cast<size_t>(i) * 7919) % pages] * 4096);
        if (c == 0) chase_kernel<<<a.blocks, a.threads, 0, s>>>(start, k, sink);
        else if (c == 1)
          relay_kernel<<<a.blocks, a.threads, 0, s>>>(static_cast<unsigned int*>(flags), k, epoch,
                                                      sink);
        else
          fenced_kernel<<<a.blocks, a.threads, 0, s>>>(static_cast<unsigned int*>(flags), k,
                                                       epoch, sink);
        CHECK(cudaGetLastError());
        CHECK(cudaEventRecord(e1, s));
        CHECK(cudaEventSynchronize(e1));
        float ms;
        CHECK(cudaEventElapsedTime(&ms, e0, e1));
        if (i >= 3) t.push_back(ms * 1e3);
      }
      const double m = median(t);
      xs.push_back(k);
      ys.push_back(m);
      std::printf("  k=%-2d %6.2f", k, m);
    }
    // Least squares over the k > 0 points and k = 0.
    const double n = static_cast<double>(xs.size());
    double sx = 0, sy = 0, sxx = 0, sxy = 0;
    for (size_t i = 0; i < xs.size(); ++i) {
      sx += xs[i];
      sy += ys[i];
      sxx += xs[i] * xs[i];
      sxy += xs[i] * ys[i];
    }
    const double slope = (n * sxy - sx * sy) / (n * sxx - sx * sx);
    std::printf("   | %.3f us per step, %.2f us at k=0 (fit)\n", slope, (sy - slope * sx) / n);
  }
  unsigned long long h[2];
  CHECK(cudaMemcpy(h, sink, sizeof h, cudaMemcpyDeviceToHost));
  if (h[1] != 0) {
    std::fprintf(stderr, "a relay wait gave up after 1 s: the numbers above are not valid\n");
    return 1;
  }
  return 0;
}
