"""session/families/anyres.py gives the same per-image token count as transformers' LlavaNextProcessor.

Three layers: hand-worked layouts (the arithmetic written out), the real processor of both demo
checkpoints on 40 image sizes (count the expanded ``<image>`` ids and the tiles in ``pixel_values``),
and the real llava-v1.6 geometry (336 px tiles) through the processor's own count for 400 sizes.
"""

from __future__ import annotations

import pytest
from PIL import Image

from session.families.anyres import (
    AnyresGeometry,
    image_layout,
    max_num_image_tokens,
    num_image_tokens,
    select_best_resolution,
)

VICUNA = AnyresGeometry(56, 14, ((56, 56), (56, 112), (112, 56), (112, 112), (168, 56), (56, 168)))
MISTRAL = AnyresGeometry(84, 14, ((84, 168), (168, 84), (168, 168), (252, 84), (84, 252)))
LLAVA_V16 = AnyresGeometry(336, 14, ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008)))

# (height, width): tiny, square, tall, wide, huge, and sizes just off the pinpoints' aspect ratios.
SIZES = [
    (1, 1), (1, 2), (2, 1), (3, 3), (1, 3), (3, 1), (5, 2), (2, 5), (4, 3), (3, 4), (10, 10),
    (56, 56), (84, 84), (100, 100), (336, 336), (1000, 1000),
    (200, 50), (700, 3), (2000, 1), (5000, 20), (672, 336), (1008, 336), (640, 480), (300, 100),
    (50, 200), (3, 700), (1, 2000), (20, 5000), (336, 672), (336, 1008), (480, 640), (100, 300), (720, 1280),
    (3000, 4000), (4000, 3000), (3000, 3000),
    (57, 113), (113, 57), (169, 55), (127, 129),
]


# Each row: geometry, (height, width) -> chosen pinpoint, grid, unpadded (rows, cols), count.
# vicuna: 56 px tiles of 4 x 4 patches, base = 16 features.
#   56 x 56: pinpoint 56x56 keeps all 3136 px and wastes least -> grid 1x1, 4x4 features, 16 + 16 + 4 = 36.
#   480 x 640: 112x112 keeps 112*84 px (most) -> grid 2x2 = 8x8 features; wider than the grid, so the scaled
#     height is round(480 * 8 / 640) = 6, padding (8 - 6) // 2 = 1 each side -> 6x8; 16 + 48 + 6 = 70.
#   700 x 3: every pinpoint keeps 0 columns (int truncation), the smallest wins -> 1x1; scaled width
#     round(3 * 4 / 700) = 0, padding 2 each side -> 4x0 features, yet 4 newlines: 16 + 0 + 4 = 20.
#   20 x 5000: the same sliver lying down -> 0x4 features and no newline at all: 16.
# mistral: 84 px tiles of 6 x 6 patches, base = 36; no 1x1 pinpoint.
#   84 x 84: 84x168 and 168x84 both keep all 7056 px and waste 7056; the first listed wins -> grid 1x2 = 6x12
#     features; narrower than 1:2, so the scaled width is round(84 * 6 / 84) = 6, padding 3 each side -> 6x6;
#     36 + 36 + 6 = 78.
#   3000 x 4000: 168x168 keeps 168*126 px -> grid 2x2 = 12x12; scaled height round(3000 * 12 / 4000) = 9,
#     padding (12 - 9) // 2 = 1 each side -> 10x12 (one row more than the image covers): 36 + 120 + 10 = 166.
HAND_WORKED = [
    (VICUNA, (56, 56), (56, 56), (1, 1), (4, 4), 36),
    (VICUNA, (480, 640), (112, 112), (2, 2), (6, 8), 70),
    (VICUNA, (50, 200), (56, 168), (1, 3), (4, 12), 68),
    (VICUNA, (200, 50), (168, 56), (3, 1), (12, 4), 76),
    (VICUNA, (700, 3), (56, 56), (1, 1), (4, 0), 20),
    (VICUNA, (20, 5000), (56, 56), (1, 1), (0, 4), 16),
    (MISTRAL, (84, 84), (84, 168), (1, 2), (6, 6), 78),
    (MISTRAL, (3000, 4000), (168, 168), (2, 2), (10, 12), 166),
    (LLAVA_V16, (336, 336), (336, 672), (1, 2), (24, 24), 576 + 576 + 24),
]


@pytest.mark.parametrize("geometry,size,resolution,grid,unpadded,count", HAND_WORKED)
def test_hand_worked_layouts(geometry, size, resolution, grid, unpadded, count):
    layout = image_layout(*size, geometry)
    assert (layout.resolution, layout.grid, layout.unpadded) == (resolution, grid, unpadded)
    assert layout.num_image_tokens == num_image_tokens(*size, geometry) == count
    assert layout.num_tiles == grid[0] * grid[1] + 1


@pytest.fixture(scope="module", params=["vicuna", "mistral"])
def demo(request):
    from transformers import AutoProcessor

    from model_store.build_llava_next import ensure

    path = ensure([request.param])[request.param]
    return AutoProcessor.from_pretrained(str(path)), {"vicuna": VICUNA, "mistral": MISTRAL}[request.param], path


def test_geometry_from_config_and_processor_agree(demo):
    from transformers import AutoConfig

    processor, geometry, path = demo
    assert AnyresGeometry.from_processor(processor) == geometry
    assert AnyresGeometry.from_hf_config(AutoConfig.from_pretrained(path)) == geometry


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_count_matches_processor_expansion(demo, size):
    processor, geometry, _ = demo
    height, width = size
    out = processor(images=Image.new("RGB", (width, height), (120, 30, 200)), text="<image>\ndescribe",
                    return_tensors="pt")
    layout = image_layout(height, width, geometry)
    assert out["image_sizes"].tolist() == [[height, width]]
    assert int((out["input_ids"] == processor.image_token_id).sum()) == layout.num_image_tokens
    assert out["pixel_values"].shape == (1, layout.num_tiles, 3, geometry.tile_size, geometry.tile_size)


def test_counts_vary_with_size_and_aspect(demo):
    """The point of anyres: the demo checkpoints give different counts for square, wide and tall images."""
    _, geometry, _ = demo
    counts = sorted({num_image_tokens(h, w, geometry) for h, w in SIZES})
    assert counts == {VICUNA: [16, 20, 26, 28, 36, 52, 56, 68, 70, 72, 76, 88],
                      MISTRAL: [36, 42, 54, 66, 78, 88, 90, 112, 114, 120, 126, 150, 162, 166, 168, 192]}[geometry]


def test_real_llava_v16_geometry_matches_processor_count():
    """llava-v1.6's own 336 px tiles and pinpoints, through the processor's count (no pixels processed)."""
    from transformers import LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    from model_store.build_models import build_tokenizer

    image_processor = LlavaNextImageProcessorPil(size={"shortest_edge": 336},
                                                 crop_size={"height": 336, "width": 336},
                                                 image_grid_pinpoints=[list(p) for p in LLAVA_V16.grid_pinpoints])
    processor = LlavaNextProcessor(image_processor=image_processor, tokenizer=build_tokenizer(512), patch_size=14,
                                   vision_feature_select_strategy="default", num_additional_image_tokens=1)
    sizes = [(h, w) for h in range(1, 4000, 211) for w in range(1, 4000, 191)]  # 19 x 21 = 399, plus SIZES
    sizes += SIZES
    expected = processor._get_num_multimodal_tokens(image_sizes=sizes)["num_image_tokens"]
    assert [num_image_tokens(h, w, LLAVA_V16) for h, w in sizes] == expected
    assert num_image_tokens(672, 672, LLAVA_V16) == 576 + 48 * 48 + 48  # 2x2 grid, nothing to unpad


def test_select_best_resolution_matches_transformers():
    from transformers.image_processing_utils import select_best_resolution as hf_select

    pinpoints = [list(p) for p in LLAVA_V16.grid_pinpoints]
    for height in range(1, 3000, 97):
        for width in range(1, 3000, 89):
            assert select_best_resolution(height, width, LLAVA_V16.grid_pinpoints) == hf_select((height, width),
                                                                                                 pinpoints)


@pytest.mark.parametrize("geometry,maximum", [
    (VICUNA, 16 + 8 * 8 + 8),  # 112x112: 8x8 features + 8 newlines
    (MISTRAL, 36 + 12 * 12 + 12),  # 168x168
    (LLAVA_V16, 576 + 48 * 48 + 48),  # 672x672: 2928, llava-v1.6's well-known worst case
])
def test_max_num_image_tokens_is_reached_and_never_passed(geometry, maximum):
    assert max_num_image_tokens(geometry) == maximum
    counts = [num_image_tokens(h, w, geometry) for h in range(1, 1500, 37) for w in range(1, 1500, 41)]
    assert max(counts + [num_image_tokens(h, w, geometry) for h, w in SIZES]) == maximum


@pytest.mark.parametrize("kwargs,message", [
    (dict(select_strategy="cls"), "expected 'default' or 'full'"),
    (dict(grid_pinpoints=((56, 100),)), "not a multiple of the tile size 56"),
])
def test_geometry_rejects_bad_values(kwargs, message):
    values = dict(tile_size=56, patch_size=14, grid_pinpoints=((56, 56),)) | kwargs
    with pytest.raises(ValueError, match=message):
        AnyresGeometry(**values)


def test_empty_image_is_refused():
    with pytest.raises(ValueError, match="at least 1 pixel"):
        num_image_tokens(0, 10, VICUNA)
