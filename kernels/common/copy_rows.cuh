// Counted copy-out: the rows a dispatch received, copied from its receive region into caller
// memory, as many as the device says arrived. The count (and, for a CUDA graph replayed at
// either parity, which of the region's two parity copies to read) are read on the device, so a
// host that never learnt the count copies what arrived instead of the whole capacity.
#pragma once
#include <cstdint>

#include "common/ptx.cuh"

namespace epcomm {

// Copies rows [0, min(*count, max_rows)) of `row_bytes` each from `even` (or from `odd` when
// `parity` is non-null and *parity is odd) to `dst`; rows past the count are not written. Rows
// are contiguous in both, so this is one copy of count * row_bytes bytes: 16-byte vectors where
// both addresses are 16-byte aligned, 4-byte words otherwise and for the tail (row_bytes is a
// multiple of 4). Any grid; every thread strides over the whole range.
__device__ __forceinline__ void copy_counted_rows(uint8_t* dst, const uint8_t* even,
                                                  const uint8_t* odd, const int64_t* parity,
                                                  const int32_t* count, uint64_t row_bytes,
                                                  uint64_t max_rows) {
  const uint8_t* src = (parity != nullptr && (*parity & 1) != 0) ? odd : even;
  const int64_t n = *count;
  const uint64_t rows = n <= 0 ? 0 : (static_cast<uint64_t>(n) < max_rows ? n : max_rows);
  const uint64_t bytes = rows * row_bytes;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  const uint64_t first = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  uint64_t done = 0;
  if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & 15) == 0) {
    const uint64_t n16 = bytes / 16;
    const int4* s = reinterpret_cast<const int4*>(src);
    int4* d = reinterpret_cast<int4*>(dst);
    for (uint64_t i = first; i < n16; i += stride) d[i] = ld_nc_v4(s + i);
    done = n16 * 16;
  }
  const uint32_t* s4 = reinterpret_cast<const uint32_t*>(src + done);
  uint32_t* d4 = reinterpret_cast<uint32_t*>(dst + done);
  for (uint64_t i = first; i < (bytes - done) / 4; i += stride) d4[i] = s4[i];
}

}  // namespace epcomm
