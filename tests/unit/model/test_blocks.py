"""session/model/blocks.py: the one place KV block counts are computed."""

from __future__ import annotations

import pytest

from session.model.blocks import blocks_for, blocks_missing


@pytest.mark.parametrize("tokens, blocks", [(0, 0), (1, 1), (255, 1), (256, 1), (257, 2), (1024, 4), (1025, 5)])
def test_blocks_for(tokens, blocks):
    assert blocks_for(tokens, 256) == blocks


def test_blocks_missing_is_never_negative():
    assert blocks_missing(600, 256, have=1) == 2
    assert blocks_missing(600, 256, have=3) == 0
    assert blocks_missing(600, 256, have=5) == 0
