// One decode step's attention for every row of a batch, over a head-major KV pool (CPU), in bfloat16
// (resident::decode_attention_bf16, torch's bits: below) and float32 (resident::decode_attention_f32:
// the same steps on float32 keys and values, with float32 probabilities and exp_accurate instead of
// fexp_u20, as torch's kernel takes its exact exponential in float32; its products are not exact, so
// its order of additions is ours and its results equal torch's to rounding).
//
// resident::decode_attention_bf16(q [B, H, hd], k_layer, v_layer [KVH, NB, bt, hd], block_table
// [B, W] int32, starts [B] int32, ends [B] int32, scale) -> [B, H, hd]: row b's query heads attend
// to its positions starts[b] .. ends[b]-1, found through its block table. One call per layer for
// the whole batch, reading keys and values where they lie (no gather, no per-row call).
// The queries that share a kv head's keys (its query heads, in the rows of one sequence a verify
// feeds) attend as one item, each key read and converted once for them (attend, below).
//
// It computes what torch's CPU flash-attention kernel computes for a bfloat16 query of one token
// over the same keys (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp), bit for bit, so that greedy
// decoding stays token-for-token with transformers' bfloat16 SDPA:
// - keys in splits of 512 positions from the first attended one, a running max and sum per split;
// - scores q.k in float32, times the scale; both products (q.k, probabilities times values) added in
//   the order of the GEMM torch calls there (MKL's bfloat16 GEMM on one thread, probed bit for bit:
//   see dots4 and the values loop);
// - exponentials of (score - max) with ATen's fexp_u20 (a degree-3 approximation) over whole 16-lane
//   vectors and std::exp over a split's tail; the split's sum as 16 lane sums folded as ATen's
//   vec_reduce_all, then the tail in order;
// - probabilities rounded to bfloat16 before they weight the values, accumulated in float32;
// - the output: the float32 accumulator times 1 / sum, rounded to bfloat16.
// Written-out attention with exact exponentials and float32 probabilities differed from torch in
// 1 output in 60; with every step above but another order of additions, in 1 in 3,000, which was
// enough for 1 of 20 greedy answers to leave transformers' after 14 tokens. As built: 0 of 5.5
// million outputs differ over two models' greedy decoding, 1 of about 400,000 on random data (a
// row of two splits), which the tests' seeds do not hit.
//
// Built at run time by session/model/cpu/attention.py for AVX-512 (-mavx512f -mavx512bw -mfma) or AVX2 with
// FMA (csrc/simd.h: the same bits on both), -ffp-contract=off (fused multiply-adds only where written,
// on exact products). bfloat16 is taken only from the AVX-512 build: the CPU it was probed on.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "bf16.h"
#include "parallel.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int kSplit = 512;  // torch's kv_split_size for a one-token query

using resident::bf16_to_float;
using resident::float_to_bf16;
using resident::simd::kLanes;
using resident::simd::V16;
using resident::from_float;
using resident::to_float;
namespace simd = resident::simd;

// values[0 .. n) rounded to bfloat16 in place (held as float32), as float_to_bf16 does one at a time.
inline void round_to_bf16(float* values, int n) {
  int i = 0;
  for (; i + kLanes <= n; i += kLanes) simd::storeu(values + i, simd::round_bits_to_bf16(simd::loadu(values + i)));
  for (; i < n; ++i) values[i] = bf16_to_float(float_to_bf16(values[i]));
}

// ATen's Vectorized<float>::fexp_u20 (AVX-512), step for step.
inline V16 fexp_u20(V16 values) {
  const V16 c0 = simd::set1(0.00010703434948458272f);
  const V16 c1 = simd::set1(0.30354260500649682f);
  const V16 c2 = simd::set1(-0.22433836478672356f);
  const V16 c3 = simd::set1(-0.079204240219773236f);
  const V16 log2e = simd::set1_bits(0x3fb8aa3b);
  const V16 a = simd::set1(8388608.f);  // 2^23 / log2(2)
  const V16 b = simd::set1(8388608.f * 127.f);
  const simd::M16 below = simd::less(values, simd::set1_bits(int32_t(0xc2aeac50)));    // ln(FLT_MIN)
  const simd::M16 above = simd::greater(values, simd::set1_bits(int32_t(0x42b17218)));  // ln(FLT_MAX)
  V16 src = simd::mul(values, log2e);
  const V16 fractional = simd::sub(src, simd::floor(src));
  V16 res = simd::fmadd(fractional, c3, c2);
  res = simd::fmadd(fractional, res, c1);
  res = simd::fmadd(fractional, res, c0);
  src = simd::sub(src, res);
  const V16 casted = simd::truncate_bits(simd::fmadd(a, src, b));
  return simd::select(above, simd::set1_bits(0x7F800000), simd::select(below, simd::zero(), casted));
}

// exp to float32 accuracy (a few ulp), for float32 attention, where torch's kernel takes its exact
// exponential rather than fexp_u20 (whose error, ~1e-5, would show): x = n ln2 + r with |r| <= ln2 / 2,
// exp(r) by its Taylor polynomial to r^7 (remainder < 1e-8), times 2^n.
inline V16 exp_accurate(V16 x) {
  x = simd::max(x, simd::set1(-104.f));  // below, the result is 0 as it is for std::exp
  const V16 n = simd::round_even(simd::mul(x, simd::set1(1.44269504088896341f)));
  V16 r = simd::fnmadd(n, simd::set1(0.693359375f), x);  // ln2 in two parts: hi exact in n * hi
  r = simd::fnmadd(n, simd::set1(-2.12194440e-4f), r);
  V16 p = simd::set1(1.f / 5040);
  for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = simd::fmadd(p, r, simd::set1(c));
  return simd::scale2(p, n);
}

// ATen's vec_reduce_all(x + y) for 16 lanes: halves folded 8, 4, 2, 1 lanes apart.
inline float reduce_add(V16 v) {
  alignas(64) float lanes[kLanes];
  simd::lanes_of(v, lanes);
  for (int width = kLanes / 2; width >= 1; width /= 2)
    for (int i = 0; i < width; ++i) lanes[i] = lanes[i] + lanes[i + width];
  return lanes[0];
}

// q . k for four keys, added in the order of the GEMM torch's kernel calls (MKL's bfloat16 GEMM on
// one thread, probed bit for bit: tests/unit/model/cpu/test_cpu_attention.py): four partial sums, the one for
// l adding the products at d = l, l + 4, l + 8, ... in turn, then (s0 + s2) + (s1 + s3). Products of
// two bfloat16 are exact in float32, so only the order of additions matters, and a fused multiply-add
// rounds as a multiply then an add. Lanes: 128-bit block j of the accumulator holds key j's four
// partial sums. ``qb``: per 16 dimensions, the query's 128-bit block m copied to all four blocks
// (query_blocks), so that block j of qb[4 g + m] * (keys' blocks m, transposed) is key j's step m.
// dots4<NQ> does this for NQ queries over the same four keys: each key is loaded and transposed once,
// and each query's sums take the same steps as they would alone (the same bits).
#if defined(__AVX512F__)
using QueryBlock = __m512;  // qb's element
constexpr int kQueryBlockDims = 4;  // query dimensions per QueryBlock (per 16 dimensions: four)

template <int NQ, typename Elem>
inline void dots4(const QueryBlock* const* qb, const Elem* const* k, int head_dim, float* const* out) {
  __m512 acc[NQ];
  for (int x = 0; x < NQ; ++x) acc[x] = _mm512_setzero_ps();
  for (int d = 0, g = 0; d < head_dim; d += kLanes, ++g) {
    const __m512 k0 = simd::loadu(k[0] + d).v, k1 = simd::loadu(k[1] + d).v;
    const __m512 k2 = simd::loadu(k[2] + d).v, k3 = simd::loadu(k[3] + d).v;
    // 4x4 transpose of 128-bit blocks: step m holds block m of k0, k1, k2, k3
    const __m512 a = _mm512_shuffle_f32x4(k0, k1, 0x44), b = _mm512_shuffle_f32x4(k0, k1, 0xEE);
    const __m512 c = _mm512_shuffle_f32x4(k2, k3, 0x44), e = _mm512_shuffle_f32x4(k2, k3, 0xEE);
    const __m512 step[4] = {_mm512_shuffle_f32x4(a, c, 0x88), _mm512_shuffle_f32x4(a, c, 0xDD),
                            _mm512_shuffle_f32x4(b, e, 0x88), _mm512_shuffle_f32x4(b, e, 0xDD)};
    for (int x = 0; x < NQ; ++x)
      for (int m = 0; m < 4; ++m) acc[x] = _mm512_fmadd_ps(qb[x][4 * g + m], step[m], acc[x]);
  }
  for (int x = 0; x < NQ; ++x) {
    const __m512 pairs = _mm512_add_ps(acc[x], _mm512_permute_ps(acc[x], 0x4E));  // lane 0: s0 + s2, lane 1: s1 + s3
    alignas(64) float sums[16];
    _mm512_store_ps(sums, _mm512_add_ps(pairs, _mm512_permute_ps(pairs, 0xB1)));
    for (int j = 0; j < 4; ++j) out[x][j] = sums[4 * j];
  }
}

// dots4's query operand: for each 16 dimensions g, its 128-bit blocks m = 0..3 each copied to all four.
inline void query_blocks(const float* q, int head_dim, QueryBlock* qb) {
  for (int d = 0, g = 0; d < head_dim; d += kLanes, ++g) {
    const __m512 qd = _mm512_load_ps(q + d);
    qb[4 * g + 0] = _mm512_shuffle_f32x4(qd, qd, 0x00);
    qb[4 * g + 1] = _mm512_shuffle_f32x4(qd, qd, 0x55);
    qb[4 * g + 2] = _mm512_shuffle_f32x4(qd, qd, 0xAA);
    qb[4 * g + 3] = _mm512_shuffle_f32x4(qd, qd, 0xFF);
  }
}

#else
// AVX2: the same four partial sums per key, two keys per register (128-bit half j holds key j's), the
// query's four dimensions d .. d+3 in both halves.
using QueryBlock = __m256;
constexpr int kQueryBlockDims = 4;

inline __m256 pair_sums(__m256 acc) {  // per half: (s0 + s2) + (s1 + s3) in its lane 0
  const __m256 pairs = _mm256_add_ps(acc, _mm256_permute_ps(acc, 0x4E));
  return _mm256_add_ps(pairs, _mm256_permute_ps(pairs, 0xB1));
}

template <int NQ, typename Elem>
inline void dots4(const QueryBlock* const* qb, const Elem* const* k, int head_dim, float* const* out) {
  __m256 acc01[NQ], acc23[NQ];
  for (int x = 0; x < NQ; ++x) acc01[x] = _mm256_setzero_ps(), acc23[x] = _mm256_setzero_ps();
  for (int d = 0; d < head_dim; d += kLanes) {
    const V16 k0 = simd::loadu(k[0] + d), k1 = simd::loadu(k[1] + d);
    const V16 k2 = simd::loadu(k[2] + d), k3 = simd::loadu(k[3] + d);
    // step m: dimensions d + 4m .. d + 4m + 3 of two keys, one per half
    const __m256 keys01[4] = {_mm256_permute2f128_ps(k0.lo, k1.lo, 0x20), _mm256_permute2f128_ps(k0.lo, k1.lo, 0x31),
                              _mm256_permute2f128_ps(k0.hi, k1.hi, 0x20), _mm256_permute2f128_ps(k0.hi, k1.hi, 0x31)};
    const __m256 keys23[4] = {_mm256_permute2f128_ps(k2.lo, k3.lo, 0x20), _mm256_permute2f128_ps(k2.lo, k3.lo, 0x31),
                              _mm256_permute2f128_ps(k2.hi, k3.hi, 0x20), _mm256_permute2f128_ps(k2.hi, k3.hi, 0x31)};
    for (int x = 0; x < NQ; ++x) {
      const QueryBlock* q = qb[x] + d / kQueryBlockDims;
      for (int m = 0; m < 4; ++m) {
        acc01[x] = _mm256_fmadd_ps(q[m], keys01[m], acc01[x]);
        acc23[x] = _mm256_fmadd_ps(q[m], keys23[m], acc23[x]);
      }
    }
  }
  for (int x = 0; x < NQ; ++x) {
    alignas(32) float sums01[8], sums23[8];
    _mm256_store_ps(sums01, pair_sums(acc01[x]));
    _mm256_store_ps(sums23, pair_sums(acc23[x]));
    out[x][0] = sums01[0], out[x][1] = sums01[4], out[x][2] = sums23[0], out[x][3] = sums23[4];
  }
}

inline void query_blocks(const float* q, int head_dim, QueryBlock* qb) {
  for (int d = 0; d < head_dim; d += kQueryBlockDims) qb[d / kQueryBlockDims] = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(q + d));
}
#endif

template <typename Elem>
struct Pool {
  const Elem* data;
  int64_t head_stride, block_stride, token_stride;  // elements
  int block_tokens;
  const Elem* token(int kv_head, int block, int offset) const {
    return data + kv_head * head_stride + block * block_stride + offset * token_stride;
  }
};

// A row's positions in order, as pointers into the pool (one division per split, not per key).
template <typename Elem>
struct Cursor {
  const Pool<Elem>& pool;
  const int32_t* table;
  int kv_head, index, offset;
  Cursor(const Pool<Elem>& pool, const int32_t* table, int kv_head, int position)
      : pool(pool), table(table), kv_head(kv_head), index(position / pool.block_tokens),
        offset(position % pool.block_tokens) {}
  __attribute__((always_inline)) const Elem* next() {  // inlined: the attention loops call it per position
    const Elem* at = pool.token(kv_head, table[index], offset);
    if (++offset == pool.block_tokens) offset = 0, ++index;
    return at;
  }
};

// Asks for a row's keys or values a fixed distance ahead of the arithmetic that reads them: one key
// at a time, the attention loops wait on memory (measured from DRAM on one core: 14 GB/s).
template <typename Elem>
struct Lookahead {
  Cursor<Elem> cursor;
  int left;   // positions not yet asked for
  int lines;  // cache lines per position
  Lookahead(const Pool<Elem>& pool, const int32_t* table, int kv_head, int position, int end, int head_dim)
      : cursor(pool, table, kv_head, position), left(end - position),
        lines(static_cast<int>((head_dim * sizeof(Elem) + 63) / 64)) {}
  __attribute__((always_inline)) void fetch(int count) {
    for (; count > 0 && left > 0; --count, --left) {
      const char* at = reinterpret_cast<const char*>(cursor.next());
      for (int l = 0; l < lines; ++l) _mm_prefetch(at + 64 * l, _MM_HINT_T0);
    }
  }
};

// How far ahead a Lookahead asks: 8 KiB of keys or values (64 positions of a 64-wide bfloat16 head).
// Measured on pools larger than the caches (one row, 600 positions, 8 heads of 64, Zen 5): one core
// 88 us a call without, 51 us with (16 positions ahead: 72 us; 256: 63 us); two cores 67-85 against
// 34-41 us.
constexpr int kAheadBytes = 8192;

// The most queries that attend in one pass over their keys and values: a row's query heads that share
// a kv head (grouped-query attention) and the rows of one sequence that a verify or a catch-up feeds
// at consecutive positions (the same blocks, the same first key).
constexpr int kMaxGroup = 8;

// One query's state while it attends: its query in dots4's blocks, a split's scores and probabilities,
// its float32 accumulator, its running max and sum (torch's kernel's, per query).
struct QueryState {
  alignas(64) QueryBlock qb[512 / kQueryBlockDims];
  alignas(64) float scores[kSplit + 4];
  alignas(64) float probs[kSplit];  // bfloat16: rounded to it, held as float32
  alignas(64) float dst[512];
  float running_max, running_sum;
  int size;  // its positions in the split being attended
};

// One split's scores of NQ queries, positions n .. n+most-1 (``most``: the longest query's size there;
// a query's scores past its own size are computed from keys it does not attend to and never read).
template <int NQ, typename Elem>
void split_scores(QueryState* const* st, const Pool<Elem>& keys, const int32_t* table, int n, int most, int kv_head,
                  int head_dim, int ahead) {
  Cursor<Elem> key_at(keys, table, kv_head, n);
  Lookahead<Elem> key_ahead(keys, table, kv_head, n, n + most, head_dim);
  key_ahead.fetch(ahead);
  const QueryBlock* qb[NQ];
  float* out[NQ];
  for (int x = 0; x < NQ; ++x) qb[x] = st[x]->qb;
  const Elem* rows[4];
  for (int i = 0; i < most; i += 4) {
    key_ahead.fetch(4);
    const int count = std::min(4, most - i);
    for (int j = 0; j < 4; ++j) rows[j] = j < count ? key_at.next() : rows[0];  // a short group repeats a key
    for (int x = 0; x < NQ; ++x) out[x] = st[x]->scores + i;
    dots4<NQ>(qb, rows, head_dim, out);
  }
}

// One query's split: its scores scaled, the exponentials and their sum as _exp_reduce_sum_fusion_kernel,
// the running max and sum updated, its accumulator started or rescaled.
template <typename Elem>
void split_softmax(QueryState& q, bool first, float scale, int head_dim) {
  const int size = q.size;
  float* scores = q.scores;
  float block_max = -std::numeric_limits<float>::infinity();
  {
    const V16 scale_v = simd::set1(scale);
    V16 max_lanes = simd::set1(block_max);
    int i = 0;
    for (; i + kLanes <= size; i += kLanes) {
      const V16 scaled = simd::mul(simd::loadu(scores + i), scale_v);
      simd::storeu(scores + i, scaled);
      max_lanes = simd::max(max_lanes, scaled);
    }
    block_max = simd::reduce_max(max_lanes);
    for (; i < size; ++i) {
      scores[i] = scores[i] * scale;
      block_max = std::max(block_max, scores[i]);
    }
  }
  const float new_max = q.running_max > block_max ? q.running_max : block_max;
  const int vectorized = size - size % kLanes;
  const V16 max_v = simd::set1(new_max);
  V16 lane_sum = simd::zero();
  for (int i = 0; i < vectorized; i += kLanes) {
    const V16 shifted = simd::sub(simd::loadu(scores + i), max_v);
    const V16 e = sizeof(Elem) == 2 ? fexp_u20(shifted) : exp_accurate(shifted);
    lane_sum = simd::add(lane_sum, e);
    simd::storeu(q.probs + i, e);
  }
  float block_sum = reduce_add(lane_sum);
  for (int i = vectorized; i < size; ++i) {
    const float e = std::exp(scores[i] - new_max);
    block_sum += e;
    q.probs[i] = e;
  }
  if (sizeof(Elem) == 2) round_to_bf16(q.probs, size);  // bfloat16: as torch's kernel does
  const float rescale = std::exp(q.running_max - new_max);
  q.running_sum = block_sum + rescale * q.running_sum;
  q.running_max = new_max;
  if (first) {
    for (int d = 0; d < head_dim; ++d) q.dst[d] = 0.f;
  } else {
    for (int d = 0; d < head_dim; ++d) q.dst[d] = q.dst[d] * rescale;
  }
}

// A split's probabilities times values added to NQ queries' accumulators in the GEMM's order (probed,
// as dots4): whole fours of positions from the split's first, each four summed as (p0 v0 + p2 v2) +
// (p1 v1 + p3 v3) and then added. Here the fours from ``from`` to ``to`` (positions of the split,
// multiples of 4), each value loaded once for every query; the accumulators are read from and stored
// to each query's dst, so that a query's later fours and its last size % 4 positions (values_rest)
// continue its additions in the same order as if it had attended alone.
template <int NQ, typename Elem>
void values_fours(QueryState* const* st, const Pool<Elem>& values, const int32_t* table, int n, int from, int to,
                  int kv_head, int head_dim, int ahead) {
  constexpr int kChunks = NQ <= 4 ? 4 : 2;  // 16-lane accumulators per query held in registers
  Cursor<Elem> first(values, table, kv_head, n + from);
  for (int d = 0; d < head_dim; d += kChunks * kLanes) {
    Cursor<Elem> at = first;
    Lookahead<Elem> value_ahead(values, table, kv_head, n + from, n + to, head_dim);
    value_ahead.fetch(ahead);
    const int chunks = std::min(kChunks, (head_dim - d) / kLanes);
    V16 acc[NQ][kChunks];
    for (int x = 0; x < NQ; ++x)
      for (int c = 0; c < chunks; ++c) acc[x][c] = simd::loadu(st[x]->dst + d + c * kLanes);
    for (int i = from; i < to; i += 4) {
      value_ahead.fetch(4);
      const Elem* v[4];
      for (int j = 0; j < 4; ++j) v[j] = at.next() + d;
      V16 w[NQ][4];
      for (int x = 0; x < NQ; ++x)
        for (int j = 0; j < 4; ++j) w[x][j] = simd::set1(st[x]->probs[i + j]);
      for (int c = 0; c < chunks; ++c) {
        const int o = c * kLanes;
        const V16 v0 = simd::loadu(v[0] + o), v1 = simd::loadu(v[1] + o);
        const V16 v2 = simd::loadu(v[2] + o), v3 = simd::loadu(v[3] + o);
        for (int x = 0; x < NQ; ++x) {
          // p v products are exact in float32 (two bfloat16 factors): a fused multiply-add rounds as mul + add
          const V16 even = simd::fmadd(w[x][2], v2, simd::mul(w[x][0], v0));
          const V16 odd = simd::fmadd(w[x][3], v3, simd::mul(w[x][1], v1));
          acc[x][c] = simd::add(acc[x][c], simd::add(even, odd));
        }
      }
    }
    for (int x = 0; x < NQ; ++x)
      for (int c = 0; c < chunks; ++c) simd::storeu(st[x]->dst + d + c * kLanes, acc[x][c]);
  }
}

// One query's last size % 4 positions of a split, added one by one, last first.
template <typename Elem>
void values_rest(QueryState& q, const Pool<Elem>& values, const int32_t* table, int n, int kv_head, int head_dim) {
  const int fours = q.size - q.size % 4;
  if (fours == q.size) return;
  Cursor<Elem> at(values, table, kv_head, n + fours);
  const Elem* rest[3];
  for (int i = fours; i < q.size; ++i) rest[i - fours] = at.next();
  for (int i = q.size - 1; i >= fours; --i) {
    const V16 w = simd::set1(q.probs[i]);
    for (int d = 0; d < head_dim; d += kLanes)
      simd::storeu(q.dst + d, simd::fmadd(w, simd::loadu(rest[i - fours] + d), simd::loadu(q.dst + d)));
  }
}

// f(std::integral_constant<int, count>{}) for count 1 .. kMaxGroup: the kernels above keep that many
// queries' sums in registers.
template <typename F>
void with_count(int count, F&& f) {
  switch (count) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

// One query of a group: where it comes from and goes, and how far it attends.
template <typename Elem>
struct Query {
  const Elem* q;  // [hd]
  Elem* out;      // [hd]
  int end;
};

// ``count`` queries (at most kMaxGroup, longest first) over the positions start .. end-1 of their
// kv head, in the blocks of ``table``: each computes what it would alone, bit for bit; the keys and
// values they share are read and converted once.
template <typename Elem>
void attend(const Query<Elem>* queries, int count, const Pool<Elem>& keys, const Pool<Elem>& values,
            const int32_t* table, int start, int kv_head, int head_dim, float scale) {
  static thread_local QueryState states[kMaxGroup];
  QueryState* st[kMaxGroup];
  alignas(64) float q[512];
  for (int x = 0; x < count; ++x) {
    st[x] = &states[x];
    for (int d = 0; d < head_dim; ++d) q[d] = to_float(queries[x].q[d]);
    query_blocks(q, head_dim, st[x]->qb);
    st[x]->running_max = -std::numeric_limits<float>::infinity();
    st[x]->running_sum = 0.f;
  }
  const int ahead = std::max<int>(4, kAheadBytes / (head_dim * static_cast<int>(sizeof(Elem))));
  for (int n = start; n < queries[0].end; n += kSplit) {
    int active = 0;  // queries with positions in this split: a prefix (longest first)
    while (active < count && queries[active].end > n) {
      st[active]->size = std::min(kSplit, queries[active].end - n);
      ++active;
    }
    const int most = st[0]->size;
    int fours = most;  // the whole fours every active query has
    for (int x = 0; x < active; ++x) fours = std::min(fours, st[x]->size - st[x]->size % 4);
    with_count(active, [&](auto nq) { split_scores<decltype(nq)::value, Elem>(st, keys, table, n, most, kv_head, head_dim, ahead); });
    for (int x = 0; x < active; ++x) split_softmax<Elem>(*st[x], n == start, scale, head_dim);
    with_count(active, [&](auto nq) { values_fours<decltype(nq)::value, Elem>(st, values, table, n, 0, fours, kv_head, head_dim, ahead); });
    for (int x = 0; x < active; ++x) {
      const int own = st[x]->size - st[x]->size % 4;
      if (own > fours) values_fours<1, Elem>(&st[x], values, table, n, fours, own, kv_head, head_dim, ahead);
      values_rest<Elem>(*st[x], values, table, n, kv_head, head_dim);
    }
  }
  for (int x = 0; x < count; ++x) {
    const float reciprocal = 1.f / (st[x]->running_sum == 0.f ? 1.f : st[x]->running_sum);
    for (int d = 0; d < head_dim; ++d) queries[x].out[d] = from_float<Elem>(st[x]->dst[d] * reciprocal);
  }
}

template <typename Elem>
Pool<Elem> pool_of(const at::Tensor& t) {
  return Pool<Elem>{reinterpret_cast<const Elem*>(t.data_ptr()), t.stride(0), t.stride(1), t.stride(2),
                    static_cast<int>(t.size(2))};
}

template <typename Elem>
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& block_table, const at::Tensor& starts, const at::Tensor& ends,
                            double scale) {
  const at::ScalarType type = sizeof(Elem) == 2 ? at::kBFloat16 : at::kFloat;
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == type && q.is_contiguous(), "q: [B, H, hd] ", type);
  TORCH_CHECK(k.dim() == 4 && v.sizes() == k.sizes() && k.scalar_type() == type && v.scalar_type() == type &&
                  k.stride(3) == 1 && v.stride(3) == 1,
              "k, v: [KVH, NB, bt, hd] ", type, ", last dimension contiguous");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.is_contiguous() && block_table.dim() == 2,
              "block_table: [B, W] int32");
  TORCH_CHECK(starts.scalar_type() == at::kInt && ends.scalar_type() == at::kInt, "starts, ends: int32");
  const int64_t batch = q.size(0), heads = q.size(1), head_dim = q.size(2), kv_heads = k.size(0);
  TORCH_CHECK(head_dim == k.size(3) && head_dim % kLanes == 0 && head_dim <= 512, "head_dim: a multiple of 16, <= 512");
  TORCH_CHECK(heads % kv_heads == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(block_table.size(0) == batch && starts.numel() == batch && ends.numel() == batch, "one row per query");
  auto out = at::empty_like(q);
  const Pool<Elem> keys = pool_of<Elem>(k), vals = pool_of<Elem>(v);
  const auto* qd = reinterpret_cast<const Elem*>(q.data_ptr());
  auto* od = reinterpret_cast<Elem*>(out.data_ptr());
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int32_t* st = starts.data_ptr<int32_t>();
  const int32_t* en = ends.data_ptr<int32_t>();
  const int64_t width = block_table.size(1), group = heads / kv_heads;
  const float s = static_cast<float>(scale);
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(0 <= st[b] && st[b] < en[b] && en[b] <= width * keys.block_tokens, "row ", b, ": bad range");
  }
  // Items of at most kMaxGroup queries that attend together: per run of consecutive rows with the same
  // first key and blocks (one sequence's rows at consecutive positions, as a verify feeds them, or a
  // single row), per kv head, the queries of its heads in those rows, longest first, in even shares.
  // Rows of different lengths cost differently: threads take items as they finish one.
  struct Item {
    int64_t row;  // the run's first row: its blocks and first key
    int kv_head, count;
    Query<Elem> queries[kMaxGroup];
  };
  static thread_local std::vector<Item> items;
  static thread_local std::vector<Query<Elem>> run;
  items.clear();
  for (int64_t b = 0; b < batch;) {
    int64_t e = b + 1;
    while (e < batch && st[e] == st[b] && std::memcmp(table + e * width, table + b * width, width * sizeof(int32_t)) == 0)
      ++e;
    for (int64_t h = 0; h < kv_heads; ++h) {
      run.clear();
      for (int64_t r = b; r < e; ++r)
        for (int64_t head = h * group; head < (h + 1) * group; ++head) {
          const int64_t at = (r * heads + head) * head_dim;
          run.push_back({qd + at, od + at, en[r]});
        }
      std::stable_sort(run.begin(), run.end(), [](const Query<Elem>& x, const Query<Elem>& y) { return x.end > y.end; });
      const int64_t shares = (static_cast<int64_t>(run.size()) + kMaxGroup - 1) / kMaxGroup;
      for (int64_t i = 0, taken = 0; i < shares; ++i) {
        const int64_t count = (static_cast<int64_t>(run.size()) - taken) / (shares - i);
        Item item{b, static_cast<int>(h), static_cast<int>(count), {}};
        std::copy(run.begin() + taken, run.begin() + taken + count, item.queries);
        items.push_back(item);
        taken += count;
      }
    }
    b = e;
  }
  const std::vector<Item>& work = items;  // in the lambda, ``items`` would name each worker's own (empty) vector
  resident::for_each_shared(static_cast<int64_t>(work.size()), [&](int64_t i) {
    const Item& item = work[i];
    attend<Elem>(item.queries, item.count, keys, vals, table + item.row * width, st[item.row], item.kv_head,
                 static_cast<int>(head_dim), s);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(resident, m) {
  m.def("decode_attention_bf16(Tensor q, Tensor k, Tensor v, Tensor block_table, Tensor starts, Tensor ends, "
        "float scale) -> Tensor");
  m.def("decode_attention_f32(Tensor q, Tensor k, Tensor v, Tensor block_table, Tensor starts, Tensor ends, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(resident, CPU, m) {
  m.impl("decode_attention_bf16", &decode_attention<uint16_t>);
  m.impl("decode_attention_f32", &decode_attention<float>);
}
