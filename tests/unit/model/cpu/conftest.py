"""Fixtures shared by the CPU kernel tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def llama_path() -> str:
    """The tiny Llama checkpoint (built offline on first use)."""
    from model_store.build_text_models import ensure

    return str(ensure(["llama"])["llama"])
