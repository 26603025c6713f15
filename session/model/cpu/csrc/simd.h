// Sixteen float32 lanes for our CPU kernels, on AVX-512 (one __m512) or on AVX2 with FMA (two __m256:
// lanes 0-7 and 8-15). Every operation is lane by lane with the same rounding on both, so a kernel
// written on V16 computes the same bits on either instruction set: its order of additions is per
// lane and does not depend on the register width. session/model/cpu/kernels.py builds each kernel for the
// widest set the CPU reports (a change here rebuilds every kernel: the cache key covers the headers
// in this folder).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#if !defined(__AVX512F__) && !(defined(__AVX2__) && defined(__FMA__))
#error "our CPU kernels need AVX-512 or AVX2 with FMA"
#endif

namespace resident {
namespace simd {

constexpr int kLanes = 16;

#if defined(__AVX512F__)

struct V16 {
  __m512 v;
};
using M16 = __mmask16;  // a lane mask

inline V16 zero() { return {_mm512_setzero_ps()}; }
inline V16 set1(float x) { return {_mm512_set1_ps(x)}; }
inline V16 set1_bits(int32_t bits) { return {_mm512_castsi512_ps(_mm512_set1_epi32(bits))}; }
inline V16 loadu(const float* p) { return {_mm512_loadu_ps(p)}; }
inline V16 loadu(const uint16_t* p) {  // 16 bfloat16 -> float32 (exact)
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))};
}
inline V16 from_int8(__m128i bytes) { return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes))}; }  // exact
inline V16 loadu(const int8_t* p) { return from_int8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline void storeu(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
inline void store_first(float* p, V16 a, int count) {  // lanes 0 .. count-1 (count <= 16)
  _mm512_mask_storeu_ps(p, count >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1), a.v);
}
inline V16 add(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 sub(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V16 mul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 max(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline V16 fmadd(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }    // a b + c, one rounding
inline V16 fnmadd(V16 a, V16 b, V16 c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }  // c - a b, one rounding
inline V16 floor(V16 a) { return {_mm512_floor_ps(a.v)}; }
inline V16 round_even(V16 a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline V16 scale2(V16 p, V16 n) { return {_mm512_scalef_ps(p.v, n.v)}; }  // p 2^n for whole n, rounded once
inline V16 truncate_bits(V16 a) { return {_mm512_castsi512_ps(_mm512_cvttps_epi32(a.v))}; }  // int32 bits
inline M16 less(V16 a, V16 b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_LT_OS); }
inline M16 greater(V16 a, V16 b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_GT_OS); }
inline M16 unordered(V16 a) { return _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q); }
inline V16 select(M16 m, V16 if_set, V16 otherwise) { return {_mm512_mask_mov_ps(otherwise.v, m, if_set.v)}; }
inline V16 round_bits_to_bf16(V16 a) {  // float32 -> bfloat16, nearest even, as the top 16 bits (NaN kept)
  const __m512i u = _mm512_castps_si512(a.v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(u, lsb), _mm512_set1_epi32(0x7FFF)),
                                           _mm512_set1_epi32(int(0xFFFF0000)));
  return select(unordered(a), set1_bits(0x7FC00000), {_mm512_castsi512_ps(rounded)});
}

#else  // AVX2 + FMA

struct V16 {
  __m256 lo, hi;
};
struct M16 {
  __m256 lo, hi;  // all ones where set
};

inline V16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V16 set1_bits(int32_t bits) {
  const __m256 v = _mm256_castsi256_ps(_mm256_set1_epi32(bits));
  return {v, v};
}
inline V16 loadu(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline __m256 bf16x8(const uint16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline V16 loadu(const uint16_t* p) { return {bf16x8(p), bf16x8(p + 8)}; }
inline __m256 int8x8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline V16 loadu(const int8_t* p) { return {int8x8(p), int8x8(p + 8)}; }  // 16 int8 -> float32 (exact)
inline V16 from_int8(__m128i bytes) {  // 16 int8 -> float32 (exact)
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)))};
}
inline void storeu(float* p, V16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline void store_first(float* p, V16 a, int count) {
  if (count >= kLanes) return storeu(p, a);
  alignas(32) float lanes[kLanes];
  _mm256_store_ps(lanes, a.lo);
  _mm256_store_ps(lanes + 8, a.hi);
  std::memcpy(p, lanes, count * sizeof(float));
}
#define RESIDENT_LANEWISE2(name, op) \
  inline V16 name(V16 a, V16 b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
RESIDENT_LANEWISE2(add, _mm256_add_ps)
RESIDENT_LANEWISE2(sub, _mm256_sub_ps)
RESIDENT_LANEWISE2(mul, _mm256_mul_ps)
RESIDENT_LANEWISE2(max, _mm256_max_ps)
#undef RESIDENT_LANEWISE2
inline V16 fmadd(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline V16 fnmadd(V16 a, V16 b, V16 c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline V16 floor(V16 a) { return {_mm256_floor_ps(a.lo), _mm256_floor_ps(a.hi)}; }
inline V16 round_even(V16 a) {
  constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, mode), _mm256_round_ps(a.hi, mode)};
}
inline __m256 pow2(__m256 n) {  // 2^n for whole n in [-126, 127], exact
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline __m256 scale2(__m256 p, __m256 n) {
  // n in two halves, each within a normal power of two (|n| <= 252): p 2^a is exact for p near 1, and
  // times 2^b rounds once, where the result is subnormal, as VSCALEFPS does
  const __m256 a = _mm256_round_ps(_mm256_mul_ps(n, _mm256_set1_ps(0.5f)), _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
  return _mm256_mul_ps(_mm256_mul_ps(p, pow2(a)), pow2(_mm256_sub_ps(n, a)));
}
inline V16 scale2(V16 p, V16 n) { return {scale2(p.lo, n.lo), scale2(p.hi, n.hi)}; }
inline V16 truncate_bits(V16 a) {
  return {_mm256_castsi256_ps(_mm256_cvttps_epi32(a.lo)), _mm256_castsi256_ps(_mm256_cvttps_epi32(a.hi))};
}
inline M16 less(V16 a, V16 b) { return {_mm256_cmp_ps(a.lo, b.lo, _CMP_LT_OS), _mm256_cmp_ps(a.hi, b.hi, _CMP_LT_OS)}; }
inline M16 greater(V16 a, V16 b) {
  return {_mm256_cmp_ps(a.lo, b.lo, _CMP_GT_OS), _mm256_cmp_ps(a.hi, b.hi, _CMP_GT_OS)};
}
inline M16 unordered(V16 a) {
  return {_mm256_cmp_ps(a.lo, a.lo, _CMP_UNORD_Q), _mm256_cmp_ps(a.hi, a.hi, _CMP_UNORD_Q)};
}
inline V16 select(M16 m, V16 if_set, V16 otherwise) {
  return {_mm256_blendv_ps(otherwise.lo, if_set.lo, m.lo), _mm256_blendv_ps(otherwise.hi, if_set.hi, m.hi)};
}
inline __m256 round_bits_to_bf16(__m256 a) {
  const __m256i u = _mm256_castps_si256(a);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  return _mm256_castsi256_ps(_mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(u, lsb), _mm256_set1_epi32(0x7FFF)),
                                              _mm256_set1_epi32(int(0xFFFF0000))));
}
inline V16 round_bits_to_bf16(V16 a) {
  return select(unordered(a), set1_bits(0x7FC00000), {round_bits_to_bf16(a.lo), round_bits_to_bf16(a.hi)});
}

#endif

// the lanes, in order, into 16 floats
inline void lanes_of(V16 a, float* out) { storeu(out, a); }

inline float reduce_max(V16 a) {  // a maximum is exact in any order
  alignas(64) float lanes[kLanes];
  lanes_of(a, lanes);
  float best = lanes[0];
  for (int i = 1; i < kLanes; ++i) best = lanes[i] > best ? lanes[i] : best;
  return best;
}

}  // namespace simd
}  // namespace resident
