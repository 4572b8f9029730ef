// Copy primitives: one warp moves rows of 16-byte vectors, each lane keeping kCopyUnroll
// vectors in flight (loads of all of them first, then the stores).
#pragma once
#include <cstddef>
#include <cstdint>

#include "common/ptx.cuh"

namespace epcomm {

constexpr int kCopyUnroll = 8;  // 16-byte vectors per lane in flight per copy step

// One copy step of a lane: vectors base + u * 32 + lane (u < U) that are below n16.
template <int U>
__device__ __forceinline__ void load_step(int4 (&v)[U], const int4* src, int base, int n16,
                                          int lane) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int i = base + u * 32 + lane;
    if (i < n16) v[u] = ld_nc_v4(src + i);
  }
}
template <int U>
__device__ __forceinline__ void store_step(int4* out, const int4 (&v)[U], int base, int n16,
                                           int lane) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int i = base + u * 32 + lane;
    if (i < n16) st_na_v4(out + i, v[u]);
  }
}

// Copies one row of `n16` 16-byte vectors from `src` to row `rows[d]` of the region at
// `bases[d] + off` for every destination d with rows[d] >= 0 (both tables in shared memory)
// that is a mapped rank: one reached through the transport (Net::remote) gets its row from the
// policy's own send (common/net.cuh, `send_row`). One warp.
template <class Net>
__device__ __forceinline__ void warp_copy_row_multi(const int4* src, uint8_t* const* bases,
                                                    const int* rows, uint64_t off,
                                                    int64_t row_bytes, int ndst, int n16,
                                                    int lane, uint64_t remote_mask) {
  for (int base = 0; base < n16; base += 32 * kCopyUnroll) {
    int4 v[kCopyUnroll];
    load_step(v, src, base, n16, lane);
    for (int d = 0; d < ndst; ++d) {
      const int row = rows[d];
      if (row < 0 || Net::remote(remote_mask, d)) continue;
      store_step(reinterpret_cast<int4*>(bases[d] + off + row * row_bytes), v, base, n16, lane);
    }
  }
}

// One row, one destination, U vectors per lane in flight (U * 512 bytes per warp; U * 4
// registers: the combine's push, which holds nothing else live, runs U = 16).
template <int U = kCopyUnroll>
__device__ __forceinline__ void warp_copy_row(const int4* src, int4* out, int n16, int lane) {
  for (int base = 0; base < n16; base += 32 * U) {
    int4 v[U];
    load_step(v, src, base, n16, lane);
    store_step(out, v, base, n16, lane);
  }
}

}  // namespace epcomm
