"""Images as a model family sees them: the pixels its tower takes and the placeholder tokens each becomes.

- LLaVA-1.5 ("llava"): every image is resized to one square, so each expands to the same count
  (the tower's patches, plus its CLS feature under the "full" strategy).
- LLaVA-NeXT ("llava_next"): anyres tiling, so the count and the number of tiles depend on the
  image's original size (``session/anyres.py``); the size travels with the pixels because the
  tower's output is unpadded by it.

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

from session.anyres import AnyresGeometry, image_layout, max_num_image_tokens


@dataclass(frozen=True)
class Images:
    """A request's images, in prompt order."""

    pixels: tuple[torch.Tensor, ...]  # per image: [3, H, W] (llava) or [tiles, 3, tile, tile] (llava_next)
    sizes: tuple[tuple[int, int], ...]  # (height, width) of each original image
    num_tokens: tuple[int, ...]  # placeholder tokens each image expands to

    def __post_init__(self):
        if not len(self.pixels) == len(self.sizes) == len(self.num_tokens):
            raise ValueError("Images: pixels, sizes and num_tokens must have one entry per image")

    def __len__(self) -> int:
        return len(self.pixels)

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
    Either every image has ``fixed_tokens`` (LLaVA-1.5) or the count follows the anyres ``geometry``."""

    def __init__(self, image_processor, *, fixed_tokens: int = 0, geometry: AnyresGeometry | None = None):
        if (fixed_tokens > 0) == (geometry is not None):
            raise ValueError("ImagePreprocessor: give fixed_tokens or an anyres geometry, not both")
        self.image_processor = image_processor
        self.fixed_tokens = fixed_tokens
        self.geometry = geometry
        self.max_tokens_per_image = fixed_tokens or max_num_image_tokens(geometry)

    @classmethod
    def for_runner(cls, runner, image_processor) -> "ImagePreprocessor":
        if runner.info.num_image_tokens:
            return cls(image_processor, fixed_tokens=runner.info.num_image_tokens)
        return cls(image_processor, geometry=AnyresGeometry.from_hf_config(runner.hf_config))

    def num_tokens(self, height: int, width: int) -> int:
        """The placeholder tokens an image of (height, width) pixels expands to."""
        return self.fixed_tokens or image_layout(height, width, self.geometry).num_image_tokens

    def preprocess(self, images: list) -> Images:
        if not images:
            return NO_IMAGES
        pixel_values = self.image_processor(images=images, return_tensors="pt")["pixel_values"]
        sizes = tuple((image.height, image.width) for image in images)
        counts = tuple(self.num_tokens(h, w) for h, w in sizes)
        if self.geometry is not None:  # [N, max_tiles, 3, t, t], zero-padded: keep each image's own tiles
            tiles = [image_layout(h, w, self.geometry).num_tiles for h, w in sizes]
            return Images(tuple(p[:n] for p, n in zip(pixel_values, tiles)), sizes, counts)
        return Images(tuple(pixel_values), sizes, counts)
