"""What an exception from the model means for the worker, and the worker's exit when the device is lost.

Who calls this: the engine loop thread (``Engine.step``), on an exception from the executor:

- ``OUT_OF_MEMORY`` (``torch.OutOfMemoryError``, which ``torch.cuda.OutOfMemoryError`` is): the
  device is fine, the step asked for more than it had. The engine retries a decode step in smaller
  batches and fails what still does not fit with a 503 (``DeviceOutOfMemory``), then goes on.
- ``FATAL``: a CUDA error such as an illegal memory access or a device-side assert. The error is
  sticky: every later call on the same CUDA context fails too, so the engine fails every request
  and the worker exits (``exit_worker``) to be restarted with a fresh context.
- ``OTHER``: a bug or a bad input; the request(s) of the call fail, the engine goes on.
"""

from __future__ import annotations

import enum
import logging
import os
import sys

import torch

from session.errors import DeviceFailed, DeviceOutOfMemory

logger = logging.getLogger(__name__)

# torch reports a failed CUDA call (C10_CUDA_CHECK) as torch.AcceleratorError from 2.8 on (a
# RuntimeError), as a plain RuntimeError before, and in both only the message says which call
# failed: hence text, on RuntimeErrors alone.
CUDA_ERROR = "CUDA error"
# cudaErrorMemoryAllocation from a call outside the caching allocator (a cuBLAS handle, a graph
# capture) is not sticky: the context stays usable, like an allocator OOM.
CUDA_OUT_OF_MEMORY = "CUDA error: out of memory"
EXIT_DEVICE_FAILED = 70  # EX_SOFTWARE (sysexits.h): tells a lost device from a signal in the worker's log


class Fault(enum.Enum):
    OUT_OF_MEMORY = "out_of_memory"
    FATAL = "fatal"
    OTHER = "other"


def classify(exc: BaseException) -> Fault:
    """The kind of ``exc``, or of the first exception in its ``__cause__`` chain that has one (a
    decode row whose draw raised carries the torch error as the cause of its ResidentError)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, torch.OutOfMemoryError):
            return Fault.OUT_OF_MEMORY
        if isinstance(seen, RuntimeError) and CUDA_ERROR in str(seen):
            return Fault.OUT_OF_MEMORY if CUDA_OUT_OF_MEMORY in str(seen) else Fault.FATAL
        seen = seen.__cause__
    return Fault.OTHER


def out_of_memory(exc: BaseException) -> DeviceOutOfMemory:
    """The 503 for a call that ran out of device memory (``exc``); the engine retries a decode batch
    smaller before a row fails with it. Not chained to ``exc``: its traceback holds the failed
    attempt's tensors, which must be freed before the retry."""
    logger.warning("out of device memory: %s", _first_line(exc))
    return DeviceOutOfMemory("the accelerator ran out of memory for this request; retry later", retry_after_s=1)


def device_failed(exc: BaseException) -> DeviceFailed:
    """The 500 every request fails with once the device is lost (``exc``: the CUDA error)."""
    error = DeviceFailed(f"the accelerator failed ({_first_line(exc)}); this worker restarts, retry the request")
    error.__cause__ = exc
    return error


def _first_line(exc: BaseException) -> str:
    """torch's OOM message goes on for lines (the allocator's statistics); its first line says enough."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def free_cached_memory(device: torch.device) -> None:
    """After an OOM, before the retry: hand the caching allocator's free blocks (what the failed
    attempt freed) back to the driver, so that allocations outside the allocator (cuBLAS workspaces,
    a new CUDA graph's pool) can use them too. Nothing to do off CUDA."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def exit_worker(error: BaseException) -> None:
    """The engine's default ``on_fatal``: end this process now, with EXIT_DEVICE_FAILED, so that it is
    restarted (TorchServe sees its worker die; the watchdog sees the worker leave READY and the
    heartbeat go stale, and restarts the instance; sessions come back from the journal).

    ``os._exit``, not ``sys.exit``: the engine calls this on its own thread, where ``SystemExit``
    would end only that thread, and a normal interpreter exit runs atexit hooks and CUDA teardown,
    which can hang on a broken context. The logs are flushed first so the cause is not lost.
    """
    logger.critical("the device is unusable (%s): exiting with status %d so the worker is restarted", error,
                    EXIT_DEVICE_FAILED)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_DEVICE_FAILED)
