// The floor under a one-kernel op timed the way `epcomm bench` times it: CUDA events around
// the op, L2 flushed (a 256 MiB memset) right before the start event. Each case prints the
// median over its calls, in microseconds, and what lies between the two events:
//
//   events          nothing (the events' own cost)
//   plain           an empty kernel, plain launch
//   cooperative     the same kernel, cooperative launch (how every epcomm op launches)
//   coop+smem       cooperative, with the 32 KiB of dynamic shared memory an LL kernel may take
//   coop+tracking   cooperative, with N waits on completed events before it and N event records
//                   after it: what cudarc's per-allocation event tracking adds when an op takes N
//                   device arrays (`--tracked N`, default 10)
//   coop+barrier    cooperative; every block adds to one counter in global memory and waits for
//                   all blocks' adds (the least cross-block wait a kernel can have)
//   coop+load       cooperative; every block loads one word after the flush (one memory round
//                   trip) before it ends
//
// Build and run (any CUDA 12/13 toolkit; the flag picks the GPU's architecture):
//
//   nvcc -O3 -arch=sm_90 -cudart static -o launch_floor benches/floor/launch_floor.cu
//   ./launch_floor --blocks 132 --threads 512 --iters 200
//
// It measures the GPU and driver, not epcomm: docs/benchmarks.md compares its numbers with the
// low-latency ops' event time less their in-kernel time.
#include <cuda_runtime.h>

#include "check.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>


__global__ void empty_kernel(unsigned long long*, unsigned int*, int) {}

// Every block's thread 0 adds 1 to `count[0]` and waits until it reads `target` (epoch-based:
// the counter is never reset, the caller passes the running target). The wait gives up after
// one second of the GPU clock and sets `count[1]`, which the host checks.
__global__ void barrier_kernel(unsigned long long*, unsigned int* count, int target) {
  if (threadIdx.x == 0) {
    atomicAdd(count, 1u);
    unsigned long long t0, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    while (*reinterpret_cast<volatile unsigned int*>(count) < static_cast<unsigned>(target)) {
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
      if (now - t0 > 1000000000ull) {
        atomicExch(count + 1, 1u);
        break;
      }
    }
  }
  __syncthreads();
}

// Every block's thread 0 loads one word (a miss after the flush) and stores it back.
__global__ void load_kernel(unsigned long long* word, unsigned int*, int) {
  if (threadIdx.x == 0) {
    const unsigned long long v = *reinterpret_cast<volatile unsigned long long*>(word);
    if (v == 0xdeadbeefull) word[1 + blockIdx.x] = v;
  }
}

static int arg_int(int argc, char** argv, const char* name, int dflt) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], name) == 0) return std::atoi(argv[i + 1]);
  return dflt;
}

enum Case { kEvents, kPlain, kCoop, kCoopSmem, kCoopTracking, kCoopBarrier, kCoopLoad };

int main(int argc, char** argv) {
  const int blocks = arg_int(argc, argv, "--blocks", 132);
  const int threads = arg_int(argc, argv, "--threads", 512);
  const int iters = arg_int(argc, argv, "--iters", 200);
  const int tracked = arg_int(argc, argv, "--tracked", 10);
  const size_t flush_bytes = size_t{256} << 20;
  const int smem = 32 * 1024;

  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs; %d blocks x %d threads, %d calls per case\n", prop.name,
              prop.multiProcessorCount, blocks, threads, iters);

  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  void* flush = nullptr;
  CHECK(cudaMalloc(&flush, flush_bytes));
  unsigned long long* word = nullptr;
  CHECK(cudaMalloc(&word, sizeof(unsigned long long) * (1 + blocks)));
  CHECK(cudaMemset(word, 0, sizeof(unsigned long long) * (1 + blocks)));
  unsigned int* count = nullptr;  // [0]: the barrier's arrivals, [1]: set when a wait expired
  CHECK(cudaMalloc(&count, 2 * sizeof(unsigned int)));
  CHECK(cudaMemset(count, 0, 2 * sizeof(unsigned int)));
  CHECK(cudaFuncSetAttribute(empty_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));

  // Tracking events: recorded once on the stream (complete), then waited on before the kernel;
  // records after it use events of their own, as cudarc's read events are.
  std::vector<cudaEvent_t> waits(tracked), records(tracked);
  for (int i = 0; i < tracked; ++i) {
    CHECK(cudaEventCreateWithFlags(&waits[i], cudaEventDisableTiming));
    CHECK(cudaEventCreateWithFlags(&records[i], cudaEventDisableTiming));
    CHECK(cudaEventRecord(waits[i], s));
  }

  unsigned int arrivals = 0;
  auto launch = [&](Case c) {
    if (c == kEvents) return;
    void (*f)(unsigned long long*, unsigned int*, int) =
        c == kCoopBarrier ? barrier_kernel : c == kCoopLoad ? load_kernel : empty_kernel;
    int target = 0;
    if (c == kCoopBarrier) {
      arrivals += static_cast<unsigned>(blocks);
      target = static_cast<int>(arrivals);
    }
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(blocks);
    cfg.blockDim = dim3(threads);
    cfg.dynamicSmemBytes = c == kCoopSmem ? smem : 0;
    cfg.stream = s;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeCooperative;
    attr[0].val.cooperative = c == kPlain ? 0 : 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    if (c == kCoopTracking)
      for (int i = 0; i < tracked; ++i) CHECK(cudaStreamWaitEvent(s, waits[i], 0));
    CHECK(cudaLaunchKernelEx(&cfg, f, word, count, target));
    if (c == kCoopTracking)
      for (int i = 0; i < tracked; ++i) CHECK(cudaEventRecord(records[i], s));
  };

  const Case cases[] = {kEvents, kPlain, kCoop, kCoopSmem, kCoopTracking, kCoopBarrier, kCoopLoad};
  const char* names[] = {"events", "plain", "cooperative", "coop+smem",
                         "coop+tracking", "coop+barrier", "coop+load"};
  for (int ci = 0; ci < 7; ++ci) {
    const Case c = cases[ci];
    for (int w = 0; w < 10; ++w) launch(c);
    std::vector<cudaEvent_t> ev(2 * iters);
    for (auto& e : ev) CHECK(cudaEventCreate(&e));
    for (int i = 0; i < iters; ++i) {
      CHECK(cudaMemsetAsync(flush, i & 0xff, flush_bytes, s));
      CHECK(cudaEventRecord(ev[2 * i], s));
      launch(c);
      CHECK(cudaEventRecord(ev[2 * i + 1], s));
    }
    CHECK(cudaStreamSynchronize(s));
    unsigned int expired = 0;
    CHECK(cudaMemcpy(&expired, count + 1, sizeof(expired), cudaMemcpyDeviceToHost));
    if (expired != 0) {
      std::fprintf(stderr, "%s: a block waited over 1 s for the others (not co-resident?)\n",
                   names[ci]);
      return 1;
    }
    std::vector<float> us(iters);
    for (int i = 0; i < iters; ++i) {
      float ms = 0.f;
      CHECK(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
      us[i] = ms * 1e3f;
    }
    for (auto& e : ev) CHECK(cudaEventDestroy(e));
    std::sort(us.begin(), us.end());
    std::printf("%-14s median %6.2f us  p10 %6.2f  p90 %6.2f", names[ci], us[iters / 2],
                us[iters / 10], us[iters * 9 / 10]);
    if (c == kCoopTracking) std::printf("  (%d waits + %d records)", tracked, tracked);
    std::printf("\n");
  }
  return 0;
}
