"""Qwen2-VL and Qwen2.5-VL: image geometry, and the processor without torchvision.

- **Geometry.** The processor resizes each image to multiples of ``patch * merge`` pixels with
  ``min_pixels <= h*w <= max_pixels`` (transformers' ``smart_resize``), so an image's token count,
  ``t*h*w / merge**2`` with t = 1, depends on its size: ``image_grid`` gives (t, h, w) without pixels.
- **Processor.** ``AutoProcessor`` insists on building the video processor, which needs torchvision
  (not installable beside the CPU torch); ``load_processor`` builds the checkpoint's processor class
  with its PIL image processor (``Qwen2VLImageProcessorPil``: the pixels transformers produces
  without torchvision) and no video processor. Images only.
The model side is ``ModelRunner``'s (the vision tower's own ``get_image_features``, prefill with the
3-D positions of session/families/mrope.py, decode at each session's rope delta): the text attention of both
families is Qwen2's, and the checkpoint's own ``rotary_emb`` folds the three position rows into one
cos/sin by ``mrope_section``, so only the positions differ from a text model.

Who calls this: ``session/families/vision.py`` (counts), ``session/engine/assembly.py`` (the processor), tests.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import Qwen2_5_VLProcessor, Qwen2VLProcessor

from session.families.mrope import num_image_tokens


@dataclass(frozen=True)
class QwenVLGeometry:
    patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int

    @classmethod
    def from_image_processor(cls, image_processor) -> QwenVLGeometry:
        size = image_processor.size  # {"shortest_edge": min_pixels, "longest_edge": max_pixels}
        return cls(image_processor.patch_size, image_processor.merge_size, size["shortest_edge"],
                   size["longest_edge"])


# smart_resize refuses an image whose longer side is over 200 times its shorter one (a ValueError).
MAX_ASPECT_RATIO = 200


def resized_size(height: int, width: int, geometry: QwenVLGeometry) -> tuple[int, int]:
    """(height, width) the processor resizes an image to (transformers' ``smart_resize``): multiples of
    patch * merge, between min_pixels and max_pixels. Raises ValueError past MAX_ASPECT_RATIO."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    return smart_resize(height, width, factor=geometry.patch_size * geometry.merge_size,
                        min_pixels=geometry.min_pixels, max_pixels=geometry.max_pixels)


def image_grid(height: int, width: int, geometry: QwenVLGeometry) -> tuple[int, int, int]:
    """(t, h, w) in patches of an image of ``height`` x ``width`` pixels, as the processor's image_grid_thw."""
    resized_h, resized_w = resized_size(height, width, geometry)
    return 1, resized_h // geometry.patch_size, resized_w // geometry.patch_size


def image_token_count(height: int, width: int, geometry: QwenVLGeometry) -> int:
    """``<|image_pad|>`` tokens one image of that size expands to."""
    return num_image_tokens(image_grid(height, width, geometry), geometry.merge_size)


def _image_only(processor_class):
    class ImageOnlyProcessor(processor_class):  # type: ignore[misc, valid-type]  # a base chosen at run time
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
