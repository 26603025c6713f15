"""Which device a runner runs on: RESIDENT_DEVICE resolved ("auto", an index for CUDA, TorchNeuron
detected or refused by name) and made the calling thread's current CUDA device.

Who calls this: ``ModelRunner.__init__`` (session/model/runner.py, which keeps these names importable),
the engine's assembly (``select_device`` again on another thread) and ``check_backend``
(session/model/static_shapes.py, for ``NEURON_MISSING``). The dtype a device gets is the runner's
(``resolve_dtype``).
"""

from __future__ import annotations

import torch

from session.errors import ConfigError


def resolve_device(name: str) -> torch.device:
    """RESIDENT_DEVICE -> a device ("auto": CUDA, else a NeuronCore where TorchNeuron has one, else the
    CPU; "neuron" without TorchNeuron is refused, naming it); a CUDA one always with its index ("auto"
    and "cuda" are cuda:0, what "cuda" means in a fresh process). Indexed, it means the same GPU on every thread: a bare "cuda" is
    each thread's current device, and a thread's current device starts at 0."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "neuron" if neuron_available() else "cpu"
    if name.split(":")[0] == "neuron" and not neuron_available():
        raise ConfigError(NEURON_MISSING.format(what="RESIDENT_DEVICE=neuron", found=neuron_found()))
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", 0)
    return device


# TorchNeuron (torch-neuronx 2.13/2.14, Neuron SDK 2.33+, Trn2 and Trn3) registers the "neuron" device and
# torch.compile's "neuron" backend; the SDK 2.31 images (torch-neuronx 2.9, NxD Inference) have neither.
NEURON_MISSING = ("{what} needs TorchNeuron: torch-neuronx matching this torch (" + torch.__version__ + "), from "
                  "Neuron SDK 2.33 or later, on a Trn2 or Trn3 instance; it registers the neuron device and "
                  "torch.compile's neuron backend, and this Python has {found}")


def neuron_available() -> bool:
    """Is the neuron device registered (TorchNeuron loaded) with a NeuronCore to use?"""
    module = getattr(torch, "neuron", None)
    return module is not None and bool(module.is_available())


def neuron_found() -> str:
    """What this Python has of Neuron's packages, for NEURON_MISSING."""
    from importlib import metadata

    try:
        return f"torch-neuronx {metadata.version('torch-neuronx')} without the neuron device"
    except metadata.PackageNotFoundError:
        return "no torch-neuronx"


def select_device(device: torch.device) -> None:
    """Make ``device`` the calling thread's current CUDA device; nothing off CUDA. Who calls this:
    ``ModelRunner.__init__``, first, on the engine's compute thread, which later runs the loop too, and
    ``assemble`` again for a runner built on another thread
    (session/model/threads.py). Before it, that thread's current device is GPU 0: what CUDA does for
    "the current device" (streams torch.cuda.graph makes, its synchronize and empty_cache, the stream
    restored on leaving ``torch.cuda.stream``) would land there and open a context on GPU 0 in a
    process serving another GPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
