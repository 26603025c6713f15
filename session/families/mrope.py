"""M-RoPE positions (Qwen2-VL, Qwen2.5-VL): three position ids per token (temporal, height, width).

A text token has the same position in all three, one more than the token before it. An image's
``t*h*w / merge**2`` placeholder tokens take a grid: temporal ``start`` (t is 1 for an image), height
``start + row``, width ``start + column``, with ``row`` and ``column`` counted in merged tokens; the
token after the image continues at ``start + max(rows, columns)``. So positions fall behind token
indices by a per-image amount, and a session must carry the difference:

    rope_delta = (position of the next text token) - (its index in the transcript)

A follow-up segment of a session with ``L`` cached tokens starts at position ``L + rope_delta``, and
a decode step feeds its token at ``L + rope_delta`` in all three. Transformers computes the same
thing for a whole prompt in ``Qwen2VLModel.get_rope_index`` (and Qwen2.5-VL's, which only spaces
*video* frames by ``second_per_grid_ts * tokens_per_second``; still images keep t = start);
tests/unit/families/test_mrope.py pins these functions against it.

Pure functions over plain ints; who calls them: the Qwen-VL runner's callers (session/families/qwen_vl.py),
once per prefilled segment, with the grids of the images whose placeholders the segment holds.
"""

from __future__ import annotations

import torch


def image_positions(start: int, grid_thw: tuple[int, int, int], merge_size: int) -> torch.Tensor:
    """[3, t*h*w / merge**2] positions of one image whose first placeholder sits at ``start``,
    in the vision tower's output order (row-major over the merged grid)."""
    grid_t, grid_h, grid_w = grid_thw
    rows, columns = grid_h // merge_size, grid_w // merge_size
    t = torch.arange(grid_t).view(-1, 1, 1).expand(-1, rows, columns)
    h = torch.arange(rows).view(1, -1, 1).expand(grid_t, -1, columns)
    w = torch.arange(columns).view(1, 1, -1).expand(grid_t, rows, -1)
    return torch.stack([t, h, w]).reshape(3, -1) + start


def image_span(grid_thw: tuple[int, int, int], merge_size: int) -> int:
    """How far one image advances the position: the larger side of its merged grid."""
    return max(grid_thw[1], grid_thw[2]) // merge_size


def num_image_tokens(grid_thw: tuple[int, int, int], merge_size: int) -> int:
    grid_t, grid_h, grid_w = grid_thw
    return grid_t * grid_h * grid_w // merge_size**2


def segment_positions(token_ids: list[int], image_token_id: int, grids: list[tuple[int, int, int]],
                      merge_size: int, start: int) -> tuple[torch.Tensor, int]:
    """Positions [3, T] of a segment whose first token takes position ``start``, and the position the
    token after it takes. ``grids`` are the (t, h, w) of the images whose placeholders the segment
    holds, in order; each image's placeholders must lie whole inside the segment."""
    columns, position, index = [], start, 0
    images = iter(grids)
    while index < len(token_ids):
        if token_ids[index] != image_token_id:
            run = index
            while run < len(token_ids) and token_ids[run] != image_token_id:
                run += 1
            columns.append(torch.arange(position, position + run - index).expand(3, -1))
            position, index = position + run - index, run
            continue
        grid = next(images, None)
        if grid is None:
            raise ValueError(f"image placeholder at {index} but only {len(grids)} image grids")
        count = num_image_tokens(grid, merge_size)
        if token_ids[index:index + count] != [image_token_id] * count:
            raise ValueError(f"the image at {index} needs {count} placeholders; the segment has fewer there")
        columns.append(image_positions(position, grid, merge_size))
        position, index = position + image_span(grid, merge_size), index + count
    if next(images, None) is not None:
        raise ValueError(f"{len(grids)} image grids for fewer images in the segment")
    positions = torch.cat(columns, dim=1) if columns else torch.zeros(3, 0, dtype=torch.long)
    return positions, position


def rope_delta(next_position: int, num_tokens: int) -> int:
    """What a session carries after ``num_tokens`` tokens whose successor takes ``next_position``."""
    return next_position - num_tokens
