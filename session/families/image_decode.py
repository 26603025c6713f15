"""Decoding request images safely: size limits, decompression bombs, content hashes."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from PIL import Image

from session.errors import InvalidImage, PayloadTooLarge

_DATA_URL_PREFIX = "data:"

# Raises PayloadTooLarge for an image of (height, width) its model must not take (vision.ImagePreprocessor.check_size).
SizeCheck = Callable[[int, int], None]


@dataclass(frozen=True)
class DecodedImage:
    image: Image.Image  # RGB
    digest: str  # sha256 of the encoded bytes: the key for sharing embeddings across sessions
    raw: bytes  # the encoded bytes (journaled for crash recovery)

    @property
    def num_bytes(self) -> int:
        return len(self.raw)


def decode_data_url(url: str, *, max_bytes: int, max_pixels: int, check_size: SizeCheck | None = None) -> DecodedImage:
    """Decode ``data:image/<fmt>;base64,<payload>``; raise a 4xx error for anything we refuse.
    ``check_size``, given, judges the size from the header before any pixel is decoded."""
    if not url.startswith(_DATA_URL_PREFIX):
        raise InvalidImage("image_url must be a data URL (data:image/png;base64,...); remote URLs are not fetched")
    header, sep, payload = url.partition(",")
    if not sep or ";base64" not in header or not header[len(_DATA_URL_PREFIX):].startswith("image/"):
        raise InvalidImage("image_url must look like data:image/<format>;base64,<data>")
    if len(payload) > (max_bytes * 4) // 3 + 4:
        raise PayloadTooLarge(f"image is larger than the limit of {max_bytes} bytes")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidImage("image data is not valid base64") from None
    if len(raw) > max_bytes:
        raise PayloadTooLarge(f"image is {len(raw)} bytes; the limit is {max_bytes}")
    return DecodedImage(image=decode_bytes(raw, max_pixels, check_size), digest=hashlib.sha256(raw).hexdigest(),
                        raw=raw)


def decode_bytes(raw: bytes, max_pixels: int, check_size: SizeCheck | None = None) -> Image.Image:
    """Encoded image bytes -> RGB image; refuses more than ``max_pixels``, and what ``check_size`` refuses,
    before decoding any pixel."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(raw))
            # The header alone gives the size: refuse bombs before decoding a single pixel.
            width, height = image.size
            if width * height > max_pixels:
                raise PayloadTooLarge(f"image is {width}x{height} pixels; the limit is {max_pixels} pixels")
            if check_size is not None:
                check_size(height, width)
            image.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise PayloadTooLarge(f"image exceeds the pixel limit of {max_pixels}") from None
    except PayloadTooLarge:
        raise
    except Exception as exc:  # PIL raises many types for corrupt data; all mean "does not decode"
        raise InvalidImage(f"image does not decode: {type(exc).__name__}") from None
    return image.convert("RGB")
