// One decoder layer of a bfloat16 decode step on CPU, in one call: the same operators, in the same
// order, as ModelRunner's Python step (attention_inputs, the pool's write_rows, our attention kernel,
// finish_layer) and transformers' Llama-family modules (RMSNorm, rotary embedding, SiLU MLP), called
// from C++ instead of Python. Every product and element-wise operation is the same ATen kernel or our
// own operator, so the bits are the Python step's (tests/integration/test_bf16_decode.py); what goes
// is the interpreter and nn.Module overhead of ~300 small calls a step.
//
// resident::decode_layer_bf16(h [B, D], weights, biases, sizes, floats, cos [B, hd], sin [B, hd],
//                             k_layer, v_layer [KVH, NB, bt, hd], slots [B] int64, block_table [B, W]
//                             int32, starts [B] int32, ends [B] int32) -> h [B, D]
//   weights: input norm, post-attention norm, then q, k, v, o, gate, up, down packed for
//            resident::linear_bf16, then (Qwen3) the q and k norms
//   biases:  q, k, v, o, gate, up, down (None where absent)
//   sizes:   heads, kv heads, head dim, then the out features of the 7 linears, then their one-row
//            input block sizes, then 1 where the q and k norms exist
//   floats:  the two norms' epsilons, the q/k norms' epsilon, the attention scale
// Built at run time by session/fused_layer.py.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using LinearFn = at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, int64_t,
                            int64_t);
using AttentionFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, const at::Tensor&, double);

// transformers' LlamaRMSNorm.forward, operator for operator
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor h = x.to(at::kFloat);
  const at::Tensor variance = h.pow(2).mean(-1, /*keepdim=*/true);
  h = h * at::rsqrt(variance + eps);
  return weight * h.to(x.scalar_type());
}

// transformers' rotate_half and apply_rotary_pos_emb (x [B, heads, hd], cos/sin [B, 1, hd])
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  const at::Tensor rotated = at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
  return (x * cos) + (rotated * sin);
}

// The pool's write_rows for a head-major layer: row b's keys of every kv head into slot slots[b].
void write_rows(at::Tensor& layer, const at::Tensor& slots, const at::Tensor& rows) {
  const int64_t kv_heads = layer.size(0), per_head = layer.size(1) * layer.size(2), head_dim = layer.size(3);
  auto* base = layer.data_ptr<at::BFloat16>();
  const auto* src = rows.data_ptr<at::BFloat16>();  // [B, KVH, hd] contiguous
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < rows.size(0); ++b) {
    TORCH_CHECK(0 <= slot[b] && slot[b] < per_head, "slot out of the pool");
    for (int64_t h = 0; h < kv_heads; ++h) {
      std::memcpy(base + (h * per_head + slot[b]) * head_dim, src + (b * kv_heads + h) * head_dim,
                  head_dim * sizeof(at::BFloat16));
    }
  }
}

at::Tensor decode_layer_bf16(const at::Tensor& hidden, at::TensorList weights, c10::List<c10::optional<at::Tensor>> biases,
                             at::IntArrayRef sizes, at::ArrayRef<double> floats, const at::Tensor& cos,
                             const at::Tensor& sin, at::Tensor k_layer, at::Tensor v_layer, const at::Tensor& slots,
                             const at::Tensor& block_table, const at::Tensor& starts, const at::Tensor& ends) {
  static auto linear_op = c10::Dispatcher::singleton().findSchemaOrThrow("resident::linear_bf16", "").typed<LinearFn>();
  static auto attention_op =
      c10::Dispatcher::singleton().findSchemaOrThrow("resident::decode_attention_bf16", "").typed<AttentionFn>();
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kBFloat16, "h: [B, D] bfloat16");
  TORCH_CHECK(weights.size() == 9 || weights.size() == 11, "weights: 2 norms, 7 linears, (2 q/k norms)");
  TORCH_CHECK(biases.size() == 7 && sizes.size() == 18 && floats.size() == 4, "biases, sizes, floats: 7, 18, 4");
  TORCH_CHECK(k_layer.is_contiguous() && v_layer.is_contiguous() && slots.scalar_type() == at::kLong,
              "k/v layer contiguous, slots int64");
  const int64_t batch = hidden.size(0), heads = sizes[0], kv_heads = sizes[1], head_dim = sizes[2];
  const bool qk_norm = sizes[17] != 0;
  TORCH_CHECK(!qk_norm || weights.size() == 11, "q/k norms announced, not given");
  auto linear = [&](int i, const at::Tensor& x) {  // i: 0..6 = q, k, v, o, gate, up, down
    return linear_op.call(x, weights[2 + i], biases.get(i), sizes[3 + i], sizes[10 + i]);
  };
  const at::Tensor c = cos.unsqueeze(1), s = sin.unsqueeze(1);  // [B, 1, hd]

  const at::Tensor x = rms_norm(hidden, weights[0], floats[0]);
  at::Tensor q = linear(0, x).view({batch, heads, head_dim});
  at::Tensor k = linear(1, x).view({batch, kv_heads, head_dim});
  const at::Tensor v = linear(2, x).view({batch, kv_heads, head_dim});
  if (qk_norm) {
    q = rms_norm(q, weights[9], floats[2]);
    k = rms_norm(k, weights[10], floats[2]);
  }
  q = rotate(q, c, s);
  k = rotate(k, c, s).contiguous();
  write_rows(k_layer, slots, k);
  write_rows(v_layer, slots, v.contiguous());
  const at::Tensor o = attention_op.call(q.contiguous(), k_layer, v_layer, block_table, starts, ends, floats[3]);
  at::Tensor h = hidden + linear(3, o.view({batch, heads * head_dim}));
  const at::Tensor y = rms_norm(h, weights[1], floats[1]);
  return h + linear(6, at::silu(linear(4, y)) * linear(5, y));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(resident, m) {
  m.def("decode_layer_bf16(Tensor h, Tensor[] weights, Tensor?[] biases, int[] sizes, float[] floats, Tensor cos, "
        "Tensor sin, Tensor(a!) k_layer, Tensor(b!) v_layer, Tensor slots, Tensor block_table, Tensor starts, "
        "Tensor ends) -> Tensor");
}

TORCH_LIBRARY_IMPL(resident, CPU, m) { m.impl("decode_layer_bf16", &decode_layer_bf16); }
