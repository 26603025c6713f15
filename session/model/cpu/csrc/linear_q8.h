// int8 and int4 weights times int8-quantized activations on CPU (the Q8Lines format): what llama.cpp
// does with its Q8_0 and Q4 files, integer dot products per group of 32 inputs. Included by
// csrc/linear_q8.cpp (the operators) and csrc/decode_layer_q8.cpp (the C++ decode layer and step):
// ``Prepared<Q8Lines>`` is linear_tiles.h's ``Prepared`` for this format, so run_linears and the decode
// layer take it as they take the float32-input formats.
//
// Activations, per row and group of 32 inputs (llama.cpp's Q8_1): scale = max |x| / 127 (0 where the
// group is all zeros), q = x / scale rounded to nearest even (-127 .. 127), and the group's sum of q.
//
// Weights, packed per block of 16 outputs (NB = ceil(n / 16)) and group of 32 inputs: L lines of 64
// bytes of unsigned weights u (8 bits: L = 8, line j byte 4l + b = u[l][4j + b]; 4 bits: L = 4, line j
// byte 4l + b = u[l][8j + b] | u[l][8j + 4 + b] << 4), then the group's 16 scales s, then its 16 offsets o
// (zero past n), in float32, or in float16 where every one is a float16 (a GGUF file's Q8_0, Q4_0 and Q4_1:
// a quarter fewer bytes to stream for int4): the weight is s (u - Z) + o, Z = 128 (8 bits: s q, q = u - 128) or 0
// (4 bits: s u + o, Q4_1's form; Q4_0's o = -8 s). Stored
// as int16 (the dtype names the format: session/model/cpu/linear.py's pack_q8), [NB, K / 32, group bytes / 2];
// the group's byte count tells the four layouts apart.
//
// Each output lane, per group: d = sum of u q - Z sum(q), an exact int32 (VPDPBUSD on AVX512-VNNI;
// VPMADDUBSW and VPMADDWD on AVX2, the same integer), then part = fma(float(d), s * scale, (o * scale) *
// float(sum(q))); the parts added in order from zero; then + bias. Every float step is per lane in a
// fixed order, so AVX-512 and AVX2 give the same bits, and a row's outputs do not depend on the other
// rows or the thread count. Against the float32 product, the error is the activations' rounding (half a
// step of max |x| / 127 per group), as llama.cpp's.
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include "linear_tiles.h"
#include "parallel.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace q8 {

constexpr int kGroup = 32;
constexpr int kLanes = 16;
constexpr int kLine = 64;

inline int lines_of(int bits) { return bits == 8 ? 8 : 4; }
inline int32_t zero_of(int bits) { return bits == 8 ? 128 : 0; }
// a group's bytes: its lines, then 16 scales and 16 offsets in float32 (two lines) or float16 (one)
inline int64_t group_bytes(int bits, bool halves) { return lines_of(bits) * kLine + (halves ? 1 : 2) * kLine; }

// ------------------------------------------------------------------ 16 int32 / float32 lanes

#if defined(__AVX512F__)
#if !defined(__AVX512VNNI__)
#error "the AVX-512 build needs AVX512-VNNI (session/model/cpu/kernels.py builds AVX2 otherwise)"
#endif
struct I16 {
  __m512i v;
};
struct F16 {
  __m512 v;
};
inline I16 izero() { return {_mm512_setzero_si512()}; }
inline F16 fzero() { return {_mm512_setzero_ps()}; }
inline F16 fload(const uint8_t* p) { return {_mm512_loadu_ps(p)}; }
inline F16 hload(const uint8_t* p) {  // 16 float16 -> float32 (exact)
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline F16 fset1(float x) { return {_mm512_set1_ps(x)}; }
inline F16 to_float(I16 a) { return {_mm512_cvtepi32_ps(a.v)}; }
inline I16 sub_zero(I16 a, int32_t z) { return {_mm512_sub_epi32(a.v, _mm512_set1_epi32(z))}; }
inline I16 iadd(I16 a, I16 b) { return {_mm512_add_epi32(a.v, b.v)}; }
inline F16 fmul(F16 a, F16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline F16 fadd(F16 a, F16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline F16 fmadd(F16 a, F16 b, F16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline void fstore_first(float* p, F16 a, int count) {
  _mm512_mask_storeu_ps(p, count >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1), a.v);
}
struct Line {  // 64 bytes: 16 lanes of 4 unsigned weights
  __m512i v;
};
inline Line load_line(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }
inline Line low_nibbles(Line l) { return {_mm512_and_si512(l.v, _mm512_set1_epi8(0x0F))}; }
inline Line high_nibbles(Line l) { return {_mm512_and_si512(_mm512_srli_epi16(l.v, 4), _mm512_set1_epi8(0x0F))}; }
// per lane: acc + the 4 products of its 4 unsigned weights with the 4 signed activations in x4
template <int kBits>
inline I16 dot(I16 acc, Line u, int32_t x4) { return {_mm512_dpbusd_epi32(acc.v, u.v, _mm512_set1_epi32(x4))}; }
#else  // AVX2: lanes 0-7 in lo, 8-15 in hi
struct I16 {
  __m256i lo, hi;
};
struct F16 {
  __m256 lo, hi;
};
inline I16 izero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline F16 fzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F16 fload(const uint8_t* p) {
  return {_mm256_loadu_ps(reinterpret_cast<const float*>(p)), _mm256_loadu_ps(reinterpret_cast<const float*>(p) + 8)};
}
inline F16 hload(const uint8_t* p) {  // 16 float16 -> float32 (exact; F16C)
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
}
inline F16 fset1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline F16 to_float(I16 a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline I16 sub_zero(I16 a, int32_t z) {
  const __m256i zz = _mm256_set1_epi32(z);
  return {_mm256_sub_epi32(a.lo, zz), _mm256_sub_epi32(a.hi, zz)};
}
inline I16 iadd(I16 a, I16 b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
inline F16 fmul(F16 a, F16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline F16 fadd(F16 a, F16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline F16 fmadd(F16 a, F16 b, F16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline void fstore_first(float* p, F16 a, int count) {
  alignas(32) float lanes[kLanes];
  _mm256_store_ps(lanes, a.lo);
  _mm256_store_ps(lanes + 8, a.hi);
  std::memcpy(p, lanes, std::min(count, kLanes) * sizeof(float));
}
struct Line {
  __m256i lo, hi;
};
inline Line load_line(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
inline Line low_nibbles(Line l) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  return {_mm256_and_si256(l.lo, mask), _mm256_and_si256(l.hi, mask)};
}
inline Line high_nibbles(Line l) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  return {_mm256_and_si256(_mm256_srli_epi16(l.lo, 4), mask), _mm256_and_si256(_mm256_srli_epi16(l.hi, 4), mask)};
}
// 8 lanes: acc + u x (4 products each). VPMADDUBSW saturates pairs at int16: 4-bit u (<= 15) cannot; for
// 8-bit u, (u - 128) x is summed on |u - 128| with x's sign moved over (|pair| <= 2 128 127), and 128 x added.
template <int kBits>
inline __m256i dot8(__m256i acc, __m256i u, __m256i x) {
  const __m256i ones = _mm256_set1_epi16(1);
  if (kBits == 4) return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), ones));
  const __m256i high = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i centred = _mm256_xor_si256(u, high);  // u - 128 as int8
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(centred), _mm256_sign_epi8(x, centred));
  const __m256i shifted = _mm256_madd_epi16(_mm256_maddubs_epi16(high, x), ones);  // 128 x
  return _mm256_add_epi32(_mm256_add_epi32(acc, _mm256_madd_epi16(pairs, ones)), shifted);
}
template <int kBits>
inline I16 dot(I16 acc, Line u, int32_t x4) {
  const __m256i x = _mm256_set1_epi32(x4);
  return {dot8<kBits>(acc.lo, u.lo, x), dot8<kBits>(acc.hi, u.hi, x)};
}
#endif

// ------------------------------------------------------------------ activations

// One row's groups: q [K] int8, then per group its float32 scale, then per group its int32 sum of q.
struct Rows {
  const int8_t* q;
  const float* scales;
  const int32_t* sums;
  int64_t stride;  // bytes from one row to the next
};

inline int64_t row_bytes(int64_t k) { return k + (k / kGroup) * (sizeof(float) + sizeof(int32_t)); }

// x [M, K] float32 -> rows of ``row_bytes(K)`` in ``out`` (int8 [M, row_bytes]).
inline Rows quantize_rows(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), k = x.size(1), groups = k / kGroup, stride = row_bytes(k);
  buffer(out, {rows, stride}, x.options().dtype(at::kChar));
  int8_t* base = out.data_ptr<int8_t>();
  resident::for_each_shared(rows, [&](int64_t m) {
    const float* from = x.data_ptr<float>() + m * x.stride(0);
    int8_t* q = base + m * stride;
    float* scales = reinterpret_cast<float*>(q + k);
    int32_t* sums = reinterpret_cast<int32_t*>(scales + groups);
    for (int64_t g = 0; g < groups; ++g) {
      const float* group = from + g * kGroup;
#if defined(__AVX512F__)
      const __m512 a = _mm512_loadu_ps(group), b = _mm512_loadu_ps(group + 16);
      const float most = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
#else
      float most = 0.0f;
      for (int j = 0; j < kGroup; ++j) most = std::max(most, std::fabs(group[j]));
#endif
      const float scale = most / 127.0f;
      const float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
#if defined(__AVX512F__)  // x inverse rounded to nearest even (the default rounding), as nearbyint below
      const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inverse)));
      const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inverse)));
      const __m512i limit = _mm512_set1_epi32(127);
      const __m512i ca = _mm512_max_epi32(_mm512_min_epi32(qa, limit), _mm512_sub_epi32(_mm512_setzero_si512(), limit));
      const __m512i cb = _mm512_max_epi32(_mm512_min_epi32(qb, limit), _mm512_sub_epi32(_mm512_setzero_si512(), limit));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + g * kGroup), _mm512_cvtepi32_epi8(ca));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + g * kGroup + 16), _mm512_cvtepi32_epi8(cb));
      const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(ca, cb));
#else
      int32_t sum = 0;
      for (int j = 0; j < kGroup; ++j) {
        const float v = std::nearbyint(group[j] * inverse);
        const int8_t qv = static_cast<int8_t>(std::clamp(v, -127.0f, 127.0f));
        q[g * kGroup + j] = qv;
        sum += qv;
      }
#endif
      scales[g] = scale;
      sums[g] = sum;
    }
  });
  const int8_t* q = base;
  return {q, reinterpret_cast<const float*>(q + k), reinterpret_cast<const int32_t*>(q + k + groups * sizeof(float)),
          stride};
}

// ------------------------------------------------------------------ the product

struct Problem {
  Rows x;
  const uint8_t* w;   // [NB, G, group_bytes]
  const float* bias;  // [n] (or padded to whole blocks) or nullptr
  float* y;           // [M, n]
  int64_t groups, n, group_bytes;
  bool halves;  // the scales and offsets in float16
};

inline int32_t quad(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Rows m0 .. m0+MR-1, output blocks b0 .. b0+NR-1: per group, MR x NR int32 sums, then their float parts.
template <int kBits, int MR, int NR>
void tile(const Problem& pb, int64_t m0, int64_t b0) {
  F16 total[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) total[m][r] = fzero();
  const int64_t block_bytes = pb.groups * pb.group_bytes;
  const int lines = lines_of(kBits);
  for (int64_t g = 0; g < pb.groups; ++g) {
    // two integer chains per row and block (lines alternate between them, added exactly at the group's
    // end): a one-row tile is otherwise one VPDPBUSD after another on one register, at its latency
    I16 acc[MR][NR][2];
    for (int m = 0; m < MR; ++m)
      for (int r = 0; r < NR; ++r) acc[m][r][0] = acc[m][r][1] = izero();
    const int8_t* xq[MR];
    for (int m = 0; m < MR; ++m) xq[m] = pb.x.q + (m0 + m) * pb.x.stride + g * kGroup;
    for (int r = 0; r < NR; ++r) {
      const uint8_t* w = pb.w + (b0 + r) * block_bytes + g * pb.group_bytes;
      for (int j = 0; j < lines; ++j) {
        const Line line = load_line(w + j * kLine);
        if (kBits == 8) {
          for (int m = 0; m < MR; ++m) acc[m][r][j & 1] = dot<8>(acc[m][r][j & 1], line, quad(xq[m] + 4 * j));
        } else {
          const Line first = low_nibbles(line), second = high_nibbles(line);
          for (int m = 0; m < MR; ++m) {
            acc[m][r][0] = dot<4>(acc[m][r][0], first, quad(xq[m] + 8 * j));
            acc[m][r][1] = dot<4>(acc[m][r][1], second, quad(xq[m] + 8 * j + 4));
          }
        }
      }
    }
    for (int r = 0; r < NR; ++r) {
      const uint8_t* trailer = pb.w + (b0 + r) * block_bytes + g * pb.group_bytes + lines * kLine;
      const F16 s = pb.halves ? hload(trailer) : fload(trailer);
      const F16 o = pb.halves ? hload(trailer + kLine / 2) : fload(trailer + kLine);
      for (int m = 0; m < MR; ++m) {
        const int64_t row = m0 + m;
        const float* scales = reinterpret_cast<const float*>(reinterpret_cast<const uint8_t*>(pb.x.scales) + row * pb.x.stride);
        const int32_t* sums = reinterpret_cast<const int32_t*>(reinterpret_cast<const uint8_t*>(pb.x.sums) + row * pb.x.stride);
        const F16 xs = fset1(scales[g]);
        const int32_t xsum = sums[g];
        const I16 d = sub_zero(iadd(acc[m][r][0], acc[m][r][1]), zero_of(kBits) * xsum);  // exact: |d| < 2^24
        const F16 part = fmadd(to_float(d), fmul(s, xs), fmul(fmul(o, xs), fset1(static_cast<float>(xsum))));
        total[m][r] = fadd(total[m][r], part);
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    float* out = pb.y + (m0 + m) * pb.n;
    for (int r = 0; r < NR; ++r) {
      const int64_t first = (b0 + r) * kLanes;
      const int count = static_cast<int>(std::min<int64_t>(kLanes, pb.n - first));
      F16 sum = total[m][r];
      if (pb.bias != nullptr) {
        alignas(64) float bias[kLanes] = {};
        std::memcpy(bias, pb.bias + first, count * sizeof(float));
        sum = fadd(sum, fload(reinterpret_cast<const uint8_t*>(bias)));
      }
      fstore_first(out + first, sum, count);
    }
  }
}

#if defined(__AVX512F__)
constexpr int kRowTile = 4;  // 4 rows x 2 blocks: 16 int32 and 8 float32 accumulators of 32 registers
constexpr int kFewRows = 2;  // up to 2 rows (decode): 4 blocks a tile, more chains side by side
// one row of 8-bit weights: 6 blocks a tile (a one-row pass over SmolLM2's linears 4-5% faster than 4
// on Zen 4; 4-bit weights, 4 lines a group, were 30% slower with 6 and keep 4: docs/MEASUREMENTS.md,
// "One row, six streams")
constexpr int kSingleBlocks8 = 6;
#else
constexpr int kRowTile = 2;  // AVX2: a lane set takes two registers
// AVX2: one row (a decode step of one sequence) takes 4 blocks a tile, four weight streams read side by
// side (a one-row pass over SmolLM2's linears 7-18% faster at 8 bits, 10-11% at 4: docs/MEASUREMENTS.md,
// "One row, six streams")
constexpr int kFewRows = 1;
constexpr int kSingleBlocks8 = 4;
#endif

// output blocks per tile for ``rows`` rows of ``bits``-bit weights
inline int64_t blocks_per_tile(int64_t rows, int bits) {
  if (rows == 1 && bits == 8) return kSingleBlocks8;
  return rows <= kFewRows ? 4 : 2;
}

template <int kBits, int NR>
void rows_of(const Problem& pb, int64_t rows, int64_t b0) {
  int64_t m0 = 0;
  for (; m0 + kRowTile <= rows; m0 += kRowTile) tile<kBits, kRowTile, NR>(pb, m0, b0);
  switch (rows - m0) {
    case 3: tile<kBits, 3, NR>(pb, m0, b0); break;
    case 2: tile<kBits, 2, NR>(pb, m0, b0); break;
    case 1: tile<kBits, 1, NR>(pb, m0, b0); break;
    default: break;
  }
}

template <int kBits>
void run_tile(const Problem& pb, int64_t rows, int64_t t) {
  const int64_t blocks = (pb.n + kLanes - 1) / kLanes, per_tile = blocks_per_tile(rows, kBits), b0 = t * per_tile;
  switch (std::min<int64_t>(per_tile, blocks - b0)) {
    case 6: rows_of<kBits, 6>(pb, rows, b0); break;
    case 5: rows_of<kBits, 5>(pb, rows, b0); break;
    case 4: rows_of<kBits, 4>(pb, rows, b0); break;
    case 3: rows_of<kBits, 3>(pb, rows, b0); break;
    case 2: rows_of<kBits, 2>(pb, rows, b0); break;
    default: rows_of<kBits, 1>(pb, rows, b0); break;
  }
}

}  // namespace q8

namespace {

// The format's name for linear_tiles.h's templates (run_linears, linear) and csrc/decode_layer.h.
struct Q8Lines {
  using Elem = float;
  static constexpr at::ScalarType kType = at::kFloat;
};

template <>
struct Prepared<Q8Lines> {
  at::Tensor x, y, bias_sums, quantized;  // quantized: the rows as pb.x reads them (held here)
  q8::Problem pb;
  int64_t rows = 0, column_tiles = 0;
  int bits = 8;

  Prepared(const at::Tensor& input, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t n,
           int64_t k_block) {
    at::Tensor out, rows_slot;
    init(input, packed, bias, n, out, rows_slot);
  }
  // ``sums`` holds the quantized rows (a decode step's workspace: allocated once per batch size)
  Prepared(const at::Tensor& input, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t n,
           int64_t k_block, at::Tensor& out, at::Tensor& sums) {
    init(input, packed, bias, n, out, sums);
  }

  void run_tile(int64_t t) const {
    if (bits == 8) {
      q8::run_tile<8>(pb, rows, t);
    } else {
      q8::run_tile<4>(pb, rows, t);
    }
  }

 private:
  void init(const at::Tensor& input, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t n,
            at::Tensor& out, at::Tensor& rows_slot) {
    x = input;
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "x: [M, K] float32, rows contiguous");
    rows = x.size(0);
    const int64_t k = x.size(1), groups = k / q8::kGroup, blocks = (n + q8::kLanes - 1) / q8::kLanes;
    TORCH_CHECK(k % q8::kGroup == 0, "x: K a multiple of 32");
    TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kShort && packed.is_contiguous() &&
                    packed.size(0) == blocks && packed.size(1) == groups,
                "packed: [ceil(n / 16), K / 32, (L + 2) 32] int16, contiguous");
    const int64_t bytes = packed.size(2) * 2;
    bool halves = false;
    for (int b : {8, 4})
      for (bool h : {false, true})
        if (bytes == q8::group_bytes(b, h)) bits = b, halves = h;
    TORCH_CHECK(bytes == q8::group_bytes(bits, halves), "packed: 8 or 4 lines per group, float32 or float16 scales");
    y = buffer(out, {rows, n}, x.options());
    if (bias.has_value() && bias->defined()) {
      const bool converted = bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->dim() == 1 &&
                             bias->size(0) >= n;
      bias_sums = converted ? *bias : bias->to(at::kFloat).contiguous();
    }
    const q8::Rows quantized_rows = rows == 0 ? q8::Rows{nullptr, nullptr, nullptr, 0} : q8::quantize_rows(x, rows_slot);
    quantized = rows_slot;
    pb = q8::Problem{quantized_rows, reinterpret_cast<const uint8_t*>(packed.data_ptr()),
                     bias_sums.defined() ? bias_sums.data_ptr<float>() : nullptr, y.data_ptr<float>(), groups, n, bytes,
                     halves};
    const int64_t per_tile = q8::blocks_per_tile(rows, bits);
    column_tiles = rows == 0 ? 0 : (blocks + per_tile - 1) / per_tile;
  }
};

}  // namespace
