// The bfloat16 linear kernel's tiles (csrc/linear_bf16.cpp documents the layout and the order of
// additions), shared by resident::linear_bf16 and the decode layer (csrc/decode_layer.cpp), which runs
// several linears of one input (q, k, v; gate, up) in one parallel region. Compiled with
// -mavx512bf16. An unnamed namespace: each library keeps its own copy, nothing is exported.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include "parallel.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kLanes = 16;
constexpr int kRowTile = 6;
constexpr int kBlockTile = 4;

struct Problem {
  const uint16_t* x;  // [M, 2 KP] row-major, row stride x_stride (an odd K padded with a zero)
  int64_t x_stride;
  const uint16_t* w;  // packed [NB, KP, 32]
  int64_t pairs;      // KP
  int64_t n;
  int64_t k_block;    // in inputs, even
  const float* bias;  // [NB * 16] float32 (zero past n), or nullptr
  uint16_t* y;        // [M, n]
  float* scratch;     // [M, NB * 16] float32: block sums added across input blocks
};

inline __m512bh pair_of(const uint16_t* row, int64_t p) {  // inputs 2p, 2p+1 of a row, in every lane
  int32_t bits;
  std::memcpy(&bits, row + 2 * p, sizeof bits);
  return (__m512bh)_mm512_set1_epi32(bits);
}

// Rows m0 .. m0+MR-1, output blocks b0 .. b0+NR-1 (all within NB): MR x NR accumulators in registers.
template <int MR, int NR>
void tile(const Problem& pb, int64_t m0, int64_t b0) {
  constexpr int nr = NR;
  const int64_t blocks = (pb.n + kLanes - 1) / kLanes;
  const int64_t width = blocks * kLanes;
  for (int64_t start = 0; start < pb.pairs; start += pb.k_block / 2) {
    const int64_t stop = std::min(pb.pairs, start + pb.k_block / 2);
    __m512 acc[MR][NR];
    for (int m = 0; m < MR; ++m)
      for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps();
    const uint16_t* w0 = pb.w + (b0 * pb.pairs) * 2 * kLanes;
    const int64_t block_stride = pb.pairs * 2 * kLanes;
    for (int64_t p = start; p < stop; ++p) {
      __m512bh xs[MR];
      for (int m = 0; m < MR; ++m) xs[m] = pair_of(pb.x + (m0 + m) * pb.x_stride, p);
      for (int r = 0; r < NR; ++r) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(w0 + r * block_stride + p * 2 * kLanes);
        for (int m = 0; m < MR; ++m) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xs[m], wv);
      }
    }
    for (int m = 0; m < MR; ++m) {
      float* out = pb.scratch + (m0 + m) * width + b0 * kLanes;
      for (int r = 0; r < nr; ++r) {
        if (start == 0) {
          _mm512_storeu_ps(out + r * kLanes, acc[m][r]);
        } else {
          _mm512_storeu_ps(out + r * kLanes, _mm512_add_ps(_mm512_loadu_ps(out + r * kLanes), acc[m][r]));
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    const float* sums = pb.scratch + (m0 + m) * width + b0 * kLanes;
    uint16_t* out = pb.y + (m0 + m) * pb.n;
    for (int r = 0; r < nr; ++r) {
      const int64_t first = (b0 + r) * kLanes;
      __m512 sum = _mm512_loadu_ps(sums + r * kLanes);
      if (pb.bias != nullptr) sum = _mm512_add_ps(sum, _mm512_loadu_ps(pb.bias + first));
      const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(sum);
      if (first + kLanes <= pb.n) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + first), rounded);
      } else {
        alignas(32) uint16_t lanes[kLanes];
        _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), rounded);
        std::memcpy(out + first, lanes, (pb.n - first) * sizeof(uint16_t));
      }
    }
  }
}

// Every row, in tiles of kRowTile rows and the rest, for the output blocks b0 .. b0+NR-1.
template <int NR>
void rows_of(const Problem& pb, int64_t rows, int64_t b0) {
  int64_t m0 = 0;
  for (; m0 + kRowTile <= rows; m0 += kRowTile) tile<kRowTile, NR>(pb, m0, b0);
  switch (rows - m0) {
    case 5: tile<5, NR>(pb, m0, b0); break;
    case 4: tile<4, NR>(pb, m0, b0); break;
    case 3: tile<3, NR>(pb, m0, b0); break;
    case 2: tile<2, NR>(pb, m0, b0); break;
    case 1: tile<1, NR>(pb, m0, b0); break;
    default: break;
  }
}


// One linear set up for the tiles: its output, scratch and float32 bias allocated, every check done.
struct Prepared {
  at::Tensor x, y, scratch, bias_sums;
  Problem pb;
  int64_t rows = 0, column_tiles = 0;

  Prepared(const at::Tensor& input, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t n,
           int64_t k_block) {
    // an odd K: one zero input more, so that every pair is one 32-bit load
    x = input.size(-1) % 2 ? at::constant_pad_nd(input, {0, 1}) : input;
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
                "x: [M, K] bfloat16, rows contiguous");
    TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                    packed.size(2) == 2 * kLanes,
                "packed: [NB, KP, 32] bfloat16, contiguous");
    rows = x.size(0);
    const int64_t k = x.size(1), blocks = packed.size(0), pairs = packed.size(1);
    TORCH_CHECK(blocks == (n + kLanes - 1) / kLanes && pairs == k / 2, "packed does not match x and n");
    TORCH_CHECK(k_block > 0 && k_block % 2 == 0, "k_block: a positive even number");
    y = at::empty({rows, n}, x.options());
    scratch = at::empty({rows, blocks * kLanes}, x.options().dtype(at::kFloat));
    if (bias.has_value() && bias->defined()) {  // the bias in float32, zero-padded to whole blocks
      TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "bias: [n]");
      bias_sums = at::constant_pad_nd(bias->to(at::kFloat), {0, blocks * kLanes - n}).contiguous();
    }
    pb = Problem{reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), x.stride(0),
                 reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), pairs, n, k_block,
                 bias_sums.defined() ? bias_sums.data_ptr<float>() : nullptr,
                 reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), scratch.data_ptr<float>()};
    column_tiles = rows == 0 ? 0 : (blocks + kBlockTile - 1) / kBlockTile;
  }

  void run_tile(int64_t t) const {  // output blocks 4t .. 4t+3 for every row
    const int64_t b0 = t * kBlockTile, blocks = (pb.n + kLanes - 1) / kLanes;
    switch (std::min<int64_t>(kBlockTile, blocks - b0)) {
      case 4: rows_of<4>(pb, rows, b0); break;
      case 3: rows_of<3>(pb, rows, b0); break;
      case 2: rows_of<2>(pb, rows, b0); break;
      default: rows_of<1>(pb, rows, b0); break;
    }
  }
};

// Every column tile of the given linears in one parallel region.
inline void run_linears(const std::vector<const Prepared*>& linears) {
  std::vector<int64_t> ends;
  int64_t total = 0;
  for (const Prepared* p : linears) ends.push_back(total += p->column_tiles);
  resident::for_each_shared(total, [&](int64_t t) {
    size_t which = 0;
    while (t >= ends[which]) ++which;
    linears[which]->run_tile(t - (which == 0 ? 0 : ends[which - 1]));
  });
}

}  // namespace
