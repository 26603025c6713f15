#!/usr/bin/env bash
# Build llama.cpp's CPU tools (llama-bench, llama-batched-bench, llama-quantize, llama-perplexity,
# llama-server) from the copy vendored in
# llama-cpp-python's sdist on PyPI (no other network), for benchmarks/vs_llama_cpp.py and
# benchmarks/quantization.py (--llama-cpp).
#
#   scripts/build_llama_cpp.sh [DEST]     DEST defaults to build/llama.cpp
#
# Environment: PYTHON (default .venv/bin/python, for pip download), LLAMA_CPP_PYTHON_VERSION
# (default 0.3.36), JOBS (default: the CPU count). Native build (-march=native: GGML_NATIVE), so it
# runs the instruction sets of the machine it is built on, as a user's own build would (AMX aside: below).
set -euo pipefail

dest=${1:-build/llama.cpp}
python=${PYTHON:-.venv/bin/python}
version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
jobs=${JOBS:-$(nproc)}

tools=(llama-bench llama-batched-bench llama-quantize llama-perplexity llama-server)
built=1
for tool in "${tools[@]}"; do [[ -x "$dest/bin/$tool" ]] || built=0; done
if [[ $built == 1 ]]; then
  echo "llama.cpp already built in $dest"
  exit 0
fi
scratch=$dest/src  # kept: a tool added here later builds on what is there
mkdir -p "$scratch"
source_dir="$scratch/llama_cpp_python-$version/vendor/llama.cpp"
if [[ ! -d $source_dir ]]; then
  "$python" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$scratch"
  tar -xzf "$scratch"/llama_cpp_python-"$version".tar.gz -C "$scratch"
fi
# AMX left out: on a Xeon with AMX (this sandbox's), its matrix products (any prompt of 32 tokens or
# more) died with SIGSEGV in ggml_backend_amx_mul_mat; decode never used them. Ours uses no AMX either.
no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
cmake -S "$source_dir" -B "$scratch/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DCMAKE_C_FLAGS="$no_amx" -DCMAKE_CXX_FLAGS="$no_amx" \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF >"$scratch/cmake.log" 2>&1
cmake --build "$scratch/build" --target "${tools[@]}" -j "$jobs" >"$scratch/build.log" 2>&1 || { tail -50 "$scratch/build.log"; exit 1; }
mkdir -p "$dest/bin"
for tool in "${tools[@]}"; do cp "$scratch/build/bin/$tool" "$dest/bin/"; done
cp "$source_dir/convert_hf_to_gguf.py" "$dest/"
cp -r "$source_dir/gguf-py" "$source_dir/conversion" "$dest/"  # what convert_hf_to_gguf.py imports
echo "llama.cpp $version (llama-cpp-python's vendored copy) built in $dest"
