"""The model seam: ModelRunner and the tests' fake are ModelBackends, StaticShapeRunner a Stepper,
each method taking every parameter the protocol names (so a fake cannot drift from the runner)."""

from __future__ import annotations

import inspect

import pytest

from session.model.backend import ModelBackend, Stepper
from session.model.runner import ModelRunner
from session.model.static_shapes import StaticShapeRunner
from tests.fake_runner import FakeRunner


def protocol_methods(protocol) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(member) for name, member in vars(protocol).items()
            if callable(member) and not name.startswith("_")} | (
        protocol_methods(Stepper) if protocol is ModelBackend else {})


def missing_parameters(cls, protocol) -> list[str]:
    """'method: parameter' for each protocol parameter the class's method lacks (or the method itself)."""
    missing = []
    for name, wanted in protocol_methods(protocol).items():
        method = getattr(cls, name, None)
        if method is None:
            missing.append(f"{name}: (no such method)")
            continue
        have = inspect.signature(method).parameters
        for parameter in list(wanted.parameters.values())[1:]:  # past self
            got = have.get(parameter.name)
            if got is None or got.kind != parameter.kind:
                missing.append(f"{name}: {parameter.name}")
            elif parameter.default is not inspect.Parameter.empty and got.default is inspect.Parameter.empty:
                missing.append(f"{name}: {parameter.name} (must be optional)")
    return missing


@pytest.mark.parametrize("cls,protocol", [(ModelRunner, ModelBackend), (FakeRunner, ModelBackend),
                                          (StaticShapeRunner, Stepper)], ids=["runner", "fake", "static"])
def test_each_backend_takes_every_parameter_of_its_protocol(cls, protocol):
    assert missing_parameters(cls, protocol) == []


def test_the_check_catches_a_drifted_fake():
    class Drifted(FakeRunner):
        def encode_images(self, pixels, sizes=None):  # the drift this check exists for: no grids
            return super().encode_images(pixels, sizes)

    assert missing_parameters(Drifted, ModelBackend) == ["encode_images: grids"]


def test_the_fake_has_the_attributes_the_engine_reads():
    fake = FakeRunner(vocab_size=8, eos_token_ids=(1,), image_token_id=7)
    for name in ModelBackend.__annotations__:
        assert hasattr(fake, name), name
