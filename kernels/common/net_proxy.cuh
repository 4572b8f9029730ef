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
#include "common/copy.cuh"
#include "common/net.cuh"
#include "common/ptx.cuh"
#include "common/seq.cuh"
#include "common/wait.cuh"

// The module global the host writes once per buffer (cuModuleGetGlobal "epcomm_proxy_channel").
__device__ epcomm::ProxyChannel epcomm_proxy_channel;

namespace epcomm {

// The size of a run sent to a proxied peer as one transfer per record (the normal dispatch's
// [E4] and the combine's [C1] runs, below): at most kMaxRows rows and at most kMaxBytes bytes
// of rows (the proxy's own merge limit, ProxyConfig::max_run_bytes), so the proxy gets work
// while a warp's chunk is still being sent; at least one row.
struct PeerRunLimits {
  static constexpr int kMaxRows = 256;
  static constexpr int64_t kMaxBytes = 1 << 20;
  __device__ static __forceinline__ int max_rows(int64_t row_bytes) {
    if (row_bytes <= 0) return 1;
    const int64_t by_bytes = kMaxBytes / row_bytes;
    return static_cast<int>(by_bytes < 1 ? 1 : (by_bytes < kMaxRows ? by_bytes : kMaxRows));
  }
};

// [E4] A lane's open runs, one per peer d = lane + 32 * i (i < kSlots), kept in registers
// (every index is a compile-time constant). len 0: no open run. A run holds at most `max_len`
// tokens (PeerRunLimits).
struct PeerRuns {
  static constexpr int kSlots = static_cast<int>((kMaxWorld + 31) / 32);
  int t0[kSlots], row0[kSlots], len[kSlots];
  int max_len;
  __device__ __forceinline__ void init(int row_bytes) {
#pragma unroll
    for (int i = 0; i < kSlots; ++i) t0[i] = row0[i] = len[i] = 0;
    max_len = PeerRunLimits::max_rows(row_bytes);
  }
};

struct ProxyNet {
  // A descriptor per element is what made the transport slow: a dispatched token's metadata
  // travels to a proxied peer in whole rows, never element by element: the normal dispatch's
  // scales, top-k ids and weights as transfers of the caller's rows, untransformed (in runs,
  // `DispatchSender`; the receiver finishes them, [E8]); the low-latency dispatch's metadata
  // row from a metadata send row ([L3], `LlDispatchSender`).
  static constexpr bool kMetadataRows = true;
  // A signal is a copy-engine copy or an RDMA write, and the executor merges signals to
  // consecutive words into one copy: neither promises a reader the 8 bytes at once.
  static constexpr bool kWholeWords = false;

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

  // [P1] One thread: descriptor `p` (claimed) is a WRITE of the `n` (>= 1) consecutive int32
  // values v0, v0 + 1, ..., v0 + n - 1 into rank `pe`'s copy of dst[0 .. n) (a sequence write:
  // a run's token indices in one descriptor); false as `emit`.
  __device__ static __forceinline__ bool emit_write_seq(uint64_t p, int32_t* dst, int32_t v0,
                                                        uint32_t n, int pe) {
    return emit(p, kProxyKindWrite, n > 1 ? kProxyFlagWriteSequence : 0, pe, offset_of(dst),
                static_cast<uint32_t>(v0),
                sizeof(int32_t) | (n > 1 ? static_cast<uint64_t>(n) << 32 : 0));
  }

  // [P1] One thread: descriptor `p` (claimed) is a SIGNAL setting rank `pe`'s copies of the
  // `words` (>= 1) consecutive words sig[0 .. words) to `v`, which lands after every descriptor
  // to `pe` of lower position; false as `emit`.
  __device__ static __forceinline__ bool emit_signal(uint64_t p, uint64_t* sig, uint64_t v,
                                                     int pe, uint32_t words = 1) {
    return emit(p, kProxyKindSignal, 0, pe, offset_of(sig), v, words > 1 ? words : 0);
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

  // Warp-collective put of a row followed by a signal add, which lands after the row.
  __device__ static __forceinline__ void put_signal_add_warp(void* dst, const void* src,
                                                             size_t bytes, uint64_t* sig,
                                                             uint64_t v, int pe) {
    __syncwarp();
    if ((threadIdx.x & 31) == 0) {
      __threadfence_system();
      const uint64_t p = claim(2);
      emit(p, kProxyKindTransfer, kProxyFlagSrcAddress, pe, reinterpret_cast<uint64_t>(src),
           offset_of(dst), bytes);
      emit(p + 1, kProxyKindSignal, kProxyFlagSignalAdd, pe, offset_of(sig), v, 0);
    }
    __syncwarp();
  }

  // [E4] A descriptor per token was slow as well: each warp takes a contiguous chunk of
  // tokens (`deal`), so that its tokens bound for a proxied peer form runs. Lane `l` keeps, in
  // registers, the open run of every proxied peer d = l + 32 * i: tokens t0 .. t0 + len - 1 of
  // this warp's chunk, bound for rows row0 .. row0 + len - 1 of d. A token extends its peer's
  // run when it continues it in both; otherwise (or when the run is full) the run is sent
  // (`put_run`) and a new one starts; the open runs go after the chunk. All of it in `first`,
  // before the body's stores: the copy engines move these rows while the SMs store the mapped
  // ranks' (sent along with the stores, the last runs, most of the rows, left only when the
  // warp's stores had ended, and the copies waited for them). Mapped ranks get the token by
  // stores, as under StoreNet.
  struct DispatchSender {
    PeerRuns runs;

    __device__ __forceinline__ explicit DispatchSender(const DispatchSend& op) {
      runs.init(op.a.row_bytes);
    }

    __device__ static __forceinline__ TokenDeal deal(int gwarp, int nwarps, int n) {
      return deal_chunks(gwarp, nwarps, n);
    }

    // Lane by lane (each lane its own peers' runs, every row read from the routing here, no
    // scratch), the warp meeting again at the end.
    __device__ __forceinline__ void first(const DispatchSend& op, const TokenDeal& deal,
                                          const int32_t* token_slot, const int* offsets, int*) {
      const int lane = op.lane, world = op.world;
      const OpArgs& a = op.a;
      if (a.remote_mask != 0) {
        for (int t = deal.first; t < deal.end; t += deal.step) {
#pragma unroll
          for (int i = 0; i < PeerRuns::kSlots; ++i) {
            const int d = lane + 32 * i;
            if (d >= world || !remote(a.remote_mask, d)) continue;
            const int slot = token_slot[static_cast<int64_t>(t) * world + d];
            if (slot < 0) continue;
            const int row = offsets[d] + slot, len = runs.len[i];
            if (len > 0 && len < runs.max_len && t == runs.t0[i] + len &&
                row == runs.row0[i] + len) {
              runs.len[i] = len + 1;
              continue;
            }
            if (len > 0) put_run(op, d, runs.t0[i], runs.row0[i], len);
            runs.t0[i] = t;
            runs.row0[i] = row;
            runs.len[i] = 1;
          }
        }
#pragma unroll
        for (int i = 0; i < PeerRuns::kSlots; ++i)
          if (runs.len[i] > 0) put_run(op, lane + 32 * i, runs.t0[i], runs.row0[i], runs.len[i]);
      }
      __syncwarp();
    }

    // Stores to every mapped rank; a proxied rank's rows travel in its runs.
    __device__ __forceinline__ void send_row(const DispatchSend& op, const int4* src,
                                             const int* rows, int n16) const {
      warp_copy_row_multi<ProxyNet>(src, op.bases, rows, op.off_x, op.a.row_bytes, op.world, n16,
                                    op.lane, op.a.remote_mask);
    }

    __device__ __forceinline__ bool elements(const DispatchSend& op, int d) const {
      return !remote(op.a.remote_mask, d);
    }

    // One thread sends run (t0, row0, len) to proxied peer d: ONE claim of consecutive ring
    // positions (after a system fence, as every put), then the `len` x rows as one TRANSFER,
    // the scales, top-k ids and top-k weights (those the op has) as one TRANSFER each of the
    // `len` raw caller rows ([E8] finishes the ids and weights on the receiver), then the `len`
    // source indices t0 .. t0 + len - 1 as ONE sequence WRITE: a run costs 2 to 5 descriptors
    // whatever its length (it cost one more per token). No warp collective: one lane calls it. A descriptor that could not be written (the proxy stopped, or the slot
    // wait's bound passed) ends the run early: the proxy cannot pass that position, and the
    // block's `quiet` records the failure, so the rest would only wait out the bound again,
    // slot by slot. (Static, on the caller's description: a sender that kept the description
    // next to its run state compiled to a different dispatch.)
    __device__ static __forceinline__ void put_run(const DispatchSend& op, int d, int t0, int row0,
                                                   int len) {
      const OpArgs& a = op.a;
      const int K = op.top_k;
      const bool has_scales = op.has_scales, has_topk = op.has_topk, has_w = op.has_w;
      const uint64_t off_x = op.off_x, off_scales = op.off_scales, off_topk_idx = op.off_topk_idx,
                     off_topk_w = op.off_topk_w, off_src_idx = op.off_src_idx;
      const float* scales = op.scales;
      const int64_t* topk_idx = op.topk_idx;
      const float* topk_w = op.topk_w;
      uint8_t* const base = op.bases[d];
      const int pe = peer_pe(op.w, d);
      const bool sc = has_scales && a.num_scales > 0, ids = has_topk && K > 0;
      const bool wts = ids && has_w;
      const int64_t t = t0, row = row0, n = len;
      uint64_t p = claim_fenced(static_cast<uint32_t>(1 + sc + ids + wts + 1));
      if (!emit_transfer(p++, base + off_x + row * a.row_bytes,
                         reinterpret_cast<const uint8_t*>(a.x) + t * a.row_bytes,
                         static_cast<size_t>(n * a.row_bytes), pe))
        return;
      if (sc && !emit_transfer(p++, base + off_scales + row * a.num_scales * 4,
                               scales + t * a.num_scales,
                               static_cast<size_t>(n * a.num_scales * 4), pe))
        return;
      if (ids && !emit_transfer(p++, base + off_topk_idx + row * K * 8, topk_idx + t * K,
                                static_cast<size_t>(n * K * 8), pe))
        return;
      if (wts && !emit_transfer(p++, base + off_topk_w + row * K * 4, topk_w + t * K,
                                static_cast<size_t>(n * K * 4), pe))
        return;
      int32_t* const src_idx = reinterpret_cast<int32_t*>(base + off_src_idx) + row;
      emit_write_seq(p, src_idx, static_cast<int32_t>(t0), static_cast<uint32_t>(len), pe);
    }
  };

  // [E8] Block 0, after [E6]: the rows of proxied sources carry the senders' raw top-k ids and
  // weights; make them what a store sender writes (ids of my experts made local, every other
  // id -1 with weight 0). Only those rows (recv_prefix[r] .. recv_prefix[r + 1] for r in
  // remote_mask); every source's data landed ([E6]) and the op owns its receive region until
  // it ends. `local`: this rank's buffer; thread `tid` of `nthreads`.
  __device__ static __forceinline__ void finish_dispatch(const DispatchSend& op, uint8_t* local,
                                                         int tid, int nthreads) {
    const OpArgs& a = op.a;
    const int K = op.top_k, epr = op.epr;
    if (op.has_topk && a.remote_mask != 0) {
      const int* prefix = reinterpret_cast<const int*>(a.recv_prefix);
      const int64_t lo = static_cast<int64_t>(op.me) * epr;
      int64_t* ids = reinterpret_cast<int64_t*>(local + op.off_topk_idx);
      float* wts = reinterpret_cast<float*>(local + op.off_topk_w);
      for (int r = 0; r < op.world; ++r) {
        if (!remote(a.remote_mask, r)) continue;
        const int64_t end = static_cast<int64_t>(prefix[r + 1]) * K;
        for (int64_t i = static_cast<int64_t>(prefix[r]) * K + tid; i < end; i += nthreads) {
          const int64_t e = ids[i];
          const bool here = e >= lo && e < lo + epr;
          ids[i] = here ? e - lo : int64_t{-1};
          if (op.has_w && !here) wts[i] = 0.f;
        }
      }
    }
  }

  // [C1] A descriptor per row was slow too: rows for proxied peers go first, in a pass of their
  // own (`push_runs`), so that their descriptors reach the proxy before this warp's stores to
  // mapped peers. Each warp takes a contiguous chunk of rows; rows row0 .. row0 + len - 1 of
  // the chunk, all from proxied source r and holding its tokens t0 .. t0 + len - 1, go to r's
  // consecutive slots (me, t0 .. t0 + len - 1). Rows of a source are contiguous in y and in
  // token order, so a run ends at a source change (it is sent at once: it cannot grow again),
  // at a token of r that does not come to this rank, at the chunk's end, or at PeerRunLimits'
  // size. The run state is warp-uniform; one lane sends a run (`put_run`). Rows for mapped
  // peers keep the body's block-first deal and stores.
  struct CombinePusher {
    __device__ __forceinline__ explicit CombinePusher(const CombinePush&) {}

    // (op's fields in locals, as the body had them: the same code as when this pass was the
    // body's.)
    __device__ __forceinline__ void push_runs(const CombinePush& op, int gwarp, int nwarps,
                                              int num_rows) const {
      const OpArgs& a = op.a;
      uint8_t* const* bases = op.bases;
      const WaitCtx& w = op.w;
      const int world = op.world, me = op.me, K = op.top_k, lane = op.lane;
      const int64_t row_bytes = op.row_bytes;
      const bool has_w = op.has_w;
      const uint8_t* y = op.y;
      const float* y_w = op.y_w;
      const uint64_t off_comb_x = op.off_comb_x, off_comb_w = op.off_comb_w, epoch = op.epoch;
      const TokenDeal chunk = deal_chunks(gwarp, nwarps, num_rows);
      const int run_max = PeerRunLimits::max_rows(row_bytes);
      int run_r = -1, run_t0 = 0, run_row0 = 0, run_len = 0;
      // One lane sends the open run: ONE claim of consecutive ring positions (after a system
      // fence, as every put), then the run's weights (when the op has them) and rows as one
      // TRANSFER each, then ONE SIGNAL over the run's flag words (flags[me][t0 .. t0 + len) =
      // epoch), which the ring lands after both transfers: 2 or 3 descriptors per run. A descriptor that could not be written (the
      // proxy stopped, or the slot wait's bound passed) ends the run early: the proxy cannot
      // pass that position, and the block's `quiet` records the failure.
      auto put_run = [&]() {
        if (run_len > 0 && lane == 0) {
          uint8_t* const base = bases[run_r];
          const int pe = peer_pe(w, run_r);
          const bool wts = has_w && K > 0;
          const int64_t slot0 = static_cast<int64_t>(me) * a.max_tokens + run_t0, n = run_len;
          uint64_t p = claim_fenced(static_cast<uint32_t>(1 + wts + 1));
          bool sent = !wts || emit_transfer(p++, base + off_comb_w + slot0 * K * 4,
                                            y_w + static_cast<int64_t>(run_row0) * K,
                                            static_cast<size_t>(n * K * 4), pe);
          sent = sent && emit_transfer(p++, base + off_comb_x + slot0 * row_bytes,
                                       y + static_cast<int64_t>(run_row0) * row_bytes,
                                       static_cast<size_t>(n * row_bytes), pe);
          uint64_t* const run_flags = u64_at(base, a.off_comb_flags) + slot0;
          if (sent) emit_signal(p, run_flags, epoch, pe, static_cast<uint32_t>(run_len));
        }
        run_len = 0;
      };
      for (int row = chunk.first; row < chunk.end; ++row) {
        const int r = row_rank(op.offsets, world, row);
        if (r != run_r) put_run();  // rows of run_r are over
        if (r == me || !remote(a.remote_mask, r)) continue;
        const int t = op.src_idx[row];
        if (run_len > 0 && t == run_t0 + run_len && row == run_row0 + run_len &&
            run_len < run_max) {
          ++run_len;
          continue;
        }
        put_run();
        run_r = r;
        run_t0 = t;
        run_row0 = row;
        run_len = 1;
      }
      put_run();  // the chunk's last run; every run is claimed before quiet's block barrier
      __syncwarp();
    }

    __device__ __forceinline__ bool sent(const CombinePush& op, int r) const {
      return remote(op.a.remote_mask, r);
    }

    // Rows of proxied sources went in `push_runs`.
    __device__ __forceinline__ bool push(const CombinePush&, int, int, int64_t) const {
      return false;
    }
  };

  // [L3] Rows and FP8 rows by warp puts (TRANSFERs); a proxied rank's metadata row is staged
  // in this rank's metadata send rows as it will land there (`meta_row`: the body writes it
  // with stores), then sent as one transfer (`put_meta`).
  struct LlDispatchSender : PutLlDispatchSender<ProxyNet> {
    __device__ __forceinline__ explicit LlDispatchSender(const LlDispatchSend& op)
        : PutLlDispatchSender<ProxyNet>(op) {}

    __device__ __forceinline__ int32_t* meta_row(const LlDispatchSend& op, int d, int row,
                                                 bool& is_remote) const {
      int32_t* meta = reinterpret_cast<int32_t*>(op.bases[d] + op.off_meta) +
                      static_cast<int64_t>(row) * (op.top_k + 1);
      if (is_remote) {
        meta = reinterpret_cast<int32_t*>(op.bases[op.me] + op.a.off_ll_send_meta) +
               (static_cast<int64_t>(d) * op.max_tokens + row) * (op.top_k + 1);
        is_remote = false;
      }
      return meta;
    }

    // Every staged row to its peer (lane i: the i-th rank), after a warp barrier and a fence.
    __device__ __forceinline__ void put_meta(const LlDispatchSend& op, const int* rows) const {
      if (op.a.remote_mask == 0) return;
      const int K = op.top_k;
      __syncwarp();
      __threadfence();
      for (int d0 = 0; d0 < op.world; d0 += 32) {
        const int d = d0 + op.lane;
        const bool valid = d < op.world && rows[d] >= 0 && remote(op.a.remote_mask, d);
        void* dst = nullptr;
        const void* src = nullptr;
        if (valid) {
          const int64_t j = rows[d];
          dst = op.bases[d] + op.off_meta + j * (K + 1) * 4;
          src = reinterpret_cast<const int32_t*>(op.bases[op.me] + op.a.off_ll_send_meta) +
                (static_cast<int64_t>(d) * op.max_tokens + j) * (K + 1);
        }
        put_lanes(valid, dst, src, static_cast<size_t>(K + 1) * 4, d);
      }
    }
  };

  // [L8] A proxied rank's row by one TRANSFER.
  __device__ static __forceinline__ bool put_row(bool is_remote, void* dst, const void* src,
                                                 size_t bytes, int pe) {
    return put_row_if_remote<ProxyNet>(is_remote, dst, src, bytes, pe);
  }
};

}  // namespace epcomm
