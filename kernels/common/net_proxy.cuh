// The CPU-proxy Net policy (contract: common/net.cuh). Peers whose bit is set in
// OpArgs::remote_mask are reached through this rank's proxy thread: every remote write becomes a
// 32-byte descriptor in a ring in host-mapped memory (layout: abi.cuh kRing*, the Rust side's
// `epcomm_proxy::ring`), which the proxy executes in ring order on its executor (a copy engine,
// RDMA verbs). Every other peer is reached through its mapping exactly as StoreNet does.
//
// Producing [P1]: a thread claims ring position p with an atomic add on a device counter (many
// producers: every thread of every block), waits (bounded) until p - tail < capacity, writes the
// descriptor's words, and stores seq = p + 1 with release at system scope. The proxy takes
// position p only once its seq reads p + 1, so a half-written slot is never read.
//
// Ordering: positions are claimed in happens-before order, so a descriptor written after a
// block barrier always has a larger position than every descriptor written before it. The
// proxy keeps ring order per peer and lands a signal after every earlier transfer and write to
// that peer: publication after `__syncthreads` needs no fence. `quiet` [P2] waits (bounded)
// until the proxy reports every claimed position complete, so the sources of this block's
// transfers (caller memory, the LL FP8 send rows) may be reused after it and the kernel may end.
//
// Addresses: the kernels compute `bases[d] + offset` for every peer; for a proxied peer
// `bases[d]` is this rank's own symmetric base (ProxyChannel::local_base, as under NVSHMEM), so
// the destination offset is `address - local_base`.
#pragma once
#include "common/abi.cuh"
#include "common/net.cuh"
#include "common/ptx.cuh"
#include "common/wait.cuh"

// The module global the host writes once per buffer (cuModuleGetGlobal "epcomm_proxy_channel").
__device__ epcomm::ProxyChannel epcomm_proxy_channel;

namespace epcomm {

struct ProxyNet {
  static constexpr bool kTransport = true;
  // A descriptor per element is what made the transport slow: a dispatched token's metadata
  // travels to a proxied peer as whole-row transfers (`put_lanes`): the normal dispatch's
  // scales, top-k ids and weights from the caller's rows, untransformed (the receiver
  // finishes them, [E8]); the low-latency dispatch's metadata row from a metadata send row ([L3]).
  static constexpr bool kMetadataRows = true;
  // ... and a descriptor per token still was: the normal dispatch deals each warp a contiguous
  // chunk of tokens and sends a proxied peer each run of consecutive tokens bound for
  // consecutive rows as one transfer per record (rows, scales, ids, weights) and one WRITE per
  // source index, all on consecutive positions from one claim ([E4], `claim_fenced`,
  // `emit_transfer`, `emit_write`). The combine's push does the same with its rows: a run of
  // consecutive rows from one source, bound for consecutive slots, is one transfer of rows,
  // one of weights and one SIGNAL per row ([C1], `emit_signal`).
  static constexpr bool kCoalesceRuns = true;

  __device__ static __forceinline__ bool remote(uint64_t remote_mask, int d) {
    return ((remote_mask >> d) & 1ull) != 0;
  }

  __device__ static __forceinline__ uint64_t* counters() {
    return reinterpret_cast<uint64_t*>(epcomm_proxy_channel.counters);
  }
  __device__ static __forceinline__ uint8_t* ring() {
    return reinterpret_cast<uint8_t*>(epcomm_proxy_channel.ring);
  }
  __device__ static __forceinline__ uint64_t offset_of(const void* p) {
    return reinterpret_cast<uint64_t>(p) - epcomm_proxy_channel.local_base;
  }

  // [P1] claims `n` consecutive ring positions.
  __device__ static __forceinline__ uint64_t claim(uint32_t n) {
    return atomicAdd(reinterpret_cast<unsigned long long*>(counters() + kProxyCounterHead),
                     static_cast<unsigned long long>(n));
  }

  // The proxy's progress: its mirror in device memory (the copy-engine executor writes it with
  // a stream of its own) and, when `with_host`, the larger of that and the ring's host word
  // (both only grow). Waits read the host word only every 16th poll: device memory spares
  // every waiting thread a read across the bus; an executor without a mirror is still seen.
  __device__ static __forceinline__ uint64_t progress(uint64_t ring_offset, uint64_t counter,
                                                      bool with_host) {
    const uint64_t mirror = ld_acquire_sys(counters() + counter);
    if (!with_host) return mirror;
    const uint64_t host = ld_acquire_sys(reinterpret_cast<const uint64_t*>(ring() + ring_offset));
    return host > mirror ? host : mirror;
  }

  // [P1] waits until slot `p` is free (bounded by ProxyChannel::timeout_ns); false when the
  // proxy stopped or the bound passed (then the gave-up counter is set, and the next `quiet`
  // records the failure).
  __device__ static __noinline__ bool wait_slot(uint64_t p) {
    const uint64_t cap = epcomm_proxy_channel.capacity;
    uint64_t* seen = counters() + kProxyCounterTailSeen;
    if (p - *reinterpret_cast<volatile uint64_t*>(seen) < cap) return true;
    const uint64_t* status = reinterpret_cast<const uint64_t*>(ring() + kRingStatusOffset);
    const uint64_t t0 = globaltimer_ns();
    for (uint32_t spins = 0;; ++spins) {
      if (spins != 0) __nanosleep(1000);
      const uint64_t t = progress(kRingTailOffset, kProxyCounterTaken, (spins & 15u) == 0);
      if (p - t < cap) {
        atomicMax(reinterpret_cast<unsigned long long*>(seen), static_cast<unsigned long long>(t));
        return true;
      }
      if ((spins & 7u) == 7u) {
        if (ld_relaxed_sys(status) != 0 ||
            globaltimer_ns() - t0 > epcomm_proxy_channel.timeout_ns) {
          atomicExch(reinterpret_cast<unsigned long long*>(counters() + kProxyCounterGaveUp), 1ull);
          return false;
        }
      }
    }
  }

  // [P1] writes descriptor `p` (one thread); false when the slot never came free (`wait_slot`:
  // the descriptor is dropped and the next `quiet` fails).
  __device__ static __forceinline__ bool emit(uint64_t p, uint64_t kind, uint64_t flags, int pe,
                                              uint64_t arg0, uint64_t arg1, uint64_t arg2) {
    if (!wait_slot(p)) return false;
    uint64_t* slot = reinterpret_cast<uint64_t*>(
        ring() + kRingHeaderBytes + (p & (epcomm_proxy_channel.capacity - 1)) * kRingSlotBytes);
    st_relaxed_sys(slot + 1, kind | (flags << 16) | (static_cast<uint64_t>(pe) << 32));
    st_relaxed_sys(slot + 2, arg0);
    st_relaxed_sys(slot + 3, arg1);
    st_relaxed_sys(slot + 4, arg2);
    st_release_sys(slot, p + 1);
    return true;
  }

  // [P1] One thread: makes this thread's (and, after a barrier, its group's) earlier stores
  // visible to the proxy's executor, then claims `n` consecutive positions; the caller writes
  // each of them with `emit_transfer` / `emit_write` (every claimed position must be written,
  // or the proxy waits for it until the op's bound).
  __device__ static __forceinline__ uint64_t claim_fenced(uint32_t n) {
    __threadfence_system();
    return claim(n);
  }

  // [P1] One thread: descriptor `p` (claimed) is a TRANSFER of `bytes` (> 0) from `src` (a
  // device address of this process) into rank `pe`'s copy of `dst`; false as `emit`.
  __device__ static __forceinline__ bool emit_transfer(uint64_t p, void* dst, const void* src,
                                                       size_t bytes, int pe) {
    return emit(p, kProxyKindTransfer, kProxyFlagSrcAddress, pe, reinterpret_cast<uint64_t>(src),
         offset_of(dst), bytes);
  }

  // [P1] One thread: descriptor `p` (claimed) is a WRITE of `v` into rank `pe`'s copy of `dst`;
  // false as `emit`.
  template <typename T>
  __device__ static __forceinline__ bool emit_write(uint64_t p, T* dst, T v, int pe) {
    static_assert(sizeof(T) == 4 || sizeof(T) == 8, "proxy writes are 4 or 8 bytes");
    uint64_t bits = 0;
    memcpy(&bits, &v, sizeof(T));
    return emit(p, kProxyKindWrite, 0, pe, offset_of(dst), bits, sizeof(T));
  }

  // [P1] One thread: descriptor `p` (claimed) is a SIGNAL setting rank `pe`'s copy of `sig` to
  // `v`, which lands after every descriptor to `pe` of lower position; false as `emit`.
  __device__ static __forceinline__ bool emit_signal(uint64_t p, uint64_t* sig, uint64_t v,
                                                     int pe) {
    return emit(p, kProxyKindSignal, 0, pe, offset_of(sig), v, 0);
  }

  __device__ static __forceinline__ void signal(uint64_t* p, uint64_t v, int pe, bool add) {
    emit(claim(1), kProxyKindSignal, add ? kProxyFlagSignalAdd : 0, pe, offset_of(p), v, 0);
  }

  __device__ static __forceinline__ void set_word(uint64_t* p, uint64_t v, int pe, bool remote) {
    if (remote)
      signal(p, v, pe, false);
    else
      StoreNet::set_word(p, v, pe, false);
  }

  // The ring orders a signal after every descriptor of lower position, which covers every
  // write of this thread and every write that happens-before it.
  __device__ static __forceinline__ void publish_set(uint64_t* p, uint64_t v, int pe,
                                                     bool remote) {
    if (!remote) return StoreNet::publish_set(p, v, pe, false);
    signal(p, v, pe, false);
  }

  __device__ static __forceinline__ void publish_add(uint64_t* p, uint64_t v, int pe,
                                                     bool remote) {
    if (!remote) return StoreNet::publish_add(p, v, pe, false);
    signal(p, v, pe, true);
  }

  // [P2] Block-collective (every thread of the block calls it, then `all_ok` follows): waits
  // until the proxy completed every position claimed so far, so this block's transfer sources
  // may be reused. Records kTimeout / kWaitProxy on expiry or when a producer gave up (a
  // descriptor was dropped) and returns false in thread 0: the block must then publish
  // nothing, or a peer would take the missing rows for delivered ones.
  __device__ static __noinline__ bool quiet(const WaitCtx& w, uint64_t remote_mask) {
    if (remote_mask == 0) return true;
    __syncthreads();
    if (threadIdx.x != 0) return true;
    const uint64_t target = *reinterpret_cast<volatile uint64_t*>(counters() + kProxyCounterHead);
    const uint64_t* status = reinterpret_cast<const uint64_t*>(ring() + kRingStatusOffset);
    const uint64_t t0 = globaltimer_ns();
    uint64_t done = 0;
    for (uint32_t spins = 0;; ++spins) {
      // Host memory is polled over the bus: back off, so the copy engines' own traffic to and
      // from host memory is not crowded out by every block's polling.
      if (spins != 0) __nanosleep(2000);
      const uint64_t now_done =
          progress(kRingCompletedOffset, kProxyCounterCompleted, (spins & 15u) == 0);
      if (now_done > done) done = now_done;
      const bool gave_up =
          *reinterpret_cast<volatile uint64_t*>(counters() + kProxyCounterGaveUp) != 0;
      if (done >= target && !gave_up) return true;
      if ((spins & 7u) == 7u || gave_up) {
        const uint64_t now = globaltimer_ns();
        if (gave_up || ld_relaxed_sys(status) != 0 || now - t0 > w.timeout_ns) {
          record_failure<ProxyNet>(w, kTimeout, kWaitProxy, w.rank, target, done, now - t0);
          return false;
        }
        if (should_stop<ProxyNet>(w, kWaitProxy, spins)) return false;
      }
    }
  }

  // One element: a store, or a WRITE descriptor carrying the value.
  template <typename T>
  __device__ static __forceinline__ void put_elem(T* p, T v, int pe, bool remote) {
    static_assert(sizeof(T) == 4 || sizeof(T) == 8, "proxy writes are 4 or 8 bytes");
    if (!remote) {
      *p = v;
      return;
    }
    emit_write(claim(1), p, v, pe);
  }

  // Ring order already orders this thread's later descriptors after its earlier ones.
  __device__ static __forceinline__ void fence() {}

  // Warp-collective put of `bytes` from `src` (a device address of this process: caller memory
  // or this rank's buffer) into rank `pe`'s copy of `dst`. The warp's earlier stores of `src`
  // are made visible to the proxy's executor before the descriptor is published.
  __device__ static __forceinline__ void put_warp(void* dst, const void* src, size_t bytes,
                                                  int pe) {
    __syncwarp();
    if ((threadIdx.x & 31) == 0) {
      __threadfence_system();
      emit(claim(1), kProxyKindTransfer, kProxyFlagSrcAddress, pe, reinterpret_cast<uint64_t>(src),
           offset_of(dst), bytes);
    }
    __syncwarp();
  }

  // Warp-collective: every lane with `valid` puts `bytes` (> 0) from `src` (a device address
  // of this process) into rank `pe`'s copy of `dst`; lanes may name different peers. The
  // warp's transfers take consecutive ring positions claimed with one atomic (in lane order),
  // and each lane writes its own descriptor. The warp's earlier stores of the sources are made
  // visible to the executor first, as in `put_warp`.
  __device__ static __forceinline__ void put_lanes(bool valid, void* dst, const void* src,
                                                   size_t bytes, int pe) {
    __syncwarp();
    const unsigned lanes = __ballot_sync(0xffffffffu, valid);
    if (lanes == 0) return;
    const unsigned lane = threadIdx.x & 31;
    unsigned long long p = 0;
    if (lane == 0) {
      __threadfence_system();
      p = claim(static_cast<uint32_t>(__popc(lanes)));
    }
    p = __shfl_sync(0xffffffffu, p, 0);
    if (valid)
      emit(p + static_cast<uint64_t>(__popc(lanes & ((1u << lane) - 1u))), kProxyKindTransfer,
           kProxyFlagSrcAddress, pe, reinterpret_cast<uint64_t>(src), offset_of(dst), bytes);
    __syncwarp();
  }

  // Warp-collective put of a row followed by a signal set, which lands after the row.
  __device__ static __forceinline__ void put_signal_warp(void* dst, const void* src, size_t bytes,
                                                         uint64_t* sig, uint64_t v, int pe) {
    __syncwarp();
    if ((threadIdx.x & 31) == 0) {
      __threadfence_system();
      const uint64_t p = claim(2);
      emit(p, kProxyKindTransfer, kProxyFlagSrcAddress, pe, reinterpret_cast<uint64_t>(src),
           offset_of(dst), bytes);
      emit(p + 1, kProxyKindSignal, 0, pe, offset_of(sig), v, 0);
    }
    __syncwarp();
  }
};

}  // namespace epcomm
