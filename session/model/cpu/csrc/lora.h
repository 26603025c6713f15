// LoRA deltas for decode rows on CPU (session/model/lora.py's LoRALinear, and the decode layer in
// csrc/decode_layer.h): y[n] += (x[n] A^T, masked by mask[n]) B^T for rows n of one token each, in float32,
// rounded once into y. ATen's two products cost a oneDNN call each in bfloat16 (~10-20 us, 14 a layer);
// this is one pass over A and B per row, vectorized 16 outputs at a time (csrc/simd.h).
//
// y [N, out] contiguous; x [N, in], rows contiguous; a = A^T [in, R], b = B^T [R, out], each row
// contiguous (any row stride: a slot's slice of the bank); mask [N, R] contiguous, or None. All of the
// layer's element type. h = x A^T is summed input by input in float32, then each output adds h[j] B^T[j]
// for the j the mask keeps, in order, in float32, and y + delta is rounded once. The mask selects rather
// than multiplies: a column of another adapter may overflow to Inf, and Inf * 0 is NaN; skipping a
// dropped column leaves the sum's bits as adding its +0 did (the sum starts at +0, so it is never -0).
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include "bf16.h"
#include "parallel.h"
#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using resident::simd::V16;
namespace simd = resident::simd;

using resident::from_float;
using resident::to_float;

// ``count`` (<= 16) elements from p as float32, zero past them
template <typename Elem>
inline V16 lora_load_part(const Elem* p, int64_t count) {
  if (count == 16) return simd::loadu(p);
  alignas(64) float lanes[16] = {};
  for (int64_t i = 0; i < count; ++i) lanes[i] = to_float(p[i]);
  return simd::loadu(lanes);
}

template <typename Elem>
void lora_add(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
              const c10::optional<at::Tensor>& mask) {
  const at::ScalarType type = sizeof(Elem) == 2 ? at::kBFloat16 : at::kFloat;
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && a.dim() == 2 && b.dim() == 2, "lora: 2-d y, x, A^T, B^T");
  TORCH_CHECK(y.scalar_type() == type && x.scalar_type() == type && a.scalar_type() == type && b.scalar_type() == type,
              "lora: one dtype");
  const int64_t rows = x.size(0), in = x.size(1), rank = a.size(1), out = b.size(1);
  TORCH_CHECK(y.is_contiguous() && y.size(0) == rows && y.size(1) == out && a.size(0) == in && b.size(0) == rank &&
                  x.stride(1) == 1 && a.stride(1) == 1 && b.stride(1) == 1,
              "lora: y [N, out] contiguous, x [N, in], A^T [in, R], B^T [R, out] with contiguous rows");
  const Elem* m = nullptr;
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == type && mask->is_contiguous() && mask->numel() == rows * rank, "lora: mask [N, R]");
    m = reinterpret_cast<const Elem*>(mask->data_ptr());
  }
  const auto* xs = reinterpret_cast<const Elem*>(x.data_ptr());
  const auto* as = reinterpret_cast<const Elem*>(a.data_ptr());
  const auto* bs = reinterpret_cast<const Elem*>(b.data_ptr());
  auto* ys = reinterpret_cast<Elem*>(y.data_ptr());
  const int64_t x_stride = x.stride(0), a_stride = a.stride(0), b_stride = b.stride(0);
  const int64_t chunks = (rank + 15) / 16;
  resident::for_each_shared(rows, [&](int64_t n) {
    std::vector<float> h(chunks * 16, 0.f);
    for (int64_t c = 0; c < chunks; ++c) {  // h = x A^T, 16 of its R at a time
      const int64_t width = std::min<int64_t>(16, rank - c * 16);
      V16 acc = simd::zero();
      for (int64_t i = 0; i < in; ++i)
        acc = simd::fmadd(simd::set1(to_float(xs[n * x_stride + i])), lora_load_part(as + i * a_stride + c * 16, width),
                          acc);
      simd::storeu(h.data() + c * 16, acc);
    }
    std::vector<int64_t> kept;  // the columns of the row's own adapter
    kept.reserve(rank);
    for (int64_t j = 0; j < rank; ++j)
      if (m == nullptr || to_float(m[n * rank + j]) != 0.f) kept.push_back(j);
    for (int64_t o = 0; o < out; o += 16) {  // y += h B^T, 16 outputs at a time
      const int64_t width = std::min<int64_t>(16, out - o);
      V16 acc = simd::zero();
      for (const int64_t j : kept) acc = simd::fmadd(simd::set1(h[j]), lora_load_part(bs + j * b_stride + o, width), acc);
      alignas(64) float delta[16];
      simd::storeu(delta, acc);
      for (int64_t e = 0; e < width; ++e) ys[n * out + o + e] = from_float<Elem>(to_float(ys[n * out + o + e]) + delta[e]);
    }
  });
}

}  // namespace
