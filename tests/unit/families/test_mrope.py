"""session/families/mrope.py against transformers' own ``get_rope_index`` (Qwen2-VL and Qwen2.5-VL, 5.24):
whole transcripts with several images over several turns, every suffix segment given its prefix, and
the rope delta a session carries. No checkpoint: ``get_rope_index`` reads only the merge size (and
Qwen2.5-VL's ``tokens_per_second``, for videos) off its config."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen2_5_VLModel, Qwen2VLModel

from session.families.mrope import image_positions, image_span, num_image_tokens, rope_delta, segment_positions

IMAGE = 7  # the image placeholder id in these synthetic transcripts; text ids are drawn from 10..99
MERGE = 2
GRIDS = [(1, 4, 4), (1, 6, 10), (1, 10, 4), (1, 2, 2), (1, 8, 8), (1, 2, 14)]


def transformers_rope_index(family, ids: list[int], grids, second_per_grid_ts=None):
    """(positions [3, T], delta) from the model class's own get_rope_index, unbound: it uses only
    ``self.config`` and ``self.get_vision_position_ids`` (which reads nothing off ``self``)."""
    model_cls = {"qwen2_vl": Qwen2VLModel, "qwen2_5_vl": Qwen2_5_VLModel}[family]
    owner = SimpleNamespace(config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=MERGE,
                                                                                  tokens_per_second=2)))
    owner.get_vision_position_ids = lambda *args, **kwargs: model_cls.get_vision_position_ids(owner, *args, **kwargs)
    input_ids = torch.tensor([ids])
    extra = {} if second_per_grid_ts is None else {"second_per_grid_ts": second_per_grid_ts}
    positions, deltas = model_cls.get_rope_index(owner, input_ids, mm_token_type_ids=(input_ids == IMAGE).int(),
                                                 image_grid_thw=torch.tensor(grids), **extra)
    return positions[:, 0], int(deltas[0, 0])


def transcript(seed: int, grids) -> tuple[list[int], list[int]]:
    """Text runs of 1..9 tokens around each image (as <|vision_start|> ... <|vision_end|> and the turn's
    text put them); returns the ids and the index each image's placeholders start at."""
    rng = random.Random(seed)
    ids, image_starts = [rng.randrange(10, 100) for _ in range(rng.randrange(1, 10))], []
    for grid in grids:
        image_starts.append(len(ids))
        ids += [IMAGE] * num_image_tokens(grid, MERGE)
        ids += [rng.randrange(10, 100) for _ in range(rng.randrange(1, 10))]
    return ids, image_starts


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
@pytest.mark.parametrize("seed", range(6))
def test_whole_transcript_equals_get_rope_index(family, seed):
    grids = random.Random(seed).sample(GRIDS, k=1 + seed % 4)
    ids, _ = transcript(seed, grids)
    expected, expected_delta = transformers_rope_index(family, ids, grids)
    positions, next_position = segment_positions(ids, IMAGE, grids, MERGE, start=0)
    assert torch.equal(positions, expected)
    assert rope_delta(next_position, len(ids)) == expected_delta
    # each image advances the position by its larger merged side instead of its token count
    assert expected_delta == sum(image_span(g, MERGE) - num_image_tokens(g, MERGE) for g in grids)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_every_suffix_given_its_prefix_equals_the_whole(family):
    """A session prefills a transcript in segments (one per turn): a segment starting at any index
    outside an image, at position index + the prefix's delta, gets the whole transcript's positions."""
    grids = [(1, 6, 10), (1, 4, 4), (1, 10, 4)]
    ids, image_starts = transcript(11, grids)
    expected, expected_delta = transformers_rope_index(family, ids, grids)
    inside_images = {i for start, g in zip(image_starts, grids)
                     for i in range(start + 1, start + num_image_tokens(g, MERGE))}
    num_splits = 0
    for split in range(len(ids) + 1):
        if split in inside_images:
            continue
        prefix_grids = [g for start, g in zip(image_starts, grids) if start < split]
        _, prefix_next = segment_positions(ids[:split], IMAGE, prefix_grids, MERGE, start=0)
        delta = rope_delta(prefix_next, split)
        suffix, suffix_next = segment_positions(ids[split:], IMAGE, grids[len(prefix_grids):], MERGE,
                                                start=split + delta)
        assert torch.equal(suffix, expected[:, split:])
        assert rope_delta(suffix_next, len(ids)) == expected_delta
        num_splits += 1
    assert num_splits == len(ids) + 1 - len(inside_images) == 32


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_text_after_the_last_image_continues_at_index_plus_delta(family):
    """What decode relies on: generated tokens (text) sit at index + delta in all three rows, the same
    positions get_rope_index gives them when the answer is part of a longer prompt."""
    grids = [(1, 6, 10), (1, 2, 14)]
    ids, _ = transcript(5, grids)
    _, delta = transformers_rope_index(family, ids, grids)
    answer = [42, 43, 44, 45]
    extended, _ = transformers_rope_index(family, ids + answer, grids)
    expected = torch.arange(len(ids), len(ids) + len(answer)) + delta
    assert torch.equal(extended[:, len(ids):], expected.expand(3, -1))


def test_qwen2_5_images_ignore_video_time_spacing():
    """Qwen2.5-VL spaces only video frames by second_per_grid_ts * tokens_per_second; an image's
    temporal row stays at its start, so both families give images the same positions."""
    grids = [(1, 4, 4), (1, 6, 10)]
    ids, _ = transcript(3, grids)
    qwen2, delta2 = transformers_rope_index("qwen2_vl", ids, grids)
    qwen2_5, delta2_5 = transformers_rope_index("qwen2_5_vl", ids, grids, second_per_grid_ts=torch.tensor([3.0, 5.0]))
    assert torch.equal(qwen2, qwen2_5) and delta2 == delta2_5


def test_image_positions_by_hand():
    """A 2 x 3 merged grid (4 x 6 patches) at position 10: rows 10..11, columns 10..12, t = 10; the
    next token takes 10 + max(2, 3) = 13."""
    positions = image_positions(10, (1, 4, 6), MERGE)
    assert positions.tolist() == [[10] * 6, [10, 10, 10, 11, 11, 11], [10, 11, 12, 10, 11, 12]]
    assert image_span((1, 4, 6), MERGE) == 3
    ids = [1, 2] + [IMAGE] * 6 + [3]
    positions, next_position = segment_positions(ids, IMAGE, [(1, 4, 6)], MERGE, start=8)
    assert positions[:, :2].tolist() == [[8, 9]] * 3
    assert positions[:, -1].tolist() == [13] * 3 and next_position == 14
    assert rope_delta(next_position, len(ids)) == 5  # 14 - 9: here the prefix's delta (+8) outweighs the image's (-3)


def test_segments_that_do_not_match_their_grids_are_refused():
    ids = [1] + [IMAGE] * 4 + [2]
    with pytest.raises(ValueError, match="only 0 image grids"):
        segment_positions(ids, IMAGE, [], MERGE, start=0)
    with pytest.raises(ValueError, match="needs 15 placeholders"):
        segment_positions(ids, IMAGE, [(1, 6, 10)], MERGE, start=0)
    with pytest.raises(ValueError, match="2 image grids"):
        segment_positions(ids, IMAGE, [(1, 4, 4), (1, 4, 4)], MERGE, start=0)
