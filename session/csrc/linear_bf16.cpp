// bfloat16 linear layers on CPU with AVX512-BF16: y = x W^T for a few rows, from weights packed once.
//
// resident::linear_bf16(x [M, K] bfloat16, packed [NB, KP, 32] bfloat16, bias [n] or None, n, k_block)
// -> [M, n]
// packed: W [n, K] in blocks of 16 outputs (NB = ceil(n / 16)) and pairs of inputs (KP = ceil(K / 2)),
// packed[b, p] = W[16b, 2p], W[16b, 2p+1], W[16b+1, 2p], ..., W[16b+15, 2p+1] (zero past n and K): the
// operand layout of VDPBF16PS, one output per float32 lane. See session/cpu_linear.py.
//
// The order of additions is oneDNN's (which torch's bfloat16 linear runs; probed with inputs that
// cancel, so any other order shows: tests/unit/test_cpu_linear.py), so results are its bits:
// - each output is one float32 lane; VDPBF16PS adds the pair (2p+1, 2p) of products into it, pair
//   after pair, in input order;
// - the inputs run in blocks of k_block (512 or 1024, where oneDNN's kernel blocks them: a block sums
//   from zero) and the block sums are added in order;
// - the float32 sum is rounded to bfloat16 with VCVTNEPS2BF16, as oneDNN's kernel stores it.
// Unlike oneDNN, whose block size changes with the number of rows (512 for one row, 1024 for more
// where K > 512, on this project's CPU), k_block is the caller's: a batch of decode rows computes
// exactly what each row alone would.
//
// Work: tiles of up to 6 rows x 4 blocks of 16 outputs (24 accumulators), parallel over tiles on
// torch's OpenMP team; a tile's weight panel is read once per tile of rows, from cache after the
// first. Built at run time by session/cpu_linear.py (-mavx512bf16); used only where the CPU reports it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

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

at::Tensor linear_bf16(const at::Tensor& input, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       int64_t n, int64_t k_block) {
  // an odd K: one zero input more, so that every pair is one 32-bit load
  const at::Tensor x = input.size(-1) % 2 ? at::constant_pad_nd(input, {0, 1}) : input;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "x: [M, K] bfloat16, rows contiguous");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(2) == 2 * kLanes,
              "packed: [NB, KP, 32] bfloat16, contiguous");
  const int64_t rows = x.size(0), k = x.size(1), blocks = packed.size(0), pairs = packed.size(1);
  TORCH_CHECK(blocks == (n + kLanes - 1) / kLanes && pairs == k / 2, "packed does not match x and n");
  TORCH_CHECK(k_block > 0 && k_block % 2 == 0, "k_block: a positive even number");
  auto y = at::empty({rows, n}, x.options());
  if (rows == 0) return y;
  auto scratch = at::empty({rows, blocks * kLanes}, x.options().dtype(at::kFloat));
  at::Tensor bias_sums;  // the bias in float32, zero-padded to whole blocks
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "bias: [n]");
    bias_sums = at::constant_pad_nd(bias->to(at::kFloat), {0, blocks * kLanes - n}).contiguous();
  }
  Problem pb{reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), x.stride(0),
             reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), pairs, n, k_block,
             bias_sums.defined() ? bias_sums.data_ptr<float>() : nullptr,
             reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), scratch.data_ptr<float>()};
  const int64_t column_tiles = (blocks + kBlockTile - 1) / kBlockTile;
  at::parallel_for(0, column_tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b0 = t * kBlockTile;
      switch (std::min<int64_t>(kBlockTile, blocks - b0)) {
        case 4: rows_of<4>(pb, rows, b0); break;
        case 3: rows_of<3>(pb, rows, b0); break;
        case 2: rows_of<2>(pb, rows, b0); break;
        default: rows_of<1>(pb, rows, b0); break;
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(resident, m) {
  m.def("linear_bf16(Tensor x, Tensor packed, Tensor? bias, int n, int k_block) -> Tensor");
}

TORCH_LIBRARY_IMPL(resident, CPU, m) { m.impl("linear_bf16", &linear_bf16); }
