"""AWS event-stream framing, as SageMaker's InvokeEndpointWithResponseStream answers.

The answer's content type is ``application/vnd.amazon.eventstream``; its body is a sequence of
binary messages. One message (all integers big-endian):

    prelude   total_length u32 | headers_length u32 | prelude_crc u32 (CRC32 of the 8 bytes before)
    headers   per header: name_length u8 | name | value_type u8 (7 = string) | value_length u16 | value
    payload   bytes
    trailer   message_crc u32 (CRC32 of everything before it)

In the SageMaker runtime model the stream's events are ``PayloadPart`` (the container's bytes, as
``Bytes``) and the modelled exceptions ``ModelStreamError`` and ``InternalStreamFailure``.
botocore decodes these (``botocore.eventstream``); the Smithy encoder needs Python >= 3.12, so the
few lines of encoding live here. Pure functions; used by ``session/front/server.py``.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Mapping

CONTENT_TYPE = "application/vnd.amazon.eventstream"
PAYLOAD_CONTENT_TYPE = "application/octet-stream"  # PayloadPart.Bytes is a blob payload

_STRING = 7  # header value type: UTF-8 string with a u16 length
_PRELUDE = struct.Struct(">II")
_CRC = struct.Struct(">I")
# botocore's decoder limits (botocore.eventstream): larger messages are refused.
MAX_HEADERS_BYTES = 128 * 1024
MAX_PAYLOAD_BYTES = 16 * 1024 * 1024


def encode_message(headers: Mapping[str, str], payload: bytes) -> bytes:
    """One event-stream message with string-valued headers, in the given order."""
    encoded_headers = b"".join(_encode_header(name, value) for name, value in headers.items())
    if len(encoded_headers) > MAX_HEADERS_BYTES:
        raise ValueError(f"event-stream headers are {len(encoded_headers)} bytes; at most {MAX_HEADERS_BYTES}")
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise ValueError(f"event-stream payload is {len(payload)} bytes; at most {MAX_PAYLOAD_BYTES}")
    total_length = _PRELUDE.size + _CRC.size + len(encoded_headers) + len(payload) + _CRC.size
    prelude = _PRELUDE.pack(total_length, len(encoded_headers))
    message = prelude + _CRC.pack(zlib.crc32(prelude)) + encoded_headers + payload
    return message + _CRC.pack(zlib.crc32(message))


def payload_part(data: bytes) -> bytes:
    """A ``PayloadPart`` event carrying ``data`` (botocore yields ``{"PayloadPart": {"Bytes": data}}``)."""
    return encode_message({":event-type": "PayloadPart", ":content-type": PAYLOAD_CONTENT_TYPE,
                           ":message-type": "event"}, data)


def model_stream_error(message: str, error_code: str) -> bytes:
    """A ``ModelStreamError`` exception event: the stream broke after it began (botocore raises
    ``EventStreamError`` with code ``ModelStreamError`` when it reaches this message)."""
    body = json.dumps({"Message": message, "ErrorCode": error_code}).encode()
    return encode_message({":exception-type": "ModelStreamError", ":content-type": "application/json",
                           ":message-type": "exception"}, body)


def _encode_header(name: str, value: str) -> bytes:
    raw_name, raw_value = name.encode(), value.encode()
    if not 0 < len(raw_name) < 256:
        raise ValueError(f"event-stream header name {name!r} must be 1..255 bytes")
    if len(raw_value) > 0x7FFF:
        raise ValueError(f"event-stream header {name!r} value is {len(raw_value)} bytes; at most 32767")
    return struct.pack(">B", len(raw_name)) + raw_name + struct.pack(">BH", _STRING, len(raw_value)) + raw_value
