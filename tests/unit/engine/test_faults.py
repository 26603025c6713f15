"""Which exceptions from the model are an OOM, a lost device, or neither (session/engine/faults.py)."""

from __future__ import annotations

import pytest
import torch

from session.engine import faults
from session.engine.faults import Fault, classify, device_failed, free_cached_memory, out_of_memory
from session.errors import CapacityExceeded, DeviceFailed, ResidentError

OOM_MESSAGE = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which "
               "1.06 GiB is free.\nOf the allocated memory 75.20 GiB is allocated by PyTorch")


def caused_by(cause: BaseException) -> ResidentError:
    """What ``sample_rows`` returns for a row whose draw raised ``cause``."""
    error = ResidentError(f"sampling this request's next token failed: {cause}")
    error.__cause__ = cause
    return error


@pytest.mark.parametrize("exc", [
    torch.OutOfMemoryError(OOM_MESSAGE),
    torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"),
    RuntimeError("CUDA error: out of memory"),  # a cudaMalloc outside the caching allocator: not sticky
    caused_by(torch.OutOfMemoryError(OOM_MESSAGE)),
], ids=["torch", "torch.cuda", "cuda-call", "row-cause"])
def test_out_of_memory_is_recoverable(exc):
    assert classify(exc) is Fault.OUT_OF_MEMORY


@pytest.mark.parametrize("exc", [
    torch.AcceleratorError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be "
                           "asynchronously reported at some other API call"),
    RuntimeError("CUDA error: device-side assert triggered"),
    RuntimeError("CUDA error: unspecified launch failure"),
    caused_by(RuntimeError("CUDA error: device-side assert triggered")),
], ids=["illegal-address", "device-assert", "launch-failure", "row-cause"])
def test_a_cuda_error_is_fatal(exc):
    assert classify(exc) is Fault.FATAL


@pytest.mark.parametrize("exc", [
    RuntimeError("shape mismatch: value tensor of shape [2] cannot be broadcast"),
    ValueError("KV cache cannot hold 4097 tokens (max 4096)"),
    ResidentError("CUDA error: out of memory"),  # our own error names no torch failure: text alone is not enough
    CapacityExceeded("4 requests are already waiting"),
    caused_by(ValueError("probability tensor contains either inf, nan or element < 0")),
], ids=["runtime", "value", "resident-with-text", "capacity", "row-cause"])
def test_anything_else_fails_the_request_only(exc):
    assert classify(exc) is Fault.OTHER


def test_out_of_memory_is_a_503_with_retry_after_and_keeps_no_traceback():
    try:
        raise torch.OutOfMemoryError(OOM_MESSAGE)
    except torch.OutOfMemoryError as exc:
        error = out_of_memory(exc)
    assert isinstance(error, CapacityExceeded) and error.status == 503
    assert error.headers == {"Retry-After": "1"}
    assert error.__cause__ is None and error.__traceback__ is None  # the failed pass's tensors can be freed
    assert error.to_body() == {"error": {"type": "capacity_exceeded",
                                         "message": "the accelerator ran out of memory for this request; retry later",
                                         "code": "capacity_exceeded"}}


def test_device_failed_is_a_500_naming_the_cuda_error():
    cause = torch.AcceleratorError("CUDA error: an illegal memory access was encountered\nCompile with "
                                   "`TORCH_USE_CUDA_DSA` to enable device-side assertions.")
    error = device_failed(cause)
    assert isinstance(error, DeviceFailed) and error.status == 500 and error.__cause__ is cause
    assert error.message == ("the accelerator failed (CUDA error: an illegal memory access was encountered); "
                             "this worker restarts, retry the request")


def test_freeing_cached_memory_off_cuda_touches_nothing(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1))
    free_cached_memory(torch.device("cpu"))
    free_cached_memory(torch.device("cuda", 0))
    assert calls == [1]


def test_the_default_on_fatal_flushes_the_logs_then_exits_the_process_with_70(monkeypatch):
    exits = []
    monkeypatch.setattr(faults.os, "_exit", exits.append)
    monkeypatch.setattr(faults.logging, "shutdown", lambda: exits.append("flushed"))
    faults.exit_worker(torch.AcceleratorError("CUDA error: an illegal memory access was encountered"))
    assert exits == ["flushed", 70] and faults.EXIT_DEVICE_FAILED == 70
