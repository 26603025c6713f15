"""Images as a model family sees them: the pixels its tower takes and the placeholder tokens each becomes.

- LLaVA-1.5 ("llava"): every image is resized to one square, so each expands to the same count
  (the tower's patches, plus its CLS feature under the "full" strategy).
- LLaVA-NeXT ("llava_next"): anyres tiling, so the count and the number of tiles depend on the
  image's original size (``session/families/anyres.py``); the size travels with the pixels because the
  tower's output is unpadded by it.
- Qwen2-VL / Qwen2.5-VL: dynamic resolution, so the count is the image's patch grid (t, h, w) over
  merge**2 (``session/families/qwen_vl.py``); the grid travels with the pixels because the tower and the
  M-RoPE positions (``session/families/mrope.py``) are laid out by it.

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

from session.errors import InvalidImage
from session.families.anyres import AnyresGeometry, image_layout, max_num_image_tokens
from session.families.qwen_vl import QwenVLGeometry, image_token_count


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


class ImagePreprocessor:
    """PIL images -> ``Images`` for one checkpoint, with its own image processor (CPU work).
    The count per image: ``fixed_tokens`` (LLaVA-1.5), the anyres ``geometry`` (LLaVA-NeXT), or the
    Qwen-VL patch grid (``qwen_geometry``)."""

    def __init__(self, image_processor, *, fixed_tokens: int = 0, geometry: AnyresGeometry | None = None,
                 qwen_geometry: QwenVLGeometry | None = None):
        if [fixed_tokens > 0, geometry is not None, qwen_geometry is not None].count(True) != 1:
            raise ValueError("ImagePreprocessor: give one of fixed_tokens, an anyres geometry, a Qwen-VL geometry")
        self.image_processor = image_processor
        self.fixed_tokens = fixed_tokens
        self.geometry = geometry
        self.qwen_geometry = qwen_geometry
        if qwen_geometry is not None:
            self.max_tokens_per_image = qwen_geometry.max_pixels // (qwen_geometry.patch_size * qwen_geometry.merge_size) ** 2
        else:
            self.max_tokens_per_image = fixed_tokens or max_num_image_tokens(geometry)

    @classmethod
    def for_runner(cls, runner, image_processor) -> ImagePreprocessor:
        """The preprocessor of the runner's family (``family.image_tokens``: fixed, anyres or grid)."""
        scheme = runner.family.image_tokens
        if scheme == "grid":
            return cls(image_processor, qwen_geometry=QwenVLGeometry.from_image_processor(image_processor))
        if scheme == "fixed":
            return cls(image_processor, fixed_tokens=runner.info.num_image_tokens)
        return cls(image_processor, geometry=AnyresGeometry.from_hf_config(runner.hf_config))

    def num_tokens(self, height: int, width: int) -> int:
        """The placeholder tokens an image of (height, width) pixels expands to."""
        if self.qwen_geometry is not None:
            return image_token_count(height, width, self.qwen_geometry)
        return self.fixed_tokens or image_layout(height, width, self.geometry).num_image_tokens

    def preprocess(self, images: list) -> Images:
        if not images:
            return NO_IMAGES
        try:
            out = self.image_processor(images=images, return_tensors="pt")
        except ValueError as exc:  # the processor's own limits (Qwen-VL: aspect ratio under 200)
            raise InvalidImage(f"this model cannot take the image: {exc}") from None
        pixel_values = out["pixel_values"]
        sizes = tuple((image.height, image.width) for image in images)
        counts = tuple(self.num_tokens(h, w) for h, w in sizes)
        if self.qwen_geometry is not None:  # [sum of t*h*w, patch values]: each image's own patches, its grid
            grids = tuple(tuple(int(x) for x in g) for g in out["image_grid_thw"])
            pixels = torch.split(pixel_values, [t * h * w for t, h, w in grids])
            return Images(tuple(pixels), sizes, counts, grids)
        if self.geometry is not None:  # [N, max_tiles, 3, t, t], zero-padded: keep each image's own tiles
            tiles = [image_layout(h, w, self.geometry).num_tiles for h, w in sizes]
            return Images(tuple(p[:n] for p, n in zip(pixel_values, tiles)), sizes, counts)
        return Images(tuple(pixel_values), sizes, counts)
