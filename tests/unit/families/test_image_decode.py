"""session/families/image_decode.py: data-URL decoding with byte and pixel limits (decompression bombs)."""

from __future__ import annotations

import base64
import hashlib
import io
import struct
import zlib

import pytest
from PIL import Image, ImageFile

from session.errors import InvalidImage, PayloadTooLarge
from session.families.image_decode import decode_data_url

MAX_BYTES = 6 * 1024 * 1024
MAX_PIXELS = 4096 * 4096


def png_bytes(width: int, height: int, mode: str = "RGB", color=(200, 30, 60)) -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, (width, height), color).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def bilevel_png(width: int, height: int) -> bytes:
    """A valid all-black 1-bit PNG; huge dimensions compress to a few tens of KB."""
    row = b"\x00" * (1 + (width + 7) // 8)  # filter byte + packed bits
    rows_per_block = 1000
    compressor = zlib.compressobj(9)
    idat = b"".join(compressor.compress(row * min(rows_per_block, height - y))
                    for y in range(0, height, rows_per_block)) + compressor.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)  # bit depth 1, greyscale
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


@pytest.fixture(scope="module")
def bomb_png() -> bytes:
    return bilevel_png(20000, 20000)  # 400 M pixels, ~50 KB encoded


@pytest.fixture
def load_calls(monkeypatch) -> list:
    """Records every pixel decode (ImageFile.load) so a test can assert none happened."""
    calls = []
    original = ImageFile.ImageFile.load

    def spy(self):
        calls.append(self.size)
        return original(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", spy)
    return calls


def test_valid_png_decodes_to_rgb_with_size_and_digest():
    raw = png_bytes(7, 5, mode="RGBA", color=(10, 20, 30, 255))
    decoded = decode_data_url(data_url(raw), max_bytes=MAX_BYTES, max_pixels=MAX_PIXELS)
    assert decoded.image.mode == "RGB"
    assert decoded.image.size == (7, 5)
    assert decoded.image.getpixel((6, 4)) == (10, 20, 30)
    assert decoded.digest == hashlib.sha256(raw).hexdigest()
    assert decoded.num_bytes == len(raw)


def test_same_bytes_give_the_same_digest_and_different_bytes_differ():
    a, b = png_bytes(4, 4, color=(1, 2, 3)), png_bytes(4, 4, color=(1, 2, 4))
    def decode(raw):
        return decode_data_url(data_url(raw), max_bytes=MAX_BYTES, max_pixels=MAX_PIXELS).digest
    assert decode(a) == decode(a)
    assert decode(a) != decode(b)


def test_jpeg_data_url_decodes():
    buffer = io.BytesIO()
    Image.new("RGB", (16, 8), (0, 0, 255)).save(buffer, format="JPEG")
    decoded = decode_data_url(data_url(buffer.getvalue(), "image/jpeg"), max_bytes=MAX_BYTES, max_pixels=MAX_PIXELS)
    assert decoded.image.size == (16, 8)
    assert decoded.image.mode == "RGB"


def test_image_exactly_at_both_limits_is_accepted():
    raw = png_bytes(100, 100)
    decoded = decode_data_url(data_url(raw), max_bytes=len(raw), max_pixels=100 * 100)
    assert decoded.image.size == (100, 100)


@pytest.mark.parametrize("url, message", [
    ("https://example.com/cat.png",
     "image_url must be a data URL (data:image/png;base64,...); remote URLs are not fetched"),
    ("data:text/plain;base64,aGVsbG8=", "image_url must look like data:image/<format>;base64,<data>"),
    ("data:image/png,iVBORw0KGgo=", "image_url must look like data:image/<format>;base64,<data>"),
    ("data:image/png;base64", "image_url must look like data:image/<format>;base64,<data>"),
    ("data:image/png;base64,@@@@", "image data is not valid base64"),
    ("data:image/png;base64,iVBORw0KGgo", "image data is not valid base64"),  # bad padding
    ("data:image/png;base64," + base64.b64encode(b"hello, not an image").decode(),
     "image does not decode: UnidentifiedImageError"),
    ("data:image/png;base64,", "image does not decode: UnidentifiedImageError"),
])
def test_refused_urls_are_invalid_image_400(url, message):
    with pytest.raises(InvalidImage) as info:
        decode_data_url(url, max_bytes=MAX_BYTES, max_pixels=MAX_PIXELS)
    assert info.value.status == 400
    assert info.value.type == "invalid_image"
    assert info.value.message == message


def test_truncated_png_is_invalid_image():
    raw = png_bytes(64, 64, color=(5, 6, 7))
    truncated = raw[: len(raw) - 40]
    with pytest.raises(InvalidImage) as info:
        decode_data_url(data_url(truncated), max_bytes=MAX_BYTES, max_pixels=MAX_PIXELS)
    assert info.value.status == 400
    assert info.value.message.startswith("image does not decode: ")


def test_decoded_bytes_over_max_bytes_is_413():
    raw = png_bytes(10, 10)
    with pytest.raises(PayloadTooLarge) as info:
        decode_data_url(data_url(raw), max_bytes=len(raw) - 1, max_pixels=MAX_PIXELS)
    assert info.value.status == 413
    assert info.value.type == "payload_too_large"
    assert info.value.message == f"image is {len(raw)} bytes; the limit is {len(raw) - 1}"


def test_payload_far_over_max_bytes_is_413_before_base64_decoding():
    url = "data:image/png;base64," + "A" * 4000
    with pytest.raises(PayloadTooLarge) as info:
        decode_data_url(url, max_bytes=1000, max_pixels=MAX_PIXELS)
    assert info.value.status == 413
    assert "larger than" in info.value.message and "1000 bytes" in info.value.message


def test_decompression_bomb_is_413_without_decoding_pixels(bomb_png, load_calls):
    assert len(bomb_png) < 100_000
    with pytest.raises(PayloadTooLarge) as info:
        decode_data_url(data_url(bomb_png), max_bytes=MAX_BYTES, max_pixels=MAX_PIXELS)
    assert info.value.status == 413
    assert load_calls == []


def test_bomb_is_413_even_when_max_pixels_would_allow_it(bomb_png, load_calls):
    # PIL's own bomb guard (on by default) still refuses 400 M pixels; we map it to 413, not 400.
    with pytest.raises(PayloadTooLarge) as info:
        decode_data_url(data_url(bomb_png), max_bytes=MAX_BYTES, max_pixels=10**9)
    assert info.value.status == 413
    assert info.value.message == "image exceeds the pixel limit of 1000000000"
    assert load_calls == []


def test_header_over_max_pixels_is_413_without_decoding_pixels(load_calls):
    raw = bilevel_png(5000, 5000)  # 25 M pixels: under PIL's own bomb limit, over ours
    with pytest.raises(PayloadTooLarge) as info:
        decode_data_url(data_url(raw), max_bytes=MAX_BYTES, max_pixels=MAX_PIXELS)
    assert info.value.status == 413
    assert info.value.message == f"image is 5000x5000 pixels; the limit is {MAX_PIXELS} pixels"
    assert load_calls == []


def test_small_image_over_max_pixels_is_413():
    raw = png_bytes(101, 100)
    with pytest.raises(PayloadTooLarge) as info:
        decode_data_url(data_url(raw), max_bytes=MAX_BYTES, max_pixels=100 * 100)
    assert info.value.status == 413
    assert info.value.message == "image is 101x100 pixels; the limit is 10000 pixels"
