// int8 weight-only linear layers on CPU (RESIDENT_QUANTIZATION=int8 with float32 activations, and GGUF's
// Q8_0 kept packed): y = x W^T for float32 rows, from int8 weights packed once with their scales, one
// per output and group of G inputs (G = K: one scale per output).
//
// resident::linear_i8(x [M, K] float32, packed [NB, K + 4 K / G, 16] int8, bias [n] or None, n, G)
// -> [M, n] float32
// packed: per block of 16 outputs (NB = ceil(n / 16)), K lines of 16 int8 (packed[b, k] = q[16b ..
// 16b+15, k], zero past n), then per group 4 lines holding its 16 float32 scales (zero past n).
// session/model/cpu/linear.py packs them (pack_int8).
//
// Each output lane: per group, acc = fma(x_k, float(q_k), acc) input after input from zero, then acc *
// scale; the group parts added in order; then + bias. Per row and lane, so a row's outputs are those
// it gets alone, whatever the other rows and the thread count; tests/unit/model/cpu/test_int8_linear.py
// checks them against the float64 product of the dequantized weights. Work: csrc/linear_tiles.h's
// tiles (the Int8Lines format). Built at run time for AVX-512 or AVX2 (the same bits on both: csrc/simd.h).

#include <torch/library.h>

#include "linear_tiles.h"

TORCH_LIBRARY_FRAGMENT(resident, m) {
  m.def("linear_i8(Tensor x, Tensor packed, Tensor? bias, int n, int k_block) -> Tensor");
}

TORCH_LIBRARY_IMPL(resident, CPU, m) { m.impl("linear_i8", &linear<Int8Lines>); }
