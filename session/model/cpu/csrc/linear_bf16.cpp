// bfloat16 linear layers on CPU with AVX512-BF16: y = x W^T for a few rows, from weights packed once.
//
// resident::linear_bf16(x [M, K] bfloat16, packed [NB, KP, 32] bfloat16, bias [n] or None, n, k_block,
// several_from = -1, several_block = 0) -> [M, n]; rows from several_from on sum in blocks of several_block
// packed: W [n, K] in blocks of 16 outputs (NB = ceil(n / 16)) and pairs of inputs (KP = ceil(K / 2)),
// packed[b, p] = W[16b, 2p], W[16b, 2p+1], W[16b+1, 2p], ..., W[16b+15, 2p+1] (zero past n and K): the
// operand layout of VDPBF16PS, one output per float32 lane. See session/model/cpu/linear.py.
//
// The order of additions is oneDNN's (which torch's bfloat16 linear runs; probed with inputs that
// cancel, so any other order shows: tests/unit/model/cpu/test_cpu_linear.py), so results are its bits:
// - each output is one float32 lane; VDPBF16PS adds the pair (2p+1, 2p) of products into it, pair
//   after pair, in input order;
// - the inputs run in blocks of k_block (512 or 1024, where oneDNN's kernel blocks them: a block sums
//   from zero) and the block sums are added in order;
// - the float32 sum is rounded to bfloat16 with VCVTNEPS2BF16, as oneDNN's kernel stores it.
// Unlike oneDNN, whose block size changes with the number of rows (512 for one row, 1024 for more
// where K > 512, on this project's CPU), k_block is the caller's: a batch of decode rows computes
// exactly what each row alone would.
//
// Work: tiles of up to 6 rows x 4 blocks of 16 outputs (24 accumulators; csrc/linear_tiles.h), shared
// tile by tile on torch's OpenMP team (csrc/parallel.h); a tile's weight panel is read once per tile
// of rows, from cache after the first. Built at run time by session/model/cpu/linear.py (-mavx512bf16); used only where the CPU reports it.

#include <torch/library.h>

#include "linear_tiles.h"

TORCH_LIBRARY_FRAGMENT(resident, m) {
  m.def("linear_bf16(Tensor x, Tensor packed, Tensor? bias, int n, int k_block, int several_from=-1, "
        "int several_block=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(resident, CPU, m) { m.impl("linear_bf16", &linear_split<Bf16Pairs>); }
