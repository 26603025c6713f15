// int8 and int4 weights times int8-quantized activations (RESIDENT_ACTIVATIONS=int8): the Q8Lines format of
// csrc/linear_q8.h, which says what is computed.
//
// resident::linear_q8(x [M, K] float32, packed [NB, K / 32, group bytes / 2] int16, bias [n] or None, n, group)
// -> [M, n] float32 (``group``: 32, the only one; taken for the signature the other formats share)
// resident::quantize_rows_q8(x [M, K] float32) -> int8 [M, K + 8 K / 32]: each row's q, then its groups'
// float32 scales, then their int32 sums of q (what linear_q8 multiplies; tests read it)
//
// tests/unit/model/cpu/test_q8_linear.py checks both against float64 references. Built at run time for
// AVX512-VNNI or AVX2 (the same bits on both).

#include <torch/library.h>

#include "linear_q8.h"

namespace {

at::Tensor quantize_rows_op(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % q8::kGroup == 0,
              "x: [M, K] float32, K a multiple of 32");
  at::Tensor out;
  q8::quantize_rows(x.contiguous(), out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(resident, m) {
  m.def("linear_q8(Tensor x, Tensor packed, Tensor? bias, int n, int group) -> Tensor");
  m.def("quantize_rows_q8(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(resident, CPU, m) {
  m.impl("linear_q8", &linear<Q8Lines>);
  m.impl("quantize_rows_q8", &quantize_rows_op);
}
