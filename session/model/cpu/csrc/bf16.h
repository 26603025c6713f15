// bfloat16 <-> float32 bit conversions shared by our CPU kernels (session/model/cpu/kernels.py builds them; a
// change here rebuilds every kernel, as the cache key covers the headers in this folder).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace resident {

inline float bf16_to_float(uint16_t x) {  // exact
  const uint32_t bits = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as c10::BFloat16
  if (std::isnan(f)) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return uint16_t((u + ((u >> 16) & 1) + 0x7FFF) >> 16);
}

// The kernels' two element types, bfloat16 (its bits, uint16_t) and float32, to and from float32.
inline float to_float(uint16_t x) { return bf16_to_float(x); }
inline float to_float(float x) { return x; }
template <typename Elem> Elem from_float(float f);
template <> inline uint16_t from_float<uint16_t>(float f) { return float_to_bf16(f); }
template <> inline float from_float<float>(float f) { return f; }

}  // namespace resident
