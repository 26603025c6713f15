// int4 weight-only linear layers on CPU (RESIDENT_QUANTIZATION=int4 with float32 activations): y = x W^T
// for float32 rows, from 4-bit weights in groups of inputs, packed once with each group's scales and
// offsets.
//
// resident::linear_i4(x [M, K] float32, packed [NB, K + 16 K / G, 8] uint8, bias [n] or None, n, G)
// -> [M, n] float32
// packed: per block of 16 outputs (NB = ceil(n / 16)), K lines of 8 bytes (input k's 16 nibbles: byte
// j holds output j low, output j + 8 high; zero past n), then per group of G inputs 16 lines holding
// its 16 float32 scales and its 16 float32 offsets (zero past n). session/model/cpu/linear.py packs
// them (pack_int4).
//
// Each output lane: per group, acc = fma(x_k, q_k, acc) input after input from zero and the row's
// x_k summed in order, the group's part fma(acc, scale, sum(x) * offset); the group parts added in
// order; then + bias. Per row and lane, so a row's outputs are those it
// gets alone, whatever the other rows and the thread count; tests/unit/model/cpu/test_int4_linear.py
// checks them against the float64 product of the dequantized weights. Work: csrc/linear_tiles.h's
// tiles (the Int4Lines format). Built at run time for AVX-512 or AVX2 (the same bits on both).

#include <torch/library.h>

#include "linear_tiles.h"

TORCH_LIBRARY_FRAGMENT(resident, m) {
  m.def("linear_i4(Tensor x, Tensor packed, Tensor? bias, int n, int group) -> Tensor");
}

TORCH_LIBRARY_IMPL(resident, CPU, m) { m.impl("linear_i4", &linear<Int4Lines>); }
