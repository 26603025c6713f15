"""compressed-tensors checkpoints, as llm-compressor writes them, made offline from a float one.

A W4A16 or W8A16 checkpoint from the hub (``"quant_method": "compressed-tensors"``) is made by
llm-compressor: it attaches a quantization scheme to every ``Linear`` but the head, sets each
module's scale (and zero point) with its min-max observer, and saves through compressed-tensors'
``ModelCompressor``. llm-compressor is not needed for that last part: here the scheme is attached
and compressed with compressed-tensors itself (``apply_quantization_config``, ``ModelCompressor``),
the scales from the library's ``calculate_qparams`` over each group's min and max (the observer's
arithmetic), so the folder is the format those checkpoints have: config.json's
``quantization_config``, ``weight_packed`` / ``weight`` integers, ``weight_scale``, ``weight_zero_point``
where asymmetric, ``weight_shape``. No calibration data: round to nearest, as llm-compressor's
``QuantizationModifier`` does (GPTQ's error correction would change which integers, not the format).

Schemes (``SCHEMES``): ``w4a16`` (4-bit, symmetric, groups of 64: SmolLM2's widths are not multiples
of 128, llm-compressor's preset), ``w4a16-asym`` (4-bit, groups of 32, zero points), ``w8a16`` (8-bit
per output channel, symmetric), ``w4a16-channel`` (4-bit per output channel). ``w4a16-asym`` saves,
but transformers 5 with compressed-tensors 0.20 cannot load it (its empty model expects the zero
points unpacked, [out, groups], the file holds them packed along the outputs): tests compress it in
memory (``compress``), as a loaded model holds it.

Idempotent: a finished build has ``resident_build.json``, written last into a temporary folder.

Who calls this: tests (tests/integration/test_compressed_tensors.py, tests/unit/model/test_compressed.py)
and ``benchmarks/perplexity_vs_llama_cpp.py``.

``build_awq`` writes an AutoAWQ checkpoint (GEMM layout: ``qweight`` [in, out / 8] and ``qzeros``
[groups, out / 8] in int32 with AutoAWQ's nibble order, ``scales`` [groups, out] in float16; w = (q - zero)
scale, q and zero in 0..15), rounded to nearest per group with min-max zero points, for the AutoAWQ path
(session/model/compressed.py converts it with compressed-tensors' AutoAWQConverter); AutoAWQ itself is
deprecated and not installed.

Run: python -m model_store.build_compressed [--scheme w4a16|awq] [--source models/smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

MARKER = "resident_build.json"
SCHEMES = {  # name -> (bits, symmetric, group size or 0 for per channel)
    "w4a16": (4, True, 64),
    "w4a16-asym": (4, False, 32),
    "w8a16": (8, True, 0),
    "w4a16-channel": (4, True, 0),
    "w8a16-asym": (8, False, 0),  # zero points on int8: decompressed to float by the engine (no kernel takes them)
}


def quantization_config(scheme: str):
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
    )

    bits, symmetric, group = SCHEMES[scheme]
    weights = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric,
                               strategy="group" if group else "channel", group_size=group or None)
    return QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
                              ignore=["lm_head"], format="pack-quantized" if bits == 4 else "int-quantized",
                              quantization_status=QuantizationStatus.INITIALIZED)


def observe(model) -> int:
    """Each quantized module's scale (and zero point) from its weights' min and max per group or row,
    the range widened to hold 0 (llm-compressor's min-max observer); how many modules."""
    from compressed_tensors.quantization.utils import calculate_qparams

    count = 0
    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None or not hasattr(module, "weight_scale"):
            continue
        weight = module.weight.data.float()
        out_features, in_features = weight.shape
        group = scheme.weights.group_size or in_features
        grouped = weight.view(out_features, in_features // group, group)
        low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
        scale, zero = calculate_qparams(torch.minimum(low, torch.zeros_like(low)),
                                        torch.maximum(high, torch.zeros_like(high)), scheme.weights)
        module.weight_scale.data = scale.reshape(module.weight_scale.shape).to(module.weight_scale.dtype)
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data = zero.reshape(module.weight_zero_point.shape).to(
                module.weight_zero_point.dtype)
        count += 1
    return count


def staging(target: Path) -> Path:
    """A fresh temporary folder beside ``target``, renamed to it when whole (what an interrupted build
    left, there or in ``target`` without its marker, is removed first)."""
    tmp = target.with_name(target.name + ".tmp")
    for stale in (tmp, target):
        shutil.rmtree(stale, ignore_errors=True)
    return tmp


def compress(model, scheme: str):
    """``model``'s linears but the head quantized in ``scheme`` and compressed, in place, as a loaded
    compressed-tensors checkpoint holds them; (the compressor, how many modules)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import apply_quantization_config

    config = quantization_config(scheme)
    apply_quantization_config(model, config)
    modules = observe(model)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=config.format)
    compressor.compress_model(model)
    return compressor, modules


def build(source: Path, scheme: str, out: Path | None = None) -> Path:
    """``source`` (a float checkpoint folder) in ``scheme``, in ``out`` (by default ``<source>-<scheme>``
    beside it) unless built already; returns the folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = out or source.with_name(f"{source.name}-{scheme}")
    if (target / MARKER).exists():
        return target
    tmp = staging(target)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    compressor, modules = compress(model, scheme)
    model.save_pretrained(tmp)
    compressor.update_config(str(tmp))
    AutoTokenizer.from_pretrained(source).save_pretrained(tmp)
    (tmp / MARKER).write_text(json.dumps({"source": str(source), "scheme": scheme, "modules": modules}, indent=2))
    tmp.rename(target)
    return target


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output column each of an int32's 8 nibbles holds, low nibble first


def awq_pack(values: torch.Tensor) -> torch.Tensor:
    """[rows, cols] in 0..15 -> int32 [rows, cols / 8], AutoAWQ's GEMM packing (AWQ_ORDER)."""
    rows, cols = values.shape
    grouped = values.long().view(rows, cols // 8, 8)[..., list(AWQ_ORDER)]
    packed = sum(grouped[..., i] << (4 * i) for i in range(8))
    return (packed - (packed >= 2 ** 31).long() * 2 ** 32).to(torch.int32)  # the bit pattern, as int32


def awq_quantize(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [out, in] -> q [in, out] and zeros [in / group, out] in 0..15, scales [in / group, out] float16."""
    out_features, in_features = weight.shape
    grouped = weight.float().view(out_features, in_features // group, group)
    low, high = grouped.amin(dim=-1).clamp(max=0), grouped.amax(dim=-1).clamp(min=0)
    scales = ((high - low) / 15).clamp(min=2 ** -14).half()  # float16's smallest normal: never 0
    zeros = (-low / scales.float()).round().clamp(0, 15)
    q = (grouped / scales.float()[..., None] + zeros[..., None]).round().clamp(0, 15)
    return q.view(out_features, in_features).T.contiguous(), zeros.T.contiguous(), scales.T.contiguous()


def awq_weights(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float64 weights [out, in] an AutoAWQ linear stands for: (q - zero) scale per group."""
    group = q.shape[0] // scales.shape[0]
    zeros, scales = (t.double().repeat_interleave(group, dim=0) for t in (zeros, scales))  # per input
    return ((q.double() - zeros) * scales).T.contiguous()


def build_awq(source: Path, out: Path, group: int = 32) -> Path:
    """``source`` (a float checkpoint folder) as an AutoAWQ GEMM checkpoint in ``out`` (every decoder
    linear, the head left float, as AutoAWQ does) unless built already; returns the folder."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (out / MARKER).exists():
        return out
    tmp = staging(out)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    tensors, modules = {}, 0
    for name, tensor in model.state_dict().items():
        module = name.removesuffix(".weight")
        if ".layers." in name and name.endswith(".weight") and tensor.dim() == 2 and "embed" not in name:
            q, zeros, scales = awq_quantize(tensor, group)
            tensors |= {f"{module}.qweight": awq_pack(q), f"{module}.qzeros": awq_pack(zeros),
                        f"{module}.scales": scales}
            modules += 1
        else:
            tensors[name] = tensor.contiguous()
    model.config.quantization_config = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                        "version": "gemm", "modules_to_not_convert": None}
    tmp.mkdir(parents=True)
    model.config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    AutoTokenizer.from_pretrained(source).save_pretrained(tmp)
    (tmp / MARKER).write_text(json.dumps({"source": str(source), "scheme": f"awq-g{group}", "modules": modules},
                                         indent=2))
    tmp.rename(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=Path("models") / "smollm2-135m-instruct")
    parser.add_argument("--scheme", choices=sorted(SCHEMES) + ["awq"], default="w4a16")
    args = parser.parse_args(argv)
    if not (args.source / "config.json").exists() and args.source.name == "smollm2-135m-instruct":
        from model_store.build_smollm2 import build as build_smollm2

        build_smollm2(args.source.parent)
    if args.scheme == "awq":
        print(f"{build_awq(args.source, args.source.with_name(args.source.name + '-awq'))} ready")
    else:
        print(f"{build(args.source, args.scheme)} ready")
    return 0


if __name__ == "__main__":
    sys.exit(main())
