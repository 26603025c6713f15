"""session/front/event_stream.py, decoded by botocore's own event-stream parser (docs/DESIGN.md, "Event stream")."""

from __future__ import annotations

import base64
import json
import struct
import zlib

import botocore.session
import pytest
from botocore.eventstream import ChecksumMismatch, EventStream, EventStreamBuffer
from botocore.exceptions import EventStreamError
from botocore.parsers import EventStreamJSONParser

from session.front.event_stream import CONTENT_TYPE, MAX_PAYLOAD_BYTES, encode_message, model_stream_error, payload_part

SSE_CHUNK = b'data: {"choices":[{"index":0,"delta":{"content":" caf\xc3\xa9"}}]}\n\n'


def decode(data: bytes) -> list:
    buffer = EventStreamBuffer()
    buffer.add_data(data)
    return list(buffer)


class ChunkedBody:
    """What botocore reads a streamed HTTP body through: ``stream()`` yields chunks as they arrive."""

    def __init__(self, data: bytes, chunk_size: int):
        self.chunks = [data[i:i + chunk_size] for i in range(0, len(data), chunk_size)]

    def stream(self):
        yield from self.chunks

    def close(self):
        pass


def sagemaker_events(data: bytes, chunk_size: int = 7) -> EventStream:
    """The stream as boto3's invoke_endpoint_with_response_stream hands it to the caller."""
    model = botocore.session.get_session().get_service_model("sagemaker-runtime")
    shape = model.operation_model("InvokeEndpointWithResponseStream").output_shape.members["Body"]
    return EventStream(ChunkedBody(data, chunk_size), shape, EventStreamJSONParser(),
                       "InvokeEndpointWithResponseStream")


def test_content_type_is_sagemakers():
    assert CONTENT_TYPE == "application/vnd.amazon.eventstream"


def test_empty_message_matches_the_aws_test_vector():
    assert encode_message({}, b"") == base64.b64decode("AAAAEAAAAAAFwkjrfZjI/w==")


def test_payload_part_frame_layout_and_checksums():
    frame = payload_part(SSE_CHUNK)
    total, headers_length, prelude_crc = struct.unpack(">III", frame[:12])
    assert total == len(frame)
    assert prelude_crc == zlib.crc32(frame[:8])
    assert struct.unpack(">I", frame[-4:])[0] == zlib.crc32(frame[:-4])
    assert frame[12 + headers_length:-4] == SSE_CHUNK


def test_payload_part_decodes_with_botocore_exact_headers_and_bytes():
    [message] = decode(payload_part(SSE_CHUNK))
    assert message.headers == {":event-type": "PayloadPart", ":content-type": "application/octet-stream",
                               ":message-type": "event"}
    assert message.payload == SSE_CHUNK
    assert message.to_response_dict()["status_code"] == 200


def test_the_sagemaker_client_sees_payload_parts_in_order_from_any_chunking():
    parts = [SSE_CHUNK, b"data: [DONE]\n\n", b""]
    data = b"".join(payload_part(p) for p in parts)
    for chunk_size in (1, 7, 64, len(data)):
        events = list(sagemaker_events(data, chunk_size))
        assert events == [{"PayloadPart": {"Bytes": p}} for p in parts]


def test_model_stream_error_raises_in_the_sagemaker_client():
    data = payload_part(SSE_CHUNK) + model_stream_error("backend 1 broke off its stream", "backend_error")
    events = iter(sagemaker_events(data))
    assert next(events) == {"PayloadPart": {"Bytes": SSE_CHUNK}}
    with pytest.raises(EventStreamError) as info:
        next(events)
    assert info.value.response["Error"] == {"Code": "ModelStreamError", "Message": "backend 1 broke off its stream"}


def test_model_stream_error_headers_and_payload():
    [message] = decode(model_stream_error("boom", "backend_timeout"))
    assert message.headers == {":exception-type": "ModelStreamError", ":content-type": "application/json",
                               ":message-type": "exception"}
    assert json.loads(message.payload) == {"Message": "boom", "ErrorCode": "backend_timeout"}


def test_a_corrupted_frame_fails_botocores_checksum():
    frame = bytearray(payload_part(b"data: x\n\n"))
    frame[-6] ^= 0xFF  # flip a payload byte
    with pytest.raises(ChecksumMismatch):
        decode(bytes(frame))


def test_limits_are_enforced_before_sending():
    with pytest.raises(ValueError, match="payload"):
        encode_message({}, b"x" * (MAX_PAYLOAD_BYTES + 1))
    with pytest.raises(ValueError, match="name"):
        encode_message({"": "x"}, b"")
    with pytest.raises(ValueError, match="32767"):
        encode_message({"h": "x" * 40_000}, b"")
