// Bounded waits and failure records. Every spin in epcomm goes through `wait_geq` or
// `wait_tag`: each gives up after `timeout_ns`, records which op / wait / peer / values into the
// host-mapped ErrorRecord (first failure wins), and returns false so the caller can leave the
// kernel. Nothing traps: a trap would poison the CUDA context (sticky error) for the process.
#pragma once
#include "epcomm/abi.cuh"
#include "epcomm/ptx.cuh"

namespace epcomm {

struct WaitCtx {
  ErrorRecord* record;     // host-mapped
  uint32_t* claim;         // device word; the first failing thread flips it 0 -> 1
  uint64_t timeout_ns;
  uint64_t epoch;
  uint32_t op;
  int32_t rank;
};

__device__ __forceinline__ bool failed(const WaitCtx& w) {
  return *reinterpret_cast<volatile uint32_t*>(w.claim) != 0;
}

__device__ __noinline__ void record_failure(const WaitCtx& w, uint32_t code, uint32_t wait_id,
                                            int32_t peer, uint64_t expected, uint64_t seen,
                                            uint64_t waited_ns) {
  if (atomicCAS(w.claim, 0u, 1u) != 0u) return;
  volatile ErrorRecord* r = w.record;
  r->op = w.op;
  r->wait_id = wait_id;
  r->peer = peer;
  r->block = blockIdx.x;
  r->rank = static_cast<uint32_t>(w.rank);
  r->epoch = w.epoch;
  r->expected = expected;
  r->seen = seen;
  r->waited_ns = waited_ns;
  __threadfence_system();
  r->code = code;
  __threadfence_system();
}

// Spin until *p >= target (acquire). Returns false on timeout or when another thread failed.
__device__ __forceinline__ bool wait_geq(const WaitCtx& w, const uint64_t* p, uint64_t target,
                                         uint32_t wait_id, int32_t peer, uint64_t* arrived_ns) {
  uint64_t v = ld_acquire_sys(p);
  if (v >= target) {
    if (arrived_ns) *arrived_ns = globaltimer_ns();
    return true;
  }
  const uint64_t t0 = globaltimer_ns();
  for (uint32_t spins = 1;; ++spins) {
    v = ld_acquire_sys(p);
    if (v >= target) {
      if (arrived_ns) *arrived_ns = globaltimer_ns();
      return true;
    }
    if ((spins & 63u) == 0u) {
      const uint64_t now = globaltimer_ns();
      if (now - t0 > w.timeout_ns) {
        record_failure(w, kTimeout, wait_id, peer, target, v, now - t0);
        return false;
      }
      if (failed(w)) return false;
    }
  }
}

// Tagged words: (tag << 32) | value, tag >= 1, so an unwritten (zero) word never matches.
__device__ __forceinline__ uint64_t make_tagged(uint64_t tag, uint32_t value) {
  return (tag << 32) | value;
}

// Spin until the word's tag equals `tag` (acquire); returns the value through *value.
__device__ __forceinline__ bool wait_tag(const WaitCtx& w, const uint64_t* p, uint64_t tag,
                                         uint32_t wait_id, int32_t peer, uint32_t* value,
                                         uint64_t* arrived_ns) {
  const uint64_t t0 = globaltimer_ns();
  for (uint32_t spins = 0;; ++spins) {
    const uint64_t v = ld_acquire_sys(p);
    if ((v >> 32) == (tag & 0xffffffffull)) {
      *value = static_cast<uint32_t>(v);
      if (arrived_ns) *arrived_ns = globaltimer_ns();
      return true;
    }
    if ((spins & 63u) == 63u) {
      const uint64_t now = globaltimer_ns();
      if (now - t0 > w.timeout_ns) {
        record_failure(w, kTimeout, wait_id, peer, tag, v >> 32, now - t0);
        return false;
      }
      if (failed(w)) return false;
    }
  }
}

}  // namespace epcomm
