// Our CPU linear kernel's tiles (csrc/linear_bf16.cpp and csrc/linear_f32.cpp document the layouts and
// the order of additions), shared by the linear operators and the decode layer (csrc/decode_layer.h),
// which runs several linears of one input (q, k, v; gate, up) in one parallel region. Four weight
// formats, the same tiles: bfloat16 pairs for VDPBF16PS (compiled with -mavx512bf16 only), float32
// lines for FMA, and for float32 inputs int8 lines with per-output scales (csrc/linear_i8.cpp) and
// int4 lines with per-group scales and offsets (csrc/linear_i4.cpp); the last three on AVX-512 or
// AVX2 (csrc/simd.h, the same bits on both). An unnamed namespace: each library keeps its own copy,
// nothing is exported.
//
// A format F names its element type (Elem: x and y), its weights' type (Weight) and elements per line
// (kLine: one input's, or pair's, weights for 16 outputs), the lines of trailer after each block's
// weights (``trailer_lines``: per group of k_block inputs the int8 block's 16 float32 scales, the int4
// block's scales and offsets), ``group`` (what a group reads from the trailer), ``load`` (one line as
// the products take it: int8 and int4 lines become float32) and ``close`` (a block's sums as they add
// to the others: the group scaled, int4 with kRowSums the rows' input sums it needs).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include "parallel.h"
#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <vector>

namespace {

using resident::simd::kLanes;
using resident::simd::V16;
namespace simd = resident::simd;

// rows x output blocks per tile, its accumulators in registers: 6 x 4 of AVX-512's 32; AVX2 has 16 of
// half the width (a V16 takes two), so 2 x 3 (one row still runs 6 chains of multiply-adds). From
// kTallRows rows on, AVX2 takes 6 x 1 (oneDNN's 6 x 16 shape): each weight line loaded once for six rows
// instead of two, where 2 x 3 waited on the level-2 cache (a 256-row product ran at 0.64x oneDNN's
// speed). One row (a decode step of one sequence) takes a tile of its own, 1 x kSingleBlockTile<F>
// (after the formats). A tile's shape decides which sums run together, never the order of any
// output's additions.
#if defined(__AVX512F__)
constexpr int kRowTile = 6;
constexpr int kBlockTile = 4;
constexpr int kTallRowTile = 6;
constexpr int kTallBlockTile = 4;
#else
constexpr int kRowTile = 2;
constexpr int kBlockTile = 3;
constexpr int kTallRowTile = 6;
constexpr int kTallBlockTile = 1;
#endif
constexpr int64_t kTallRows = 6;

#ifdef __AVX512BF16__
// bfloat16: per block of 16 outputs and pair of inputs, the 32 weights one VDPBF16PS takes; each lane
// adds the pair's two products (2p+1, 2p) to its float32 sum. Outputs rounded to bfloat16 (VCVTNEPS2BF16).
struct Bf16Pairs {
  using Elem = uint16_t;
  using Weight = uint16_t;
  using Input = __m512bh;
  static constexpr at::ScalarType kType = at::kBFloat16;
  static constexpr at::ScalarType kWeightType = at::kBFloat16;
  using Loaded = __m512bh;
  struct Group {};
  static constexpr int kInputs = 2;  // inputs per 64-byte line of weights
  static constexpr int kLine = 32;
  static int64_t trailer_lines(int64_t, int64_t) { return 0; }
  static Group group(const Weight*, int64_t) { return {}; }
  static Loaded load(const Weight* w, const Group&) { return (__m512bh)_mm512_loadu_si512(w); }
  static constexpr bool kRowSums = false;
  static constexpr bool kPairs = false;
  static V16 close(V16 acc, const Group&, float) { return acc; }
  static Input input(const Elem* row, int64_t p) {  // inputs 2p, 2p+1 of a row, in every lane
    int32_t bits;
    std::memcpy(&bits, row + 2 * p, sizeof bits);
    return (__m512bh)_mm512_set1_epi32(bits);
  }
  static V16 add_products(V16 acc, Input x, Loaded w) { return {_mm512_dpbf16_ps(acc.v, x, w)}; }
  static void store(Elem* out, V16 sum, int64_t count) {  // count <= 16 outputs
    const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(sum.v);
    if (count == kLanes) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), rounded);
    } else {
      alignas(32) uint16_t lanes[kLanes];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), rounded);
      std::memcpy(out, lanes, count * sizeof(uint16_t));
    }
  }
};
#endif

// What the three float32-input formats share: float32 rows, one input per line, a weight line loaded
// as 16 float32 and added by one fused multiply-add per lane, input after input; outputs stored as
// summed. A format hides what it does otherwise (Int4Lines: its group and close).
struct FloatRows {
  using Elem = float;
  using Input = V16;
  using Loaded = V16;
  struct Group {};
  static constexpr at::ScalarType kType = at::kFloat;
  static constexpr int kInputs = 1;
  static constexpr bool kRowSums = false;
  static constexpr bool kPairs = false;  // loads two lines at once (load_pair)
  static Group group(const void*, int64_t) { return {}; }
  static Input input(const Elem* row, int64_t p) { return simd::set1(row[p]); }
  static V16 add_products(V16 acc, Input x, Loaded w) { return simd::fmadd(x, w, acc); }
  template <typename G>
  static V16 close(V16 acc, const G&, float) { return acc; }
  static void store(Elem* out, V16 sum, int64_t count) { simd::store_first(out, sum, static_cast<int>(count)); }
};

// float32: per block of 16 outputs and input, the 16 weights of one line; each lane adds the
// product to its sum with one fused multiply-add, input after input. Outputs stored as summed.
struct F32Lines : FloatRows {
  using Weight = float;
  static constexpr at::ScalarType kWeightType = at::kFloat;
  static constexpr int kLine = kLanes;
  static int64_t trailer_lines(int64_t, int64_t) { return 0; }
  static Loaded load(const Weight* w, const Group&) { return simd::loadu(w); }
};

// int8 weights in groups of k_block inputs, float32 inputs and outputs (weight-only quantization,
// session/model/quantize.py; a group of K inputs is one scale per output): per block of 16 outputs and
// input, the 16 int8 weights of one 16-byte line, converted to float32 (exact) and added as F32Lines
// adds its weights; after the block's K lines, per group 4 lines holding its 16 float32 scales (zero
// past n). A group's part is scale * (the float32 sum of x_k q_k, input after input), the parts added
// in order (GGUF's Q8_0: groups of 32): per lane, in an order that depends on nothing but K and the group.
struct Int8Lines : FloatRows {
  using Weight = int8_t;
  struct Group {
    V16 scales;
  };
  static constexpr at::ScalarType kWeightType = at::kChar;
  static constexpr int kLine = kLanes;
  static constexpr int kGroupLines = sizeof(float);  // lines of 16 bytes: 16 scales
  static int64_t trailer_lines(int64_t steps, int64_t k_block) { return steps / k_block * kGroupLines; }
  static Group group(const Weight* trailer, int64_t g) { return {floats(trailer + g * kGroupLines * kLine)}; }
  static Loaded load(const Weight* w, const Group&) { return simd::loadu(w); }
  static V16 close(V16 acc, const Group& g, float) { return simd::mul(acc, g.scales); }
  static V16 floats(const Weight* bytes) {  // 16 float32 stored in the trailer's bytes
    float lanes[kLanes];
    std::memcpy(lanes, bytes, sizeof lanes);
    return simd::loadu(lanes);
  }
};

// int4 weights in groups of k_block inputs, float32 inputs and outputs (session/model/quantize.py's
// int4): per block of 16 outputs and input, one 8-byte line of 16 nibbles (byte j: output j in its low
// nibble, output j + 8 in its high one); after the block's K lines, per group of k_block inputs 16
// lines: its 16 float32 scales, then its 16 float32 offsets (zero past n). A weight is q scale +
// offset (session/model/cpu/linear.py's dequantize_int4); per group a lane sums x_k q_k (q exact in
// float32) by FMA input after input from zero, and the row's x_k in order, and the group's part is
// fma(that sum, scale, sum(x) * offset): one FMA per weight, not two. The group parts add in order.
struct Int4Lines : FloatRows {
  using Weight = uint8_t;
  struct Group {
    V16 scales, offsets;
  };
  static constexpr at::ScalarType kWeightType = at::kByte;
  static constexpr int kLine = kLanes / 2;
  static constexpr int kGroupLines = 2 * kLanes * sizeof(float) / kLine;  // 16 scales and 16 offsets
  static constexpr bool kRowSums = true;
  static int64_t trailer_lines(int64_t steps, int64_t k_block) { return steps / k_block * kGroupLines; }
  static Group group(const Weight* trailer, int64_t g) {
    const Weight* at = trailer + g * kGroupLines * kLine;
    return {Int8Lines::floats(reinterpret_cast<const int8_t*>(at)),
            Int8Lines::floats(reinterpret_cast<const int8_t*>(at + kLanes * sizeof(float)))};
  }
  static Loaded load(const Weight* w, const Group&) {  // the 16 nibbles as float32 (exact)
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i nibbles = _mm_unpacklo_epi64(_mm_and_si128(bytes, mask), _mm_and_si128(_mm_srli_epi16(bytes, 4), mask));
    return simd::from_int8(nibbles);
  }
  // Lines p and p + 1 from one 16-byte load, their nibbles masked together: a one-row pass over
  // SmolLM2's linears 14% faster on one thread (Zen 4; docs/MEASUREMENTS.md, "One row, six streams")
  static constexpr bool kPairs = true;
  static void load_pair(const Weight* w, Loaded& first, Loaded& second) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i low = _mm_and_si128(bytes, mask), high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    first = simd::from_int8(_mm_unpacklo_epi64(low, high));
    second = simd::from_int8(_mm_unpackhi_epi64(low, high));
  }
  static V16 close(V16 acc, const Group& g, float xsum) {  // the group's sum: scale sum(x q) + offset sum(x)
    return simd::fmadd(acc, g.scales, simd::mul(simd::set1(xsum), g.offsets));
  }
};

// Output blocks per one-row tile, by format and instruction set, each the fastest measured for a
// one-row pass over SmolLM2's linears (docs/MEASUREMENTS.md, "One row, six streams"). On AVX2 (Zen 3)
// one core draws more memory bandwidth from six weight streams than from three: 1 x 6 everywhere. On
// AVX-512 (Zen 4) one stream reads as fast as any, so float32 and bfloat16, bound by memory, keep 1 x 4;
// int8 and int4 convert every line before its multiply-adds, and more blocks side by side hide that
// work (one thread: int8 1 x 8 20% faster than 1 x 4, int4 1 x 6 9%).
#if defined(__AVX512F__)
template <typename F>
constexpr int kSingleBlockTile = 4;
template <>
constexpr int kSingleBlockTile<Int8Lines> = 8;
template <>
constexpr int kSingleBlockTile<Int4Lines> = 6;
#else
template <typename F>
constexpr int kSingleBlockTile = 6;
#endif

template <typename F>
struct Problem {
  using Elem = typename F::Elem;
  const Elem* x;      // [M, kInputs * steps] row-major, row stride x_stride (an odd K padded with a zero)
  int64_t x_stride;
  const typename F::Weight* w;  // packed [NB, steps + trailer lines, kLine]
  int64_t steps;      // lines of weights per block of outputs: K / kInputs
  int64_t n;
  int64_t k_block;    // in inputs, a multiple of kInputs
  const float* bias;  // [NB * 16] float32 (zero past n), or nullptr
  Elem* y;            // [M, n]
  float* scratch;     // [M, NB * 16] float32: block sums added across input blocks
};

// Rows m0 .. m0+MR-1, output blocks b0 .. b0+NR-1 (all within NB): MR x NR accumulators in registers.
// The hot loops over them are unrolled by pragma, before GCC's scalar replacement runs: where GCC
// unrolled them only after it (int8, one row), ``acc`` stayed an array on the stack, a store and a
// reload around every multiply-add (one row of int8 12% slower on Zen 4, 4.5% on AVX2 code:
// docs/MEASUREMENTS.md, "One row, six streams").
template <typename F, int MR, int NR>
void tile(const Problem<F>& pb, int64_t m0, int64_t b0) {
  constexpr int line = F::kLine;  // elements per line of weights
  const int64_t blocks = (pb.n + kLanes - 1) / kLanes;
  const int64_t width = blocks * kLanes;
  const int64_t per_block = pb.k_block / F::kInputs;
  const int64_t block_stride = (pb.steps + F::trailer_lines(pb.steps, per_block)) * line;  // weights, trailer
  for (int64_t start = 0; start < pb.steps; start += per_block) {
    const int64_t stop = std::min(pb.steps, start + per_block);
    V16 acc[MR][NR];
    for (int m = 0; m < MR; ++m)
      for (int r = 0; r < NR; ++r) acc[m][r] = simd::zero();
    const typename F::Weight* w0 = pb.w + b0 * block_stride;
    typename F::Group groups[NR];
    for (int r = 0; r < NR; ++r) groups[r] = F::group(w0 + r * block_stride + pb.steps * line, start / per_block);
    float xsums[MR] = {};  // each row's inputs of this block, summed in order (a format that reads them)
    if (F::kRowSums)
      for (int m = 0; m < MR; ++m)
        for (int64_t p = start; p < stop; ++p) xsums[m] += pb.x[(m0 + m) * pb.x_stride + p];
    int64_t p = start;
    if constexpr (F::kPairs && NR > 1) {  // two inputs at a time, each lane's additions in the same order
      for (; p + 1 < stop; p += 2) {
        typename F::Input first[MR], second[MR];
        for (int m = 0; m < MR; ++m) {
          const typename F::Elem* row = pb.x + (m0 + m) * pb.x_stride;
          first[m] = F::input(row, p), second[m] = F::input(row, p + 1);
        }
#pragma GCC unroll 16
        for (int r = 0; r < NR; ++r) {
          typename F::Loaded a, b;
          F::load_pair(w0 + r * block_stride + p * line, a, b);
#pragma GCC unroll 16
          for (int m = 0; m < MR; ++m) acc[m][r] = F::add_products(F::add_products(acc[m][r], first[m], a), second[m], b);
        }
      }
    }
    for (; p < stop; ++p) {
      if constexpr (NR == 1) {  // one line, each row's input broadcast as it is used: 6 rows fit AVX2's registers
        const typename F::Loaded wv = F::load(w0 + p * line, groups[0]);
        for (int m = 0; m < MR; ++m) acc[m][0] = F::add_products(acc[m][0], F::input(pb.x + (m0 + m) * pb.x_stride, p), wv);
        continue;
      }
      typename F::Input xs[MR];
      for (int m = 0; m < MR; ++m) xs[m] = F::input(pb.x + (m0 + m) * pb.x_stride, p);
#pragma GCC unroll 16
      for (int r = 0; r < NR; ++r) {
        const typename F::Loaded wv = F::load(w0 + r * block_stride + p * line, groups[r]);
#pragma GCC unroll 16
        for (int m = 0; m < MR; ++m) acc[m][r] = F::add_products(acc[m][r], xs[m], wv);
      }
    }
    for (int m = 0; m < MR; ++m) {
      float* out = pb.scratch + (m0 + m) * width + b0 * kLanes;
      for (int r = 0; r < NR; ++r) {
        const V16 part = F::close(acc[m][r], groups[r], xsums[m]);
        if (start == 0) {
          simd::storeu(out + r * kLanes, part);
        } else {
          simd::storeu(out + r * kLanes, simd::add(simd::loadu(out + r * kLanes), part));
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    const float* sums = pb.scratch + (m0 + m) * width + b0 * kLanes;
    typename F::Elem* out = pb.y + (m0 + m) * pb.n;
    for (int r = 0; r < NR; ++r) {
      const int64_t first = (b0 + r) * kLanes;
      V16 sum = simd::loadu(sums + r * kLanes);
      if (pb.bias != nullptr) sum = simd::add(sum, simd::loadu(pb.bias + first));
      F::store(out + first, sum, std::min<int64_t>(kLanes, pb.n - first));
    }
  }
}

// Rows first .. end-1, in tiles of RT (at most 6) rows and the rest, for the output blocks b0 .. b0+NR-1.
template <typename F, int NR, int RT = kRowTile>
void rows_of(const Problem<F>& pb, int64_t first, int64_t end, int64_t b0) {
  static_assert(RT >= 1 && RT <= 6, "the rest of the rows is at most 5");
  int64_t m0 = first;
  for (; m0 + RT <= end; m0 += RT) tile<F, RT, NR>(pb, m0, b0);
  switch (end - m0) {
    case 5: tile<F, 5, NR>(pb, m0, b0); break;
    case 4: tile<F, 4, NR>(pb, m0, b0); break;
    case 3: tile<F, 3, NR>(pb, m0, b0); break;
    case 2: tile<F, 2, NR>(pb, m0, b0); break;
    case 1: tile<F, 1, NR>(pb, m0, b0); break;
    default: break;
  }
}

// [rows, cols] of ``options`` in ``slot``: the tensor already there where it has that shape and dtype,
// else a new one (a decode step's buffers are allocated once per batch size: csrc/decode_layer.h).
inline const at::Tensor& buffer(at::Tensor& slot, at::IntArrayRef sizes, const at::TensorOptions& options) {
  if (!slot.defined() || slot.sizes() != sizes || slot.scalar_type() != options.dtype().toScalarType())
    slot = at::empty(sizes, options);
  return slot;
}

// A linear's bias [n] as the tiles add it: float32, zero-padded to whole blocks of 16 outputs (an
// absent bias stays absent). Prepared converts one per call; a DecodeStack converts its layers' once.
inline c10::optional<at::Tensor> float_bias(const c10::optional<at::Tensor>& bias, int64_t n) {
  if (!bias.has_value() || !bias->defined()) return bias;
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "bias: [n], its linear's out features");
  return at::constant_pad_nd(bias->to(at::kFloat), {0, (n + kLanes - 1) / kLanes * kLanes - n}).contiguous();
}

// One linear set up for the tiles: every check done, its output and scratch in ``out`` and ``sums``
// (made or remade there to fit), the bias in float32 padded to whole blocks (used as it is where it
// already is one: csrc/decode_layer.h converts a stack's biases once).
template <typename F>
struct Prepared {
  using Elem = typename F::Elem;
  at::Tensor x, y, scratch, bias_sums;
  Problem<F> pb;
  Problem<F> rest;  // rows from ``split`` on: pb summed in blocks of another size (``several_from``)
  int64_t rows = 0, column_tiles = 0, split = 0;
  bool tall = false;  // kTallRows rows or more: the tall tile (kTallRowTile x kTallBlockTile)
  bool single = false;  // one row: the single tile (1 x kSingleBlockTile<F>)

  Prepared(const at::Tensor& input, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t n,
           int64_t k_block) {
    at::Tensor out, sums;
    init(input, packed, bias, n, k_block, out, sums);
  }
  Prepared(const at::Tensor& input, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t n,
           int64_t k_block, at::Tensor& out, at::Tensor& sums) {
    init(input, packed, bias, n, k_block, out, sums);
  }

 private:
  void init(const at::Tensor& input, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t n,
            int64_t k_block, at::Tensor& out, at::Tensor& sums) {
    // an odd K in pairs: one zero input more, so that every pair is one 32-bit load
    x = input.size(-1) % F::kInputs ? at::constant_pad_nd(input, {0, F::kInputs - input.size(-1) % F::kInputs})
                                    : input;
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == F::kType && x.stride(1) == 1, "x: [M, K] of the weights' dtype, rows contiguous");
    TORCH_CHECK(k_block > 0 && k_block % F::kInputs == 0, "k_block: a positive multiple of ", F::kInputs);
    rows = x.size(0);
    const int64_t k = x.size(1), blocks = packed.size(0), steps = k / F::kInputs;
    const int64_t trailer = F::trailer_lines(steps, k_block / F::kInputs);
    TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == F::kWeightType && packed.is_contiguous() &&
                    packed.size(2) == F::kLine,
                "packed: [NB, K / ", F::kInputs, " + trailer, ", F::kLine, "] of its format's dtype, contiguous");
    TORCH_CHECK(blocks == (n + kLanes - 1) / kLanes && packed.size(1) == steps + trailer,
                "packed does not match x, n and k_block");
    y = buffer(out, {rows, n}, x.options());
    scratch = buffer(sums, {rows, blocks * kLanes}, x.options().dtype(at::kFloat));
    if (bias.has_value() && bias->defined()) {  // float_bias's form, converted here unless it already is
      const bool converted = bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->dim() == 1 &&
                             bias->size(0) == blocks * kLanes;
      bias_sums = converted ? *bias : *float_bias(bias, n);
    }
    pb = Problem<F>{reinterpret_cast<const Elem*>(x.data_ptr()), x.stride(0),
                    reinterpret_cast<const typename F::Weight*>(packed.data_ptr()),
                    steps, n, k_block, bias_sums.defined() ? bias_sums.data_ptr<float>() : nullptr,
                    reinterpret_cast<Elem*>(y.data_ptr()), scratch.data_ptr<float>()};
    tall = rows >= kTallRows;
    single = rows == 1;
    const int64_t per_tile = tall ? kTallBlockTile : single ? kSingleBlockTile<F> : kBlockTile;
    column_tiles = rows == 0 ? 0 : (blocks + per_tile - 1) / per_tile;
    rest = pb;
    split = rows;
  }

  template <int NR, int RT = kRowTile>
  void both(int64_t b0) const {
    rows_of<F, NR, RT>(pb, 0, split, b0);
    rows_of<F, NR, RT>(rest, split, rows, b0);
  }

 public:
  // Rows ``first`` .. M-1 sum in blocks of ``k_block`` inputs, the rows before them in the constructor's
  // (a step that packs decode rows, summed as one row each, before a prefill's tokens, summed as
  // several). Only for formats without a trailer (its lines follow the group size): bfloat16, float32.
  void several_from(int64_t first, int64_t k_block) {
    TORCH_CHECK(F::trailer_lines(pb.steps, 1) == 0, "several_from: a format whose weights have no trailer");
    TORCH_CHECK(k_block > 0 && k_block % F::kInputs == 0, "k_block: a positive multiple of ", F::kInputs);
    split = std::clamp<int64_t>(first, 0, rows);
    rest.k_block = k_block;
  }

  // Column tile t for every row: output blocks kBlockTile t .. kBlockTile (t + 1) - 1, block t alone where
  // the tall tile runs (AVX2, kTallRows rows or more), or kSingleBlockTile<F> of them for one row
  void run_tile(int64_t t) const {
    if constexpr (kTallBlockTile == 1) {
      if (tall) return both<1, kTallRowTile>(t);
    }
    if constexpr (kSingleBlockTile<F> != kBlockTile) {
      if (single) return blocks_from<kSingleBlockTile<F>, 1>(t * kSingleBlockTile<F>);
    }
    blocks_from<kBlockTile, kRowTile>(t * kBlockTile);
  }

 private:
  // Output blocks b0 .. b0 + NR - 1, or as many as are left from b0 (the last column tile) in a narrower tile
  template <int NR, int RT>
  void blocks_from(int64_t b0) const {
    if constexpr (NR > 1) {
      if ((pb.n + kLanes - 1) / kLanes - b0 < NR) return blocks_from<NR - 1, RT>(b0);
    }
    both<NR, RT>(b0);
  }
};

// Every column tile of the given linears (at most 4) in one parallel region.
template <typename F>
void run_linears(std::initializer_list<const Prepared<F>*> given) {
  constexpr size_t kMost = 4;
  TORCH_CHECK(given.size() <= kMost, "run_linears: at most 4 linears");
  const Prepared<F>* linears[kMost];
  int64_t ends[kMost];
  int64_t total = 0;
  size_t count = 0;
  for (const Prepared<F>* p : given) linears[count] = p, ends[count++] = total += p->column_tiles;
  resident::for_each_shared(total, [&](int64_t t) {
    size_t which = 0;
    while (t >= ends[which]) ++which;
    linears[which]->run_tile(t - (which == 0 ? 0 : ends[which - 1]));
  });
}

// One linear operator: x [M, K] -> [M, n] (linear_bf16, linear_f32, linear_i8, linear_i4).
template <typename F>
at::Tensor linear(const at::Tensor& input, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t n,
                  int64_t k_block) {
  const Prepared<F> linear(input, packed, bias, n, k_block);
  run_linears<F>({&linear});
  return linear.y;
}

// linear_bf16 and linear_f32: as ``linear``, with the rows from ``several_from`` on summed in blocks of
// ``several_block`` (several_from >= M: every row in k_block's).
template <typename F>
at::Tensor linear_split(const at::Tensor& input, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                        int64_t n, int64_t k_block, int64_t several_from, int64_t several_block) {
  Prepared<F> linear(input, packed, bias, n, k_block);
  if (several_from >= 0 && several_from < linear.rows) linear.several_from(several_from, several_block);
  run_linears<F>({&linear});
  return linear.y;
}

}  // namespace
