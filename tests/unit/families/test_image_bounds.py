"""Each family's image bound (issue #39): an image whose preprocessing would make more than ``max_pixels``
(or that Qwen-VL's resize refuses) is refused with 413 naming the limit, before the processor runs."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image
from transformers.image_transforms import get_resize_output_image_size
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

from session.errors import InvalidImage, PayloadTooLarge
from session.families.anyres import AnyresGeometry, resized_pixels
from session.families.image_decode import decode_bytes
from session.families.qwen_vl import MAX_ASPECT_RATIO, QwenVLGeometry
from session.families.vision import ImagePreprocessor, resize_output_size

CAP = 4096 * 4096
LLAVA_V16 = AnyresGeometry(tile_size=336, patch_size=14,
                           grid_pinpoints=((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008)))
QWEN2_VL = QwenVLGeometry(patch_size=14, merge_size=2, min_pixels=56 * 56, max_pixels=28 * 28 * 1280)


class RefusingProcessor:
    """An image processor that must not run (the bound is checked first)."""

    size = {"shortest_edge": 56}
    do_resize = True

    def __call__(self, **kwargs):
        raise AssertionError("the processor ran")


def clip(shortest_edge: int = 56, max_pixels: int = CAP) -> ImagePreprocessor:
    processor = CLIPImageProcessorPil(size={"shortest_edge": shortest_edge},
                                      crop_size={"height": shortest_edge, "width": shortest_edge})
    return ImagePreprocessor(processor, fixed_tokens=16, max_pixels=max_pixels)


@pytest.mark.parametrize("height, width", [(1, 30000), (30000, 1), (480, 640), (640, 480), (7, 7), (3, 1000),
                                           (1000, 3), (56, 57), (1, 1)])
@pytest.mark.parametrize("shortest_edge", [56, 336])
def test_the_shortest_edge_resize_is_transformers_own(height, width, shortest_edge):
    channels_first = np.lib.stride_tricks.as_strided(np.zeros(1, np.uint8), (3, height, width), (0, 0, 0))
    expected = get_resize_output_image_size(channels_first, size=shortest_edge, default_to_square=False,
                                            input_data_format="channels_first")
    assert resize_output_size(height, width, {"shortest_edge": shortest_edge}) == tuple(expected)


def test_fixed_and_capped_sizes():
    assert resize_output_size(1, 30000, {"height": 336, "width": 336}) == (336, 336)
    assert resize_output_size(1, 30000, {"shortest_edge": 336, "longest_edge": 1000}) == (1000, 1000)
    assert resize_output_size(1, 30000, {"max_height": 800, "max_width": 600}) == (800, 600)


def test_clip_shortest_edge_refuses_a_sliver_naming_the_bound():
    """The issue's case: 30000x1 at the demo's 56 would be 56 x 1,680,000 = 94,080,000 pixels."""
    with pytest.raises(PayloadTooLarge, match="30000x1 pixels; this model's image processor would resize it to "
                                              f"94080000 pixels, over the limit of {CAP} pixels") as refused:
        clip().check_size(1, 30000)
    assert refused.value.status == 413
    with pytest.raises(PayloadTooLarge, match=f"2000x1 pixels.* 225792000 pixels, over the limit of {CAP}"):
        clip(336).check_size(1, 2000)  # LLaVA-1.5: 336 x 672,000
    clip().check_size(480, 640)
    clip(336).check_size(1, 148)  # 336 x 49,728: an aspect ratio LLaVA-1.5 takes under the default cap
    clip().check_size(1, CAP // 56 // 56)  # the bound exactly: 56 x 299,593 <= 16,777,216


def test_a_processor_without_resize_makes_no_larger_image():
    processor = CLIPImageProcessorPil(do_resize=False, crop_size={"height": 56, "width": 56})
    ImagePreprocessor(processor, fixed_tokens=16, max_pixels=100).check_size(10, 10)
    with pytest.raises(PayloadTooLarge):
        ImagePreprocessor(processor, fixed_tokens=16, max_pixels=100).check_size(10, 11)


def test_preprocess_checks_every_image_before_the_processor_runs():
    vision = ImagePreprocessor(RefusingProcessor(), fixed_tokens=16)
    with pytest.raises(PayloadTooLarge, match="30000x1 pixels"):
        vision.preprocess([Image.new("RGB", (64, 48)), Image.new("RGB", (30000, 1))])


def test_clip_preprocess_still_takes_normal_images():
    prepared = clip().preprocess([Image.new("RGB", (640, 480)), Image.new("RGB", (3, 500))])
    assert [tuple(p.shape) for p in prepared.pixels] == [(3, 56, 56), (3, 56, 56)]


def test_anyres_is_bounded_by_its_largest_pinpoint_whatever_the_aspect():
    largest = max(h * w for h, w in LLAVA_V16.grid_pinpoints)
    for height, width in ((1, 30000), (30000, 1), (480, 640), (1, 1), (4096, 4096), (336, 1008)):
        assert resized_pixels(height, width, LLAVA_V16) <= largest
    assert resized_pixels(1, 30000, LLAVA_V16) == 336 * 672  # a sliver keeps 0 rows everywhere: the smallest
    assert resized_pixels(4096, 4096, LLAVA_V16) == 672 * 672
    vision = ImagePreprocessor(RefusingProcessor(), geometry=LLAVA_V16)
    vision.check_size(1, 30000)
    vision.check_size(4096, 4096)
    with pytest.raises(PayloadTooLarge, match="4096x4096 pixels.* 451584 pixels, over the limit of 400000"):
        ImagePreprocessor(RefusingProcessor(), geometry=LLAVA_V16, max_pixels=400_000).check_size(4096, 4096)


def test_qwen_vl_refuses_past_its_aspect_ratio_with_413():
    vision = ImagePreprocessor(RefusingProcessor(), qwen_geometry=QWEN2_VL)
    vision.check_size(10, 10 * MAX_ASPECT_RATIO)
    vision.check_size(10 * MAX_ASPECT_RATIO, 10)
    for height, width in ((10, 10 * MAX_ASPECT_RATIO + 1), (1, 30000), (30000, 1)):
        with pytest.raises(PayloadTooLarge, match=f"an aspect ratio over {MAX_ASPECT_RATIO}:1"):
            vision.check_size(height, width)


def test_qwen_vl_min_and_max_pixels_bound_the_resize():
    vision = ImagePreprocessor(RefusingProcessor(), qwen_geometry=QWEN2_VL)
    for height, width in ((4096, 4096), (1, 1), (20, 3999), (480, 640)):
        vision.check_size(height, width)
        assert vision._resized_pixels(height, width) <= QWEN2_VL.max_pixels + 28 * 28 * MAX_ASPECT_RATIO
    assert vision._resized_pixels(4096, 4096) <= QWEN2_VL.max_pixels
    assert vision._resized_pixels(1, 1) == 56 * 56  # min_pixels: scaled up
    with pytest.raises(PayloadTooLarge, match="over the limit of 500000 pixels"):
        ImagePreprocessor(RefusingProcessor(), qwen_geometry=QWEN2_VL, max_pixels=500_000).check_size(4096, 4096)


def test_the_decoder_asks_the_check_from_the_header_before_decoding():
    buffer = io.BytesIO()
    Image.new("RGB", (30000, 1)).save(buffer, format="PNG")
    truncated = buffer.getvalue()[:60]  # the header and no pixels: decoding it fails
    with pytest.raises(InvalidImage):
        decode_bytes(truncated, CAP)
    with pytest.raises(PayloadTooLarge, match="30000x1 pixels"):
        decode_bytes(truncated, CAP, clip().check_size)
    assert decode_bytes(buffer.getvalue(), CAP).size == (30000, 1)  # no check given: decoded as before
