// What the copy-engine executor's copies can cost on one GPU, outside epcomm: device-to-device
// `cudaMemcpyAsync` within one GPU (what a copy between two ranks sharing a GPU is), by chunk
// size and by how many streams the chunks are spread over, and whether such a copy needs SMs.
//
//   bandwidth    `--total-mib` MiB copied as chunks of 64 KiB .. the whole, dealt round-robin
//                over 1, 2 or 4 streams; the median over `--iters` calls of the time between
//                an event before the first copy and one after the last (all streams joined)
//   tiny chain   100 copies of 8 bytes one after another on one stream (device to device, and
//                from pinned host memory, as a signal word is staged): the per-copy cost
//   batch        the same bytes as one `cudaMemcpyBatchAsync` (source read in stream order,
//                the hint to overlap with compute: copy engines rather than SMs), by chunk size
//   host         the host's time per call while issuing the 64 KiB case, per copy and per batch
//   threads      the 64 KiB case issued by 2 or 4 host threads at once, each on its own stream:
//                whether the per-copy cost is one thread's (it then divides) or the driver's
//   all SMs busy the bandwidth case's largest chunk issued while a kernel holds every SM's
//                threads (it spins until the host lets it go, at most 200 ms): a copy run by the
//                copy engines completes meanwhile, one that needs SMs only after the kernel ends
//
// Build and run (any CUDA 12/13 toolkit; the flag picks the GPU's architecture):
//
//   nvcc -O3 -arch=sm_90 -cudart static -o copy_engine benches/floor/copy_engine.cu
//   ./copy_engine --total-mib 64 --iters 10
//
// It measures the GPU and driver, not epcomm: docs/benchmarks.md compares its numbers with the
// proxy-ce transport's ops.
#include <cuda_runtime.h>

#include "check.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>


// Holds its SM until `*release` is nonzero or 200 ms of the GPU clock pass; sets `out[0]` when
// it gave up on its own (the host checks it).
__global__ void hold_sms(volatile unsigned int* release, unsigned int* out) {
  extern __shared__ unsigned char smem[];
  if (threadIdx.x == 0) {
    smem[0] = 1;
    unsigned long long t0, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    while (*release == 0) {
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
      if (now - t0 > 200000000ull) {
        atomicExch(out, 1u);
        break;
      }
    }
  }
  __syncthreads();
}

static int arg_int(int argc, char** argv, const char* name, int dflt) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], name) == 0) return std::atoi(argv[i + 1]);
  return dflt;
}

static float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main(int argc, char** argv) {
  const size_t total = size_t(arg_int(argc, argv, "--total-mib", 64)) << 20;
  const int iters = arg_int(argc, argv, "--iters", 10);
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs, %d async engines; %zu MiB per case, median of %d calls\n",
              prop.name, prop.multiProcessorCount, prop.asyncEngineCount, total >> 20, iters);

  unsigned char *src = nullptr, *dst = nullptr;
  CHECK(cudaMalloc(&src, total));
  CHECK(cudaMalloc(&dst, total));
  CHECK(cudaMemset(src, 7, total));
  const int kMaxStreams = 4;
  cudaStream_t s[kMaxStreams];
  for (auto& x : s) CHECK(cudaStreamCreateWithFlags(&x, cudaStreamNonBlocking));
  cudaEvent_t start, stop, joined[kMaxStreams];
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  for (auto& e : joined) CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));

  // One call: `total` bytes as `chunk`-byte copies dealt over `n` streams, timed on s[0];
  // `batched`: one cudaMemcpyBatchAsync on s[0] instead.
  std::vector<void*> dsts, srcs_v;
  std::vector<size_t> sizes;
  auto issue_batch = [&](size_t chunk) {
    dsts.clear();
    srcs_v.clear();
    sizes.clear();
    for (size_t at = 0; at < total; at += chunk) {
      dsts.push_back(dst + at);
      srcs_v.push_back(src + at);
      sizes.push_back(std::min(chunk, total - at));
    }
    cudaMemcpyAttributes attr = {};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    size_t idx = 0;
    CHECK(cudaMemcpyBatchAsync(dsts.data(), srcs_v.data(), sizes.data(), dsts.size(), &attr,
                               &idx, 1, s[0]));
  };
  auto issue = [&](size_t chunk, int n, bool batched = false) {
    CHECK(cudaEventRecord(start, s[0]));
    if (batched) {
      issue_batch(chunk);
      CHECK(cudaEventRecord(stop, s[0]));
      return;
    }
    for (int i = 1; i < n; ++i) CHECK(cudaStreamWaitEvent(s[i], start, 0));
    size_t k = 0;
    for (size_t at = 0; at < total; at += chunk, ++k) {
      const size_t len = std::min(chunk, total - at);
      CHECK(cudaMemcpyAsync(dst + at, src + at, len, cudaMemcpyDeviceToDevice, s[k % n]));
    }
    for (int i = 1; i < n; ++i) {
      CHECK(cudaEventRecord(joined[i], s[i]));
      CHECK(cudaStreamWaitEvent(s[0], joined[i], 0));
    }
    CHECK(cudaEventRecord(stop, s[0]));
  };
  auto elapsed_us = [&]() {
    float ms = 0.f;
    CHECK(cudaEventSynchronize(stop));
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    return ms * 1e3f;
  };

  std::printf("%-12s %8s %8s %10s %8s\n", "case", "chunk", "streams", "us", "GB/s");
  const size_t chunks[] = {size_t(64) << 10, size_t(1) << 20, size_t(8) << 20, total};
  for (size_t chunk : chunks) {
    for (int n : {1, 2, 4}) {
      if (chunk == total && n > 1) continue;
      issue(chunk, n);
      elapsed_us();
      std::vector<float> us;
      for (int it = 0; it < iters; ++it) {
        issue(chunk, n);
        us.push_back(elapsed_us());
      }
      const float m = median(us);
      std::printf("%-12s %7zuK %8d %10.1f %8.1f\n", "bandwidth", chunk >> 10, n, m,
                  double(total) / (m * 1e3));
    }
  }

  for (size_t chunk : chunks) {
    issue(chunk, 1, true);
    elapsed_us();
    std::vector<float> us;
    for (int it = 0; it < iters; ++it) {
      issue(chunk, 1, true);
      us.push_back(elapsed_us());
    }
    const float m = median(us);
    std::printf("%-12s %7zuK %8d %10.1f %8.1f\n", "batch", chunk >> 10, 1, m,
                double(total) / (m * 1e3));
  }

  // The host's time per call (the GPU may run behind it).
  for (int batched = 0; batched < 2; ++batched) {
    const size_t chunk = size_t(64) << 10;
    CHECK(cudaStreamSynchronize(s[0]));
    const auto h0 = std::chrono::steady_clock::now();
    issue(chunk, 1, batched != 0);
    const double host_us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - h0).count();
    elapsed_us();
    const size_t copies = total / chunk;
    std::printf("%-12s %7zuK %8d %10.1f us on the host for %zu copies: %.2f us per copy (%s)\n",
                "host", chunk >> 10, 1, host_us, copies, host_us / double(copies),
                batched ? "one cudaMemcpyBatchAsync" : "one cudaMemcpyAsync each");
  }

  // Several host threads issuing at once, each its share of the copies on its own stream.
  for (int n : {2, 4}) {
    const size_t chunk = size_t(64) << 10;
    std::vector<float> us;
    double host_us = 0;
    for (int it = 0; it <= iters; ++it) {
      CHECK(cudaStreamSynchronize(s[0]));
      CHECK(cudaEventRecord(start, s[0]));
      for (int i = 1; i < n; ++i) CHECK(cudaStreamWaitEvent(s[i], start, 0));
      const auto h0 = std::chrono::steady_clock::now();
      std::vector<std::thread> pool;
      for (int t = 0; t < n; ++t)
        pool.emplace_back([&, t] {
          size_t k = 0;
          for (size_t at = 0; at < total; at += chunk, ++k)
            if (static_cast<int>(k % n) == t)
              CHECK(cudaMemcpyAsync(dst + at, src + at, chunk, cudaMemcpyDeviceToDevice, s[t]));
        });
      for (auto& th : pool) th.join();
      const double h =
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - h0).count();
      for (int i = 1; i < n; ++i) {
        CHECK(cudaEventRecord(joined[i], s[i]));
        CHECK(cudaStreamWaitEvent(s[0], joined[i], 0));
      }
      CHECK(cudaEventRecord(stop, s[0]));
      const float t = elapsed_us();
      if (it > 0) {
        us.push_back(t);
        host_us += h / iters;
      }
    }
    std::printf("%-12s %7zuK %8d %10.1f %8.1f   %d host threads, %.1f us on the host\n",
                "threads", chunk >> 10, n, median(us), double(total) / (median(us) * 1e3), n,
                host_us);
  }

  // Tiny copies one after another: the per-copy cost in the engines.
  unsigned long long* host_word = nullptr;
  CHECK(cudaHostAlloc(&host_word, 4096, cudaHostAllocMapped));
  for (int from_host = 0; from_host < 2; ++from_host) {
    std::vector<float> us;
    for (int it = 0; it <= iters; ++it) {
      CHECK(cudaEventRecord(start, s[0]));
      for (int i = 0; i < 100; ++i) {
        const void* from = from_host ? static_cast<const void*>(host_word + i)
                                     : static_cast<const void*>(src + 8 * i);
        CHECK(cudaMemcpyAsync(dst + 8 * i, from, 8,
                              from_host ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToDevice,
                              s[0]));
      }
      CHECK(cudaEventRecord(stop, s[0]));
      const float t = elapsed_us();
      if (it > 0) us.push_back(t);
    }
    std::printf("%-12s %8s %8d %10.2f us per copy (%s)\n", "tiny chain", "8B", 1,
                median(us) / 100, from_host ? "pinned host to device" : "device to device");
  }

  // All SMs held: does the largest copy complete while no SM is free?
  unsigned int* release = nullptr;
  CHECK(cudaHostAlloc(&release, 64, cudaHostAllocMapped));
  unsigned int* gave_up = nullptr;
  CHECK(cudaMalloc(&gave_up, 4));
  CHECK(cudaMemset(gave_up, 0, 4));
  const int threads = 1024;
  const int smem = static_cast<int>(prop.sharedMemPerMultiprocessor / 2 - 2048);
  CHECK(cudaFuncSetAttribute(hold_sms, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  int per_sm = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, hold_sms, threads, smem));
  cudaStream_t hold_stream;
  CHECK(cudaStreamCreateWithFlags(&hold_stream, cudaStreamNonBlocking));
  for (int variant = 0; variant < 3; ++variant) {
    const size_t chunk = variant == 1 ? total : size_t(1) << 20;
    const bool batched = variant == 2;
    *reinterpret_cast<volatile unsigned int*>(release) = 0;
    hold_sms<<<prop.multiProcessorCount * per_sm, threads, smem, hold_stream>>>(release, gave_up);
    CHECK(cudaGetLastError());
    std::this_thread::sleep_for(std::chrono::milliseconds(5));  // let every block start
    const auto t0 = std::chrono::steady_clock::now();
    issue(chunk, 1, batched);
    bool done_while_held = false;
    while (std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(50)) {
      const cudaError_t q = cudaEventQuery(stop);
      if (q == cudaSuccess) {
        done_while_held = true;
        break;
      }
      if (q != cudaErrorNotReady) CHECK(q);
    }
    *reinterpret_cast<volatile unsigned int*>(release) = 1;
    CHECK(cudaStreamSynchronize(hold_stream));
    const float us = elapsed_us();
    unsigned int expired = 0;
    CHECK(cudaMemcpy(&expired, gave_up, 4, cudaMemcpyDeviceToHost));
    std::printf("%-12s %7zuK %8d %10.1f   %s; %d blocks x %d threads held every SM: the copy %s%s\n",
                "all SMs busy", chunk >> 10, 1, us,
                batched ? "one cudaMemcpyBatchAsync" : "cudaMemcpyAsync",
                prop.multiProcessorCount * per_sm, threads,
                done_while_held ? "completed while they ran (copy engines)"
                                : "completed only after they ended (it needs SMs)",
                expired ? " [the holding kernel timed out]" : "");
  }
  return 0;
}
