// One decoder layer of a decode step on CPU, in one call, and the whole step around the layers
// (DecodeStack), for bfloat16 (csrc/decode_layer.cpp) and float32 (csrc/decode_layer_f32.cpp): what
// ModelRunner's Python step (attention_inputs, the pool's write_rows, our attention kernel,
// finish_layer) and transformers' Llama-family modules compute, bit for bit, without ~300 small torch
// calls a step and the interpreter around them:
// - the linears: our kernel's tiles (csrc/linear_tiles.h), q, k and v in one parallel region, gate
//   and up in another; the attention: our operator (resident::decode_attention_bf16 / _f32, through
//   the dispatcher);
// - RMSNorm, the rotary embedding and the residual adds written out here with the arithmetic of the
//   ATen kernels the Python layer calls: each operator's float result rounded to the element type
//   where ATen's is (a no-op in float32), and RMSNorm's mean summed in the order of ATen's float sum
//   kernel (aten_row_sum);
// - SiLU and the product with up: ATen's own operators (their exponential is Sleef's).
// tests/integration/test_bf16_decode.py and test_f32_decode.py compare it with the Python layer and
// transformers' forward, and session/model/cpu/fused_layer.py checks RMSNorm against transformers' at load.
//
// resident::decode_layer_<dtype>(h [B, D], weights, biases, sizes, floats, cos [B, hd], sin [B, hd],
//                                k_layer, v_layer [KVH, NB, bt, hd], slots [B] int64, block_table
//                                [B, W] int32, starts [B] int32, ends [B] int32) -> h [B, D]
//   weights: input norm, post-attention norm, then q, k, v, o, gate, up, down packed for our linear
//            kernel, then (Qwen3) the q and k norms
//   biases:  q, k, v, o, gate, up, down (None where absent)
//   sizes:   heads, kv heads, head dim, then the out features of the 7 linears, then their one-row
//            input block sizes, then 1 where the q and k norms exist, then the lanes of ATen's float
//            sum (8 or 16: rms_norm)
//   floats:  the two norms' epsilons, the q/k norms' epsilon, the attention scale
//   lora:    empty (no adapter rows), or per linear (q .. down) its LoRA A^T [in, R] and B^T [R, out]
//            (None, None where no adapter targets it); mask [B, 1, R] or None: the deltas session/
//            adapters.py's LoRALinear adds to decode rows, by the same kernel (csrc/lora.h, so the same
//            bits): one adapter for every row, y += (x A^T) B^T; a mix, y += ((x A^T) * mask) B^T over
//            the mix's concatenation
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "bf16.h"
#include "linear_tiles.h"
#include "lora.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>

namespace {

using AttentionFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, const at::Tensor&, double);

constexpr int kMaxLanes = 16;  // ATen's Vectorized<float> has 8 (AVX2) or 16 (AVX512) lanes: see rms_norm

// The two element types: bfloat16 (its bits, uint16_t) and float32 (csrc/bf16.h).
using resident::from_float;
using resident::to_float;
template <typename Elem> inline float rounded(float f) { return to_float(from_float<Elem>(f)); }  // as ATen stores it
template <typename Elem> constexpr at::ScalarType scalar_type() { return sizeof(Elem) == 2 ? at::kBFloat16 : at::kFloat; }
template <typename Elem> const Elem* data(const at::Tensor& t) { return reinterpret_cast<const Elem*>(t.data_ptr()); }
template <typename Elem> Elem* data(at::Tensor& t) { return reinterpret_cast<Elem*>(t.data_ptr()); }

// ATen's float sum of one contiguous row (SumKernel.cpp: vectorized_inner_sum over row_sum over
// multi_row_sum: vectors of ``lanes`` floats, 4 of them side by side, cascaded every 16 rows of 4),
// step for step.
inline float aten_row_sum(const float* x, int64_t n, int lanes) {
  constexpr int kLevels = 4, kRows = 4, kPower = 4;  // level_power: max(4, CeilLog2(rows) / 4) = 4 below 2^16 rows
  const int64_t vectors = n / lanes, rows = vectors / kRows;
  float acc[kLevels][kRows][kMaxLanes] = {};
  auto add_row = [&](int64_t r) {
    for (int k = 0; k < kRows; ++k)
      for (int l = 0; l < lanes; ++l) acc[0][k][l] += x[(r * kRows + k) * lanes + l];
  };
  TORCH_CHECK(rows < (int64_t(1) << 16), "row too long for the summation model");
  constexpr int64_t step = int64_t(1) << kPower, mask = step - 1;
  int64_t i = 0;
  while (i + step <= rows) {
    for (int64_t j = 0; j < step; ++j, ++i) add_row(i);
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < kRows; ++k)
        for (int l = 0; l < lanes; ++l) {
          acc[j][k][l] += acc[j - 1][k][l];
          acc[j - 1][k][l] = 0.f;
        }
      if ((i & (mask << (j * kPower))) != 0) break;
    }
  }
  for (; i < rows; ++i) add_row(i);
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < kRows; ++k)
      for (int l = 0; l < lanes; ++l) acc[0][k][l] += acc[j][k][l];
  for (int64_t v = rows * kRows; v < vectors; ++v)
    for (int l = 0; l < lanes; ++l) acc[0][0][l] += x[v * lanes + l];
  for (int k = 1; k < kRows; ++k)
    for (int l = 0; l < lanes; ++l) acc[0][0][l] += acc[0][k][l];
  float total = 0.f;
  for (int64_t e = vectors * lanes; e < n; ++e) total += x[e];
  for (int l = 0; l < lanes; ++l) total += acc[0][0][l];
  return total;
}

// transformers' LlamaRMSNorm.forward over the last dimension, its operators' arithmetic written out:
// to float, x * x, mean (ATen's sum, then / n), + eps, 1 / sqrt, times, to the element type, weight
// times. ``lanes``: the width of ATen's float vectors in its sum kernel (8 where it runs AVX2 code, as
// it did on this project's CPU; session/model/cpu/fused_layer.py finds it at load by comparing with LlamaRMSNorm).
// src, dst: [rows, n] contiguous; w: [n].
template <typename Elem>
void rms_norm_rows(const Elem* src, const Elem* w, Elem* dst, int64_t rows, int64_t n, double eps, int64_t lanes) {
  thread_local std::vector<float> squares;
  squares.resize(n);
  const float epsilon = static_cast<float>(eps), count = static_cast<float>(n);
  for (int64_t r = 0; r < rows; ++r) {
    const Elem* row = src + r * n;
    for (int64_t e = 0; e < n; ++e) {
      const float v = to_float(row[e]);
      squares[e] = v * v;
    }
    const float scale = 1.f / std::sqrt(aten_row_sum(squares.data(), n, static_cast<int>(lanes)) / count + epsilon);
    for (int64_t e = 0; e < n; ++e) {
      const float normed = rounded<Elem>(to_float(row[e]) * scale);
      dst[r * n + e] = from_float<Elem>(to_float(w[e]) * normed);
    }
  }
}

// rms_norm_rows of ``input`` (any shape, normalized over its last dimension) into ``out`` (made or
// remade there to fit, as linear_tiles.h's buffer).
template <typename Elem>
const at::Tensor& rms_norm_into(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double eps,
                                int64_t lanes) {
  TORCH_CHECK(lanes == 8 || lanes == 16, "lanes: 8 or 16");
  const at::Tensor x = input.contiguous(), w = weight.contiguous();
  const int64_t n = x.size(-1);
  TORCH_CHECK(x.scalar_type() == scalar_type<Elem>() && weight.scalar_type() == scalar_type<Elem>() &&
                  weight.numel() == n,
              "rms_norm: rows and weight of one dtype");
  buffer(out, x.sizes(), x.options());
  rms_norm_rows<Elem>(data<Elem>(x), data<Elem>(w), data<Elem>(out), x.numel() / n, n, eps, lanes);
  return out;
}

template <typename Elem>
at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps, int64_t lanes) {
  at::Tensor out;
  return rms_norm_into<Elem>(out, input, weight, eps, lanes);
}

// transformers' rotate_half and apply_rotary_pos_emb: (x * cos) + (rotate_half(x) * sin), each
// product and the sum rounded to the element type. x [B, heads, hd] (any strides), cos/sin [B, hd];
// into ``out`` [B, heads, hd] (made or remade there to fit).
template <typename Elem>
const at::Tensor& rotate_into(at::Tensor& out, const at::Tensor& input, const at::Tensor& cos, const at::Tensor& sin) {
  const at::Tensor x = input.contiguous(), c = cos.contiguous(), s = sin.contiguous();
  const int64_t batch = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  TORCH_CHECK(x.dim() == 3 && c.sizes() == s.sizes() && c.dim() == 2 && c.size(0) == batch && c.size(1) == dim,
              "rotary: x [B, heads, hd], cos and sin [B, hd]");
  TORCH_CHECK(x.scalar_type() == scalar_type<Elem>() && c.scalar_type() == x.scalar_type() &&
                  s.scalar_type() == x.scalar_type(), "rotary: one dtype");
  buffer(out, x.sizes(), x.options());
  const Elem* xs = data<Elem>(x);
  const Elem* cs = data<Elem>(c);
  const Elem* ss = data<Elem>(s);
  Elem* os = data<Elem>(out);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h) {
      const Elem* v = xs + (b * heads + h) * dim;
      Elem* o = os + (b * heads + h) * dim;
      for (int64_t e = 0; e < dim; ++e) {
        const float rotated = e < half ? -to_float(v[e + half]) : to_float(v[e - half]);
        const float first = rounded<Elem>(to_float(v[e]) * to_float(cs[b * dim + e]));
        const float second = rounded<Elem>(rotated * to_float(ss[b * dim + e]));
        o[e] = from_float<Elem>(first + second);
      }
    }
  return out;
}

template <typename Elem>
at::Tensor rotate(const at::Tensor& input, const at::Tensor& cos, const at::Tensor& sin) {
  at::Tensor out;
  return rotate_into<Elem>(out, input, cos, sin);
}

// a + b (the residual adds): the float sum rounded to the element type, into ``out`` (made or remade
// there to fit; it may be ``a`` or ``b`` itself, each element is read before it is written)
template <typename Elem>
const at::Tensor& add_into(at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous() && a.numel() == b.numel(), "add: contiguous, same size");
  buffer(out, a.sizes(), a.options());
  const Elem* x = data<Elem>(a);
  const Elem* y = data<Elem>(b);
  Elem* o = data<Elem>(out);
  for (int64_t e = 0; e < a.numel(); ++e) o[e] = from_float<Elem>(to_float(x[e]) + to_float(y[e]));
  return out;
}

// One layer's intermediate tensors, and each linear's output and float32 block sums: a DecodeStack
// keeps one for all its layers and steps (remade where a batch size or a layer's shape differs from
// the last), so that a step allocates no more than attention's outputs; the per-layer operator makes
// one per call. Its tensors are overwritten by the next layer: nothing in it leaves a call.
struct Workspace {
  at::Tensor normed, q_normed, k_normed, q, k, mid, product, out;
  at::Tensor y[7], sums[7];  // q, k, v, o, gate, up, down
  at::Tensor head_sums;
};

// The pool's write_rows for a head-major layer: row b's keys of every kv head into slot slots[b].
inline void write_rows(at::Tensor& layer, const at::Tensor& slots, const at::Tensor& rows) {
  TORCH_CHECK(rows.scalar_type() == layer.scalar_type() && rows.is_contiguous(), "rows: the pool's dtype, contiguous");
  const int64_t kv_heads = layer.size(0), per_head = layer.size(1) * layer.size(2), head_dim = layer.size(3);
  const int64_t bytes = head_dim * layer.element_size();
  auto* base = static_cast<char*>(layer.data_ptr());
  const auto* src = static_cast<const char*>(rows.data_ptr());  // [B, KVH, hd]
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < rows.size(0); ++b) {
    TORCH_CHECK(0 <= slot[b] && slot[b] < per_head, "slot out of the pool");
    for (int64_t h = 0; h < kv_heads; ++h) {
      std::memcpy(base + (h * per_head + slot[b]) * bytes, src + (b * kv_heads + h) * bytes, bytes);
    }
  }
}

// One layer; the arguments as the header documents them. F: the linears' weight format.
// LoRALinear's delta (session/model/lora.py) added to y [B, out] in place: linear i of ``lora`` (from
// ``first``, 14 entries a layer), x [B, in].
template <typename Elem>
void add_lora(const c10::List<c10::optional<at::Tensor>>& lora, int64_t first, int i,
              const c10::optional<at::Tensor>& mask, const at::Tensor& x, const at::Tensor& y) {
  if (lora.size() == 0) return;
  const c10::optional<at::Tensor> a = lora.get(first + 2 * i), b = lora.get(first + 2 * i + 1);
  if (!a.has_value() || !b.has_value()) return;
  at::Tensor rows = y;
  c10::optional<at::Tensor> row_mask;
  if (mask.has_value()) row_mask = mask->view({x.size(0), -1});
  lora_add<Elem>(rows, x.contiguous(), *a, *b, row_mask);
}

template <typename Elem>
void lora_add_op(at::Tensor y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                 const c10::optional<at::Tensor>& mask) {
  lora_add<Elem>(y, x, a, b, mask);
}

template <typename F>
const at::Tensor& layer_forward(Workspace& ws, const at::Tensor& hidden, at::TensorList weights,
                                const c10::List<c10::optional<at::Tensor>>& biases, at::IntArrayRef sizes,
                                at::ArrayRef<double> floats, const at::Tensor& cos, const at::Tensor& sin,
                                const at::Tensor& k_layer, const at::Tensor& v_layer, const at::Tensor& slots,
                                const at::Tensor& block_table, const at::Tensor& starts, const at::Tensor& ends,
                                const c10::List<c10::optional<at::Tensor>>& lora, int64_t lora_first,
                                const c10::optional<at::Tensor>& mask) {
  using Elem = typename F::Elem;
  static auto attention_op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow(sizeof(Elem) == 2 ? "resident::decode_attention_bf16" : "resident::decode_attention_f32", "")
          .typed<AttentionFn>();
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == scalar_type<Elem>(), "h: [B, D] of the layer's dtype");
  TORCH_CHECK(weights.size() == 9 || weights.size() == 11, "weights: 2 norms, 7 linears, (2 q/k norms)");
  TORCH_CHECK(biases.size() == 7 && sizes.size() == 19 && floats.size() == 4, "biases, sizes, floats: 7, 19, 4");
  TORCH_CHECK(k_layer.is_contiguous() && v_layer.is_contiguous() && slots.scalar_type() == at::kLong,
              "k/v layer contiguous, slots int64");
  const int64_t batch = hidden.size(0), heads = sizes[0], kv_heads = sizes[1], head_dim = sizes[2];
  const bool qk_norm = sizes[17] != 0;
  const int64_t lanes = sizes[18];
  TORCH_CHECK(!qk_norm || weights.size() == 11, "q/k norms announced, not given");
  auto linear = [&](int i, const at::Tensor& x) {  // i: 0..6 = q, k, v, o, gate, up, down
    return Prepared<F>(x, weights[2 + i], biases.get(i), sizes[3 + i], sizes[10 + i], ws.y[i], ws.sums[i]);
  };
  const at::Tensor& x = rms_norm_into<Elem>(ws.normed, hidden, weights[0], floats[0], lanes);
  const Prepared<F> q_proj = linear(0, x), k_proj = linear(1, x), v_proj = linear(2, x);
  run_linears<F>({&q_proj, &k_proj, &v_proj});  // one parallel region for the three
  add_lora<Elem>(lora, lora_first, 0, mask, x, q_proj.y);
  add_lora<Elem>(lora, lora_first, 1, mask, x, k_proj.y);
  add_lora<Elem>(lora, lora_first, 2, mask, x, v_proj.y);
  at::Tensor q = q_proj.y.view({batch, heads, head_dim});
  at::Tensor k = k_proj.y.view({batch, kv_heads, head_dim});
  const at::Tensor v = v_proj.y.view({batch, kv_heads, head_dim});
  if (qk_norm) {
    q = rms_norm_into<Elem>(ws.q_normed, q, weights[9], floats[2], lanes);
    k = rms_norm_into<Elem>(ws.k_normed, k, weights[10], floats[2], lanes);
  }
  const at::Tensor& q_rotated = rotate_into<Elem>(ws.q, q, cos, sin);
  const at::Tensor& k_rotated = rotate_into<Elem>(ws.k, k, cos, sin);
  at::Tensor keys = k_layer, values = v_layer;
  write_rows(keys, slots, k_rotated);
  write_rows(values, slots, v);
  const at::Tensor o = attention_op.call(q_rotated, k_layer, v_layer, block_table, starts, ends, floats[3]);
  const at::Tensor o_rows = o.view({batch, heads * head_dim});
  const Prepared<F> o_proj = linear(3, o_rows);
  run_linears<F>({&o_proj});
  add_lora<Elem>(lora, lora_first, 3, mask, o_rows, o_proj.y);
  const at::Tensor& h = add_into<Elem>(ws.mid, hidden.contiguous(), o_proj.y);  // hidden is not read after this
  const at::Tensor& y = rms_norm_into<Elem>(ws.normed, h, weights[1], floats[1], lanes);
  const Prepared<F> gate = linear(4, y), up = linear(5, y);
  run_linears<F>({&gate, &up});
  add_lora<Elem>(lora, lora_first, 4, mask, y, gate.y);
  add_lora<Elem>(lora, lora_first, 5, mask, y, up.y);
  at::Tensor gate_y = gate.y;
  at::silu_(gate_y);  // ATen's SiLU and product, as the Python layer's act_fn(gate) * up
  buffer(ws.product, up.y.sizes(), up.y.options());
  const at::Tensor& product = at::mul_out(ws.product, gate_y, up.y);
  const Prepared<F> down = linear(6, product);
  run_linears<F>({&down});
  add_lora<Elem>(lora, lora_first, 6, mask, product, down.y);
  return add_into<Elem>(ws.out, h, down.y);
}

template <typename F>
at::Tensor decode_layer(const at::Tensor& hidden, at::TensorList weights, c10::List<c10::optional<at::Tensor>> biases,
                        at::IntArrayRef sizes, at::ArrayRef<double> floats, const at::Tensor& cos,
                        const at::Tensor& sin, at::Tensor k_layer, at::Tensor v_layer, const at::Tensor& slots,
                        const at::Tensor& block_table, const at::Tensor& starts, const at::Tensor& ends,
                        c10::List<c10::optional<at::Tensor>> lora, const c10::optional<at::Tensor>& mask) {
  TORCH_CHECK(lora.size() == 0 || lora.size() == 14, "lora: empty, or A and B for each of the 7 linears");
  Workspace ws;
  return layer_forward<F>(ws, hidden, weights, biases, sizes, floats, cos, sin, k_layer, v_layer, slots, block_table,
                          starts, ends, lora, 0, mask);
}

// A whole decode step in one call: the model's layers (each as layer_forward), and around them the
// embedding lookup, the rotary embedding's cos/sin read from a table of positions, the final RMSNorm
// and the head. session/model/cpu/fused_layer.py builds it once per model (DecodeStack, DecodeStackF32) and
// checks the table against the model's rotary module; ModelRunner calls ``run`` once per step.
template <typename F>
struct DecodeStack : torch::CustomClassHolder {
  using Elem = typename F::Elem;
  struct Layer {
    std::vector<at::Tensor> weights;
    c10::List<c10::optional<at::Tensor>> biases;
    std::vector<int64_t> sizes;
    std::vector<double> floats;
    int64_t window_row;  // this layer's row of run's ``starts``
  };
  std::vector<Layer> layers;
  Workspace workspace;  // every layer's, every step's (run is called by one thread at a time)
  std::mutex running;
  at::Tensor embedding, cos_table, sin_table;  // [V, D]; [P, hd] each (positions 0 .. P-1)
  at::Tensor norm_weight, head;                // the final norm; the head packed for our kernel (or undefined)
  c10::optional<at::Tensor> head_bias;
  double norm_eps = 0.0;
  int64_t lanes = 8, head_n = 0, head_block = 0;

  void add_layer(std::vector<at::Tensor> weights, c10::List<c10::optional<at::Tensor>> biases,
                 std::vector<int64_t> sizes, std::vector<double> floats, int64_t window_row) {
    TORCH_CHECK(sizes.size() == 19 && floats.size() == 4 && biases.size() == 7, "a layer: sizes 19, floats 4, biases 7");
    for (size_t i = 0; i < 7; ++i) biases.set(i, float_bias(biases.get(i), sizes[3 + i]));  // once, not per step
    layers.push_back({std::move(weights), std::move(biases), std::move(sizes), std::move(floats), window_row});
    lanes = layers.back().sizes[18];
  }

  void set_ends(at::Tensor embedding_weight, at::Tensor cos, at::Tensor sin, at::Tensor norm, double eps,
                c10::optional<at::Tensor> packed_head, c10::optional<at::Tensor> bias, int64_t n, int64_t block) {
    TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes(), "cos/sin tables: [P, hd]");
    embedding = std::move(embedding_weight);
    cos_table = std::move(cos);
    sin_table = std::move(sin);
    norm_weight = std::move(norm);
    norm_eps = eps;
    head = packed_head.has_value() ? *packed_head : at::Tensor();
    head_bias = float_bias(bias, n);
    head_n = n;
    head_block = block;
  }

  // ids, positions: [B] int64 (every position below the table's length); k_pool, v_pool: the pool's
  // [layers, KVH, NB, bt, hd]; slots [B] int64; block_table [B, W], starts [windows, B], ends [B]
  // int32; lora: empty, or 14 per layer (the header), mask as there -> logits [B, V] float32 where the
  // head is ours, else the normed hidden state [B, D].
  at::Tensor run(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& k_pool,
                 const at::Tensor& v_pool, const at::Tensor& slots, const at::Tensor& block_table,
                 const at::Tensor& starts, const at::Tensor& ends, c10::List<c10::optional<at::Tensor>> lora,
                 c10::optional<at::Tensor> mask) {
    TORCH_CHECK(!layers.empty() && embedding.defined(), "DecodeStack: layers and ends not set");
    TORCH_CHECK(k_pool.size(0) == static_cast<int64_t>(layers.size()), "the pool's layers");
    TORCH_CHECK(lora.size() == 0 || lora.size() == 14 * layers.size(), "lora: empty, or 14 per layer");
    const std::lock_guard<std::mutex> one_at_a_time(running);
    const at::Tensor cos = cos_table.index_select(0, positions), sin = sin_table.index_select(0, positions);
    at::Tensor h = embedding.index_select(0, ids);
    for (size_t i = 0; i < layers.size(); ++i) {
      const Layer& layer = layers[i];
      h = layer_forward<F>(workspace, h, layer.weights, layer.biases, layer.sizes, layer.floats, cos, sin,
                           k_pool.select(0, i), v_pool.select(0, i), slots, block_table,
                           starts.select(0, layer.window_row), ends, lora, static_cast<int64_t>(14 * i), mask);
    }
    h = rms_norm<Elem>(h, norm_weight, norm_eps, lanes);  // a new tensor: nothing returned is the workspace's
    if (!head.defined()) return h;
    at::Tensor logits_y;
    const Prepared<F> logits(h, head, head_bias, head_n, head_block, logits_y, workspace.head_sums);
    run_linears<F>({&logits});
    return sizeof(Elem) == 2 ? logits.y.to(at::kFloat) : logits.y;  // float32: logits_y is new each step
  }
};

}  // namespace

// Registers one dtype's operators and stack class (``suffix``: bf16 or f32; ``stack``: the class name).
#define RESIDENT_DECODE_LAYER(F, suffix, stack)                                                                 \
  TORCH_LIBRARY_FRAGMENT(resident, m) {                                                                        \
    m.def("decode_layer_" suffix "(Tensor h, Tensor[] weights, Tensor?[] biases, int[] sizes, float[] floats, " \
          "Tensor cos, Tensor sin, Tensor(a!) k_layer, Tensor(b!) v_layer, Tensor slots, Tensor block_table, "  \
          "Tensor starts, Tensor ends, Tensor?[] lora, Tensor? mask) -> Tensor");                              \
    m.def("rms_norm_" suffix "(Tensor x, Tensor weight, float eps, int lanes) -> Tensor");                    \
    m.def("rotary_" suffix "(Tensor x, Tensor cos, Tensor sin) -> Tensor");                                   \
    m.def("lora_add_" suffix "(Tensor(a!) y, Tensor x, Tensor a, Tensor b, Tensor? mask) -> ()");             \
    m.class_<DecodeStack<F>>(stack)                                                                            \
        .def(torch::init<>())                                                                                  \
        .def("add_layer", &DecodeStack<F>::add_layer)                                                          \
        .def("set_ends", &DecodeStack<F>::set_ends)                                                            \
        .def("run", &DecodeStack<F>::run);                                                                     \
  }                                                                                                            \
  TORCH_LIBRARY_IMPL(resident, CPU, m) {                                                                       \
    m.impl("decode_layer_" suffix, &decode_layer<F>);                                                          \
    m.impl("rms_norm_" suffix, &rms_norm<F::Elem>);                                                            \
    m.impl("rotary_" suffix, &rotate<F::Elem>);                                                                \
    m.impl("lora_add_" suffix, &lora_add_op<F::Elem>);                                                         \
  }
