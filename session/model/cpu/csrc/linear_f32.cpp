// float32 linear layers on CPU with AVX-512: y = x W^T for a few rows, from weights packed once.
//
// resident::linear_f32(x [M, K] float32, packed [NB, K, 16] float32, bias [n] or None, n, k_block,
// several_from = -1, several_block = 0) -> [M, n]; rows from several_from on sum in blocks of several_block
// packed: W [n, K] in blocks of 16 outputs (NB = ceil(n / 16)), packed[b, k] = W[16b .. 16b+15, k]
// (zero past n): one 64-byte line per input, one output per float32 lane. See session/model/cpu/linear.py.
//
// The order of additions is oneDNN's on the weights session/model/cpu/packed_linear.py reorders for it (probed
// with inputs that cancel, so any other order shows: tests/unit/model/cpu/test_cpu_linear.py), so results are
// its bits:
// - each output is one float32 lane; a fused multiply-add adds each input's product into it, input
//   after input, in order;
// - the inputs run in blocks of k_block (512 for one row on this project's CPU: a block sums from
//   zero) and the block sums are added in order, then the bias.
// Work: csrc/linear_tiles.h's tiles, as linear_bf16's. Built at run time by session/model/cpu/linear.py
// (-mavx512f: a CPU without bfloat16 dot products runs it too).

#include <torch/library.h>

#include "linear_tiles.h"

TORCH_LIBRARY_FRAGMENT(resident, m) {
  m.def("linear_f32(Tensor x, Tensor packed, Tensor? bias, int n, int k_block, int several_from=-1, "
        "int several_block=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(resident, CPU, m) { m.impl("linear_f32", &linear_split<F32Lines>); }
