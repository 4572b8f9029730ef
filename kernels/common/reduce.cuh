// The combine reduction's arithmetic, shared by the normal ([C4]) and low-latency ([L9])
// combines: eight bf16 values of a 16-byte vector added into f32 accumulators (plain, or each
// times a weight, rounded to nearest at every step), and eight accumulators rounded to bf16
// once. The order of the additions is the caller's: it fixes the bits (docs/protocol.md).
#pragma once
#include <cuda_bf16.h>

namespace epcomm {

// acc[j] += v[j] (f32).
__device__ __forceinline__ void add_bf16x8(float* acc, const int4& v) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = __bfloat1622float2(h[j]);
    acc[2 * j] += f.x;
    acc[2 * j + 1] += f.y;
  }
}

// acc[j] = rn(acc[j] + rn(w * v[j])) (f32; no fused multiply-add, so the bits do not depend
// on the compiler's contraction).
__device__ __forceinline__ void add_weighted_bf16x8(float* acc, const int4& v, float w) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = __bfloat1622float2(h[j]);
    acc[2 * j] = __fadd_rn(acc[2 * j], __fmul_rn(w, f.x));
    acc[2 * j + 1] = __fadd_rn(acc[2 * j + 1], __fmul_rn(w, f.y));
  }
}

// Eight accumulators rounded to bf16 (to nearest even), packed into one 16-byte vector.
__device__ __forceinline__ int4 pack_bf16x8(const float* acc) {
  int4 v;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int j = 0; j < 4; ++j) h[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
  return v;
}

}  // namespace epcomm
