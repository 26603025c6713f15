"""Images as a model family sees them: the pixels its tower takes and the placeholder tokens each becomes.

- LLaVA-1.5 ("llava"): every image is resized to one square, so each expands to the same count
  (the tower's patches, plus its CLS feature under the "full" strategy).
- LLaVA-NeXT ("llava_next"): anyres tiling, so the count and the number of tiles depend on the
  image's original size (``session/families/anyres.py``); the size travels with the pixels because the
  tower's output is unpadded by it.
- Qwen2-VL / Qwen2.5-VL: dynamic resolution, so the count is the image's patch grid (t, h, w) over
  merge**2 (``session/families/qwen_vl.py``); the grid travels with the pixels because the tower and the
  M-RoPE positions (``session/families/mrope.py``) are laid out by it.

Bounded work: before the processor runs, ``ImagePreprocessor.check_size`` refuses (413) an image whose
preprocessing would make a larger image than ``max_pixels`` (a CLIP-style shortest-edge resize turns a
30000x1 image into 336 x 10,080,000 pixels) or that Qwen-VL's resize refuses (aspect ratio over 200).
It needs only the size, so a decoder can call it from the image header (image_decode.decode_bytes).

``Images`` carries, per image, its pixels, its original size and its token count; everything
downstream (the chat formatter's expansion, the KV reservation, the embedding cache, the journal
recompute) reads the per-image count from here instead of assuming one number per model.

Who calls this: the API's executor threads (``ImagePreprocessor.preprocess``: CPU work, no model),
the executor (counts for the formatter, content keys), ``Sessions`` (pixels for the encoder).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from session.config import EngineConfig
from session.errors import InvalidImage, PayloadTooLarge
from session.families.anyres import AnyresGeometry, image_layout, max_num_image_tokens, resized_pixels
from session.families.qwen_vl import MAX_ASPECT_RATIO, QwenVLGeometry, image_token_count, resized_size


@dataclass(frozen=True)
class Images:
    """A request's images, in prompt order."""

    pixels: tuple[torch.Tensor, ...]  # per image: [3, H, W] (llava) or [tiles, 3, tile, tile] (llava_next)
    sizes: tuple[tuple[int, int], ...]  # (height, width) of each original image
    num_tokens: tuple[int, ...]  # placeholder tokens each image expands to
    grids: tuple[tuple[int, int, int], ...] = ()  # Qwen-VL: each image's (t, h, w) in patches; else empty

    def __post_init__(self):
        if not len(self.pixels) == len(self.sizes) == len(self.num_tokens) or len(self.grids) not in (0, len(self)):
            raise ValueError("Images: pixels, sizes, num_tokens (and grids, if any) need one entry per image")

    def __len__(self) -> int:
        return len(self.pixels)

    def select(self, index: int) -> Images:
        """The one image at ``index``."""
        return Images((self.pixels[index],), (self.sizes[index],), (self.num_tokens[index],),
                      self.grids[index:index + 1])

    @staticmethod
    def join(parts) -> Images:
        """Several ``Images`` as one, in order."""
        parts = list(parts)
        return Images(*(tuple(x for p in parts for x in getattr(p, name)) for name in
                        ("pixels", "sizes", "num_tokens", "grids")))

    def digests(self) -> list[str]:
        """Content keys for images given only as pixels (tests, benchmarks): the pixel bytes and the
        original size (anyres unpads by the size, so equal pixels of different sizes differ)."""
        keys = []
        for pixels, (height, width) in zip(self.pixels, self.sizes):
            digest = hashlib.sha256(pixels.detach().cpu().contiguous().numpy().tobytes())
            digest.update(f"{height}x{width}".encode())
            keys.append("px-" + digest.hexdigest())
        return keys


NO_IMAGES = Images((), (), ())


def resize_output_size(height: int, width: int, size) -> tuple[int, int]:
    """(height, width) an image of (height, width) pixels is resized to by a processor whose ``size`` is
    given, before any centre crop: as transformers' PilBackend.resize (transformers 5.25).

    ``shortest_edge`` alone is torchvision's Resize(int): the shorter side becomes it and the longer one
    grows in proportion, unbounded (LLaVA-1.5's CLIP processor: 30000x1 at 336 is 336 x 10,080,000).
    ``height`` and ``width``: that size. A ``longest_edge`` or ``max_height``/``max_width`` caps the
    result: that cap is returned (an upper bound, all a budget needs)."""
    shortest, longest = size.get("shortest_edge"), size.get("longest_edge")
    if shortest and longest:
        return longest, longest
    if shortest:
        new_long = int(shortest * max(height, width) / min(height, width))
        return (new_long, shortest) if width <= height else (shortest, new_long)
    if size.get("max_height") and size.get("max_width"):
        return size["max_height"], size["max_width"]
    return size["height"], size["width"]


class ImagePreprocessor:
    """PIL images -> ``Images`` for one checkpoint, with its own image processor (CPU work).
    The count per image: ``fixed_tokens`` (LLaVA-1.5), the anyres ``geometry`` (LLaVA-NeXT), or the
    Qwen-VL patch grid (``qwen_geometry``). ``max_pixels`` bounds every image the processor makes on
    the way (its resize): an image that would exceed it is refused before the processor runs."""

    def __init__(self, image_processor, *, fixed_tokens: int = 0, geometry: AnyresGeometry | None = None,
                 qwen_geometry: QwenVLGeometry | None = None, max_pixels: int = EngineConfig.max_image_pixels):
        if [fixed_tokens > 0, geometry is not None, qwen_geometry is not None].count(True) != 1:
            raise ValueError("ImagePreprocessor: give one of fixed_tokens, an anyres geometry, a Qwen-VL geometry")
        self.image_processor = image_processor
        self.fixed_tokens = fixed_tokens
        self.geometry = geometry
        self.qwen_geometry = qwen_geometry
        self.max_pixels = max_pixels
        if qwen_geometry is not None:
            self.max_tokens_per_image = qwen_geometry.max_pixels // (qwen_geometry.patch_size * qwen_geometry.merge_size) ** 2
        elif geometry is not None:
            self.max_tokens_per_image = max_num_image_tokens(geometry)
        else:
            self.max_tokens_per_image = fixed_tokens

    @classmethod
    def for_runner(cls, runner, image_processor, max_pixels: int = EngineConfig.max_image_pixels) -> ImagePreprocessor:
        """The preprocessor of the runner's family (``family.image_tokens``: fixed, anyres or grid)."""
        scheme = runner.family.image_tokens
        if scheme == "grid":
            return cls(image_processor, qwen_geometry=QwenVLGeometry.from_image_processor(image_processor),
                       max_pixels=max_pixels)
        if scheme == "fixed":
            return cls(image_processor, fixed_tokens=runner.info.num_image_tokens, max_pixels=max_pixels)
        return cls(image_processor, geometry=AnyresGeometry.from_hf_config(runner.hf_config), max_pixels=max_pixels)

    def check_size(self, height: int, width: int) -> None:
        """Raise PayloadTooLarge (413, naming the bound) for an image of (height, width) pixels that this
        family's preprocessing would blow up past ``max_pixels``, or that Qwen-VL's resize refuses.
        Who calls this: ``preprocess``, for every image before the processor runs; a decoder, from the
        image header before any pixel is decoded (image_decode.decode_bytes's ``check_size``)."""
        if self.qwen_geometry is not None and max(height, width) > MAX_ASPECT_RATIO * min(height, width):
            raise PayloadTooLarge(f"image is {width}x{height} pixels, an aspect ratio over {MAX_ASPECT_RATIO}:1, "
                                  f"the most this model's image processor takes")
        made = self._resized_pixels(height, width)
        if made > self.max_pixels:
            raise PayloadTooLarge(f"image is {width}x{height} pixels; this model's image processor would resize it "
                                  f"to {made} pixels, over the limit of {self.max_pixels} pixels (its aspect "
                                  "ratio is too extreme)")

    def _resized_pixels(self, height: int, width: int) -> int:
        """The pixels of the largest image the processor makes from one of (height, width)."""
        if self.qwen_geometry is not None:
            resized_height, resized_width = resized_size(height, width, self.qwen_geometry)
            return resized_height * resized_width
        if self.geometry is not None:
            return resized_pixels(height, width, self.geometry)
        if not getattr(self.image_processor, "do_resize", True):
            return height * width
        resized_height, resized_width = resize_output_size(height, width, self.image_processor.size)
        return resized_height * resized_width

    def num_tokens(self, height: int, width: int) -> int:
        """The placeholder tokens an image of (height, width) pixels expands to."""
        if self.qwen_geometry is not None:
            return image_token_count(height, width, self.qwen_geometry)
        if self.geometry is not None:
            return image_layout(height, width, self.geometry).num_image_tokens
        return self.fixed_tokens

    def preprocess(self, images: list) -> Images:
        if not images:
            return NO_IMAGES
        for image in images:
            self.check_size(image.height, image.width)
        try:
            out = self.image_processor(images=images, return_tensors="pt")
        except ValueError as exc:  # the processor's own limits (Qwen-VL: aspect ratio under 200)
            raise InvalidImage(f"this model cannot take the image: {exc}") from None
        pixel_values = out["pixel_values"]
        sizes = tuple((image.height, image.width) for image in images)
        counts = tuple(self.num_tokens(h, w) for h, w in sizes)
        if self.qwen_geometry is not None:  # [sum of t*h*w, patch values]: each image's own patches, its grid
            grids = tuple((int(t), int(h), int(w)) for t, h, w in out["image_grid_thw"])
            pixels = torch.split(pixel_values, [t * h * w for t, h, w in grids])
            return Images(tuple(pixels), sizes, counts, grids)
        if self.geometry is not None:  # [N, max_tiles, 3, t, t], zero-padded: keep each image's own tiles
            tiles = [image_layout(h, w, self.geometry).num_tiles for h, w in sizes]
            return Images(tuple(p[:n] for p, n in zip(pixel_values, tiles)), sizes, counts)
        return Images(tuple(pixel_values), sizes, counts)
