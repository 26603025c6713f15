"""Qwen2-VL and Qwen2.5-VL: image geometry, the processor without torchvision, and a runner.

- **Geometry.** The processor resizes each image to multiples of ``patch * merge`` pixels with
  ``min_pixels <= h*w <= max_pixels`` (transformers' ``smart_resize``), so an image's token count,
  ``t*h*w / merge**2`` with t = 1, depends on its size: ``image_grid`` gives (t, h, w) without pixels.
- **Processor.** ``AutoProcessor`` insists on building the video processor, which needs torchvision
  (not installable beside the CPU torch); ``load_processor`` builds the checkpoint's processor class
  with its PIL image processor (``Qwen2VLImageProcessorPil``: the pixels transformers produces
  without torchvision) and no video processor. Images only.
- **Runner.** ``QwenVLRunner`` is a ``ModelRunner`` over the Qwen-VL checkpoint classes: the vision
  tower's own ``get_image_features`` (Qwen2.5-VL's windowed tower included), and prefill/decode
  with 3-D positions (session/mrope.py) on our KV cache. The text attention of both families is
  Qwen2's (biased q/k/v, no q/k norm); the checkpoint's own ``rotary_emb`` already folds the three
  position rows into one cos/sin by ``mrope_section``, so the rotation is llama's
  ``apply_rotary_pos_emb`` unchanged; only the positions differ from a text model.

Who calls this: tests today; the engine once qwen2_vl / qwen2_5_vl are served (docs/QWEN_VL.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import Qwen2_5_VLProcessor, Qwen2VLProcessor

from session.kv_cache import KVCache
from session.model_runner import ModelInfo, ModelRunner, attention_windows, resolve_device, resolve_dtype
from session.mrope import num_image_tokens
from session.support import UnsupportedModel

QWEN_VL_TYPES = ("qwen2_vl", "qwen2_5_vl")


@dataclass(frozen=True)
class QwenVLGeometry:
    patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int

    @classmethod
    def from_image_processor(cls, image_processor) -> "QwenVLGeometry":
        size = image_processor.size  # {"shortest_edge": min_pixels, "longest_edge": max_pixels}
        return cls(image_processor.patch_size, image_processor.merge_size, size["shortest_edge"],
                   size["longest_edge"])


def image_grid(height: int, width: int, geometry: QwenVLGeometry) -> tuple[int, int, int]:
    """(t, h, w) in patches of an image of ``height`` x ``width`` pixels, as the processor's image_grid_thw."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    resized_h, resized_w = smart_resize(height, width, factor=geometry.patch_size * geometry.merge_size,
                                        min_pixels=geometry.min_pixels, max_pixels=geometry.max_pixels)
    return 1, resized_h // geometry.patch_size, resized_w // geometry.patch_size


def image_token_count(height: int, width: int, geometry: QwenVLGeometry) -> int:
    """``<|image_pad|>`` tokens one image of that size expands to."""
    return num_image_tokens(image_grid(height, width, geometry), geometry.merge_size)


def expand_image_placeholders(token_ids: list[int], image_token_id: int, counts: list[int]) -> list[int]:
    """Ids with one ``<|image_pad|>`` per image (what the chat template renders) -> the i-th image's
    placeholder repeated ``counts[i]`` times, as the processor's ``replace_image_token`` expands them."""
    if token_ids.count(image_token_id) != len(counts):
        raise ValueError(f"{token_ids.count(image_token_id)} image placeholders for {len(counts)} counts")
    expanded, images = [], iter(counts)
    for token in token_ids:
        expanded.extend([token] * next(images) if token == image_token_id else [token])
    return expanded


def _image_only(processor_class):
    class ImageOnlyProcessor(processor_class):
        """The checkpoint's processor with no video processor: ``ProcessorMixin`` takes its
        sub-processors from ``__init__``'s parameters, so leaving ``video_processor`` out of them
        drops it (and its torchvision import); images and text go through the parent unchanged."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    ImageOnlyProcessor.__name__ = ImageOnlyProcessor.__qualname__ = f"{processor_class.__name__}ImagesOnly"
    return ImageOnlyProcessor


PROCESSORS = {"qwen2_vl": _image_only(Qwen2VLProcessor), "qwen2_5_vl": _image_only(Qwen2_5_VLProcessor)}


def build_processor(model_type: str, image_processor, tokenizer):
    return PROCESSORS[model_type](image_processor=image_processor, tokenizer=tokenizer,
                                  chat_template=tokenizer.chat_template)


def load_processor(model_path: str):
    """The checkpoint's processor (images and text), loaded without torchvision: the tokenizer and the
    chat template as ``AutoProcessor`` finds them, the image processor as the PIL class by name."""
    from transformers import AutoConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    model_type = AutoConfig.from_pretrained(model_path).model_type
    return PROCESSORS[model_type].from_pretrained(
        model_path, image_processor=Qwen2VLImageProcessorPil.from_pretrained(model_path))


class QwenVLRunner(ModelRunner):
    """A ``ModelRunner`` for qwen2_vl / qwen2_5_vl checkpoints. Differences a caller sees:
    ``encode_images`` takes ``image_grid_thw`` and returns one tensor per image of its own length;
    ``prefill`` takes the segment's 3-D ``positions`` (``mrope.segment_positions``); ``decode`` takes
    each session's ``rope_deltas``. Everything else (KV layout, embed, LoRA hooks) is the parent's."""

    def __init__(self, model_path: str, device: str = "auto", dtype: str = "auto"):
        from transformers import AutoConfig

        self.model_path = model_path
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        hf_config = AutoConfig.from_pretrained(model_path)
        if hf_config.model_type not in QWEN_VL_TYPES:
            raise UnsupportedModel(f"QwenVLRunner serves {QWEN_VL_TYPES}, not {hf_config.model_type!r}")
        self.is_multimodal = True
        self.model = self._load(model_path, hf_config)
        self.lm = self.model.model.language_model
        self.lm_head = self.model.lm_head
        self.layers = list(self.lm.layers)
        self.windows = attention_windows(hf_config.text_config, len(self.layers))
        self.merge_size = hf_config.vision_config.spatial_merge_size
        self.info = self._info(hf_config, hf_config.text_config)
        self.lora = None

    def _load(self, path: str, hf_config):
        from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

        cls = Qwen2VLForConditionalGeneration if hf_config.model_type == "qwen2_vl" else \
            Qwen2_5_VLForConditionalGeneration
        model = cls.from_pretrained(path, dtype=self.dtype)
        return model.to(self.device).eval().requires_grad_(False)

    def _info(self, hf_config, text_config) -> ModelInfo:
        gen_eos = getattr(self.model.generation_config, "eos_token_id", None)
        eos_ids = {e for e in (text_config.eos_token_id, gen_eos) for e in (e if isinstance(e, list) else [e])
                   if e is not None}
        return ModelInfo(
            num_layers=len(self.layers), num_heads=text_config.num_attention_heads,
            num_kv_heads=text_config.num_key_value_heads, head_dim=self.layers[0].self_attn.head_dim,
            hidden_size=text_config.hidden_size, vocab_size=text_config.vocab_size,
            max_positions=text_config.max_position_embeddings, eos_token_ids=tuple(sorted(eos_ids)),
            image_token_id=hf_config.image_token_id,
            num_image_tokens=0,  # varies per image: image_token_count / mrope.num_image_tokens
        )

    # ------------------------------------------------------------------ vision

    @torch.inference_mode()
    def encode_images(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """pixel_values [sum of t*h*w, C*tp*p*p] and image_grid_thw [N, 3], as the processor returns them,
        -> N tensors of [t*h*w / merge**2, hidden]. The tower's attention stays inside each image
        (``cu_seqlens``), so an image encoded alone gets the features it gets in a batch, up to float
        rounding (matmuls of other shapes: 6e-8 measured), which is what caching them per image needs."""
        out = self.model.model.get_image_features(pixel_values.to(self.device, self.dtype),
                                                  image_grid_thw.to(self.device))
        return [f.contiguous() for f in out.pooler_output]

    # ------------------------------------------------------------------ text

    @torch.inference_mode()
    def prefill(self, kv: KVCache, embeds: torch.Tensor, positions: torch.Tensor, all_logits: bool = False,
                adapter_slot: int = 0) -> torch.Tensor:
        """``ModelRunner.prefill`` with the segment's M-RoPE ``positions`` [3, T] instead of
        ``arange(kv.length, kv.length + T)``; masks and KV slots still follow token indices."""
        start, num_new = kv.length, embeds.shape[0]
        end = start + num_new
        kv.ensure_capacity(end)
        self.set_adapters([adapter_slot])
        h = embeds[None]  # [1, T, D]
        cos, sin = self.lm.rotary_emb(h, positions.to(self.device)[:, None])  # [3, 1, T] -> [1, T, hd]
        causal = torch.ones(num_new, end, dtype=torch.bool, device=self.device).tril(diagonal=start)
        masks = {w: causal if w is None else causal.triu(diagonal=start - w + 1) for w in set(self.windows)}
        for index, layer in enumerate(self.layers):
            q, k, v = self.attention_inputs(layer, h, cos, sin)
            kv.write(index, start, k[0], v[0])
            o = F.scaled_dot_product_attention(
                q, kv.keys(index, end)[None], kv.values(index, end)[None], attn_mask=masks[self.windows[index]],
                scale=layer.self_attn.scaling, enable_gqa=self.info.num_heads != self.info.num_kv_heads,
            )
            h = self.finish_layer(layer, h, o)
        kv.length = end
        return self._logits(h)[0] if all_logits else self._logits(h[:, -1:])[0, 0]

    @torch.inference_mode()
    def decode(self, kvs: list[KVCache], token_ids: list[int], rope_deltas: list[int],
               adapter_slots: list[int] | None = None) -> torch.Tensor:
        """``ModelRunner.decode`` with each session's token at position ``kv.length + rope_delta`` in all
        three rows (a generated token is text). Returns logits [B, V]."""
        lengths = [kv.length for kv in kvs]
        for kv, length in zip(kvs, lengths):
            kv.ensure_capacity(length + 1)
        self.set_adapters(adapter_slots)
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        h = self.lm.embed_tokens(ids)[:, None]  # [B, 1, D]
        positions = torch.tensor([n + d for n, d in zip(lengths, rope_deltas)], device=self.device)[:, None]
        cos, sin = self.lm.rotary_emb(h, positions)  # [B, 1] expands to [3, B, 1]
        gqa = self.info.num_heads != self.info.num_kv_heads
        for index, layer in enumerate(self.layers):
            q, k, v = self.attention_inputs(layer, h, cos, sin)  # q: [B, H, 1, hd]
            window, rows = self.windows[index], []
            for b, (kv, length) in enumerate(zip(kvs, lengths)):
                kv.write(index, length, k[b], v[b])
                first = 0 if window is None else max(0, length + 1 - window)
                rows.append(F.scaled_dot_product_attention(
                    q[b: b + 1], kv.keys(index, length + 1)[None, :, first:],
                    kv.values(index, length + 1)[None, :, first:], scale=layer.self_attn.scaling, enable_gqa=gqa,
                ))
            h = self.finish_layer(layer, h, torch.cat(rows) if len(rows) > 1 else rows[0])
        for kv, length in zip(kvs, lengths):
            kv.length = length + 1
        return self._logits(h)[:, 0]
