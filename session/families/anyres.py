"""LLaVA-NeXT's "anyres" image geometry: how many tokens one ``<image>`` becomes, from the image size alone.

LLaVA-NeXT (llava-v1.6) picks a grid of tiles for each image from the checkpoint's
``image_grid_pinpoints``, encodes a downscaled base tile plus every grid tile with the CLIP tower,
drops the rows or columns of features that only cover the letterbox padding ("unpad"), and ends each
remaining feature row with the learned ``image_newline`` embedding. The number of image tokens
therefore depends on the image's (height, width):

    num_image_tokens = base_features + unpadded_height * unpadded_width + unpadded_height

with ``base_features = patches_per_side**2`` ("default" strategy: the CLS is dropped; "full": + 1).

Pure functions of plain numbers, no model and no transformers import: they mirror
``LlavaNextProcessor._get_number_of_features`` / ``_get_unpadded_features`` and
``transformers.image_processing_utils.select_best_resolution`` (transformers 5.24), and are checked
against the real processor in tests/unit/families/test_anyres.py.

Who calls this (planned): the chat formatter, to expand each ``<image>`` to its count before the
prompt is tokenised; admission, to size a request's KV before its image is encoded; journal replay,
which has the image sizes but not the pixels.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class AnyresGeometry:
    """A checkpoint's values that the count depends on (config.json and processor_config.json agree on them)."""

    tile_size: int  # vision_config.image_size == the processor's crop size (pixels per tile side)
    patch_size: int  # vision_config.patch_size
    grid_pinpoints: tuple[tuple[int, int], ...]  # (height, width) in pixels, each a multiple of tile_size
    select_strategy: str = "default"  # "default" drops the CLS feature, "full" keeps it
    num_additional_image_tokens: int = 1  # the CLS of a CLIP tower

    def __post_init__(self):
        if self.select_strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {self.select_strategy!r}: expected 'default' or 'full'")
        for height, width in self.grid_pinpoints:
            if height % self.tile_size or width % self.tile_size:
                raise ValueError(f"grid pinpoint {(height, width)} is not a multiple of the tile size {self.tile_size}")

    @property
    def patches_per_side(self) -> int:
        return self.tile_size // self.patch_size

    @classmethod
    def from_hf_config(cls, hf_config) -> AnyresGeometry:
        """From a LlavaNextConfig (config.json); the engine has this before any processor is loaded.
        num_additional_image_tokens stays 1: the CLS of the CLIP tower, the only tower session/families/support.py
        admits (config.json does not record it; processor_config.json does)."""
        vision = hf_config.vision_config
        return cls(tile_size=vision.image_size, patch_size=vision.patch_size,
                   grid_pinpoints=tuple(tuple(p) for p in hf_config.image_grid_pinpoints),
                   select_strategy=hf_config.vision_feature_select_strategy)

    @classmethod
    def from_processor(cls, processor) -> AnyresGeometry:
        """From a LlavaNextProcessor: the values its own token expansion reads (it takes the tile size from
        the processed ``pixel_values``, i.e. the crop size)."""
        image_processor = processor.image_processor
        return cls(tile_size=image_processor.crop_size["height"], patch_size=processor.patch_size,
                   grid_pinpoints=tuple(tuple(p) for p in image_processor.image_grid_pinpoints),
                   select_strategy=processor.vision_feature_select_strategy,
                   num_additional_image_tokens=processor.num_additional_image_tokens)


@dataclass(frozen=True)
class ImageLayout:
    """How one image of a given size is tiled and how many tokens it becomes."""

    resolution: tuple[int, int]  # (height, width) in pixels of the chosen pinpoint
    grid: tuple[int, int]  # (rows, columns) of tiles
    unpadded: tuple[int, int]  # (height, width) in features of the grid after unpadding
    base_features: int  # features of the downscaled whole image (one tile)

    @property
    def num_tiles(self) -> int:
        """Tiles the vision tower encodes: the grid plus the base tile (``pixel_values.shape[1]`` for one image)."""
        return self.grid[0] * self.grid[1] + 1

    @property
    def num_newlines(self) -> int:
        """One ``image_newline`` embedding after each unpadded feature row."""
        return self.unpadded[0]

    @property
    def num_image_tokens(self) -> int:
        return self.base_features + self.unpadded[0] * self.unpadded[1] + self.num_newlines


def select_best_resolution(height: int, width: int, pinpoints: Iterable[tuple[int, int]]) -> tuple[int, int]:
    """The pinpoint that keeps the most of the image's pixels when it is scaled to fit, ties going to the
    one that wastes the fewest (the first wins a full tie); as transformers' select_best_resolution.

    Note the int() truncation: a sliver (say 20 x 5000 px) scales to 0 rows in every pinpoint, so all
    tie at 0 effective pixels and the smallest pinpoint wins."""
    best: tuple[int, int] | None = None
    best_effective, best_wasted = 0, float("inf")
    for pin_height, pin_width in pinpoints:
        scale = min(pin_width / width, pin_height / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = pin_width * pin_height - effective
        if effective > best_effective or (effective == best_effective and wasted < best_wasted):
            best, best_effective, best_wasted = (pin_height, pin_width), effective, wasted
    if best is None:  # the first pinpoint always wins against nothing
        raise ValueError("select_best_resolution: no grid pinpoints")
    return best


def unpadded_shape(height: int, width: int, grid_height: int, grid_width: int) -> tuple[int, int]:
    """The (height, width) in features of a grid_height x grid_width feature map once the rows (or columns)
    that only cover letterbox padding are removed; the image was scaled to fit and centred in the grid.

    Matches LlavaNextProcessor._get_unpadded_features and modeling_llava_next.unpad_image: the padding
    is floor-halved on each side, so the kept extent can exceed the scaled image by one feature, and a
    sliver can keep zero rows (it then gets no newline tokens either)."""
    if width / height > grid_width / grid_height:  # wider than the grid: bands above and below
        scaled_height = int(round(height * (grid_width / width), 7))
        return grid_height - 2 * ((grid_height - scaled_height) // 2), grid_width
    scaled_width = int(round(width * (grid_height / height), 7))
    return grid_height, grid_width - 2 * ((grid_width - scaled_width) // 2)


def base_features(geometry: AnyresGeometry) -> int:
    """Tokens of the downscaled whole image. As the processor: the extra (CLS) tokens are counted in,
    then "default" subtracts exactly one."""
    side = geometry.patches_per_side
    return side * side + geometry.num_additional_image_tokens - (geometry.select_strategy == "default")


def image_layout(height: int, width: int, geometry: AnyresGeometry) -> ImageLayout:
    """Grid, unpadded feature shape and token count for an image of (height, width) original pixels."""
    if height < 1 or width < 1:
        raise ValueError(f"image size {(height, width)}: both sides must be at least 1 pixel")
    resolution = select_best_resolution(height, width, geometry.grid_pinpoints)
    grid = (resolution[0] // geometry.tile_size, resolution[1] // geometry.tile_size)
    side = geometry.patches_per_side
    unpadded = unpadded_shape(height, width, grid[0] * side, grid[1] * side)
    return ImageLayout(resolution=resolution, grid=grid, unpadded=unpadded, base_features=base_features(geometry))


def resized_pixels(height: int, width: int, geometry: AnyresGeometry) -> int:
    """Pixels of the largest image the processor makes from one of (height, width): the chosen pinpoint
    (the image scaled to fit it, then letterboxed to it) or the base tile. Whatever the aspect ratio,
    no more than the largest pinpoint: anyres bounds its own work."""
    pin_height, pin_width = select_best_resolution(height, width, geometry.grid_pinpoints)
    return max(pin_height * pin_width, geometry.tile_size ** 2)


def num_image_tokens(height: int, width: int, geometry: AnyresGeometry) -> int:
    """How many ``<image>`` tokens LlavaNextProcessor expands one image of (height, width) pixels into."""
    return image_layout(height, width, geometry).num_image_tokens


def max_num_image_tokens(geometry: AnyresGeometry) -> int:
    """The most tokens any image can become: the largest full grid, nothing unpadded (an image with the
    pinpoint's own aspect ratio). What a memory budget must assume before it knows the image's size."""
    side = geometry.patches_per_side
    return max(base_features(geometry) + (h // geometry.tile_size * side) * (w // geometry.tile_size * side + 1)
               for h, w in geometry.grid_pinpoints)
