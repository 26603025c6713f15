"""What a turn's prefill is fed: the embeddings of its tokens and images, and their M-RoPE positions.

Who calls this: ``Sessions.prepare_turn`` (session/state/sessions.py) on the engine loop thread,
once the session's KV is on the device and ``turn.cached_tokens`` says where the prefill starts.
Each image is embedded from the shared embedding cache, encoded (again, from its kept or journaled
bytes) only when the cache does not hold it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from session.families.mrope import segment_positions
from session.families.vision import Images
from session.model.backend import ModelBackend
from session.state.embeddings import EmbeddingCache
from session.state.image_bytes import ImageBytes
from session.state.session import Turn


class TurnInputs:
    def __init__(self, *, runner: ModelBackend, embeddings: EmbeddingCache, encoded_images: ImageBytes,
                 images_from_bytes: Callable[[bytes], Images]):
        self.runner = runner
        self.embeddings = embeddings
        self.encoded_images = encoded_images
        self.images_from_bytes = images_from_bytes  # encoded image -> Images of one (to recompute an embedding)

    def embed(self, turn: Turn, new_ids: list[int], digests: list[str],
              fresh: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The embeddings [T, D] of what the prefill feeds from ``turn.cached_tokens`` on and, for an
        M-RoPE model, their positions [3, T] (else None; sets ``turn.next_rope_delta``). ``fresh``: the
        transcript is (re)computed past any shared prefix; else a resident follow-up feeds the unfed tail
        (the previous answer's last token) and the turn (``new_ids``, its images ``digests``)."""
        session, start = turn.session, turn.cached_tokens
        if not fresh:
            segment = session.token_ids[start:] + new_ids
            images = self._image_embeddings([], digests, turn.images)
            return self.runner.embed(segment, images), self._positions(turn, segment, digests,
                                                                       start + session.rope_delta)
        ids, all_digests = session.token_ids + new_ids, session.image_digests + digests
        # From the shared prefix's end: images wholly inside it are not embedded (nor encoded),
        # one it cuts into gives its remaining rows.
        first, offset = self._first_image_after(ids, all_digests, start)
        old = len(session.image_digests)
        images = self._image_embeddings(session.image_digests[first:], digests[max(0, first - old):],
                                        turn.images, first_new=max(0, first - old))
        if offset:
            images[0] = images[0][offset:]
        return self.runner.embed(ids[start:], images), self._positions(turn, ids, all_digests, 0, skip=start)

    def _first_image_after(self, token_ids: list[int], digests: list[str], start: int) -> tuple[int, int]:
        """The first image occurrence with a placeholder at or after ``start``, and how many of its
        placeholders lie before ``start`` (0 when it begins there or later)."""
        if not start or not digests:
            return 0, 0
        placeholders = [i for i, t in enumerate(token_ids) if t == self.runner.info.image_token_id]
        first = 0
        for index, digest in enumerate(digests):
            count = self.embeddings.get(digest).num_tokens
            # a shared prefix (start > 0) was keyed by every image's count (``Sessions.block_keys``)
            assert count is not None, f"image {digest[:12]} has no placeholder count"
            if placeholders[first + count - 1] >= start:
                return index, max(0, sum(1 for p in placeholders[first:first + count] if p < start))
            first += count
        return len(digests), 0

    def _positions(self, turn: Turn, token_ids: list[int], digests: list[str], first_position: int,
                   skip: int = 0) -> torch.Tensor | None:
        """M-RoPE positions (None for other models) of ``token_ids`` laid out from ``first_position``,
        their images by their grids, the first ``skip`` left out (a shared prefix holds them); sets the
        rope delta the session carries once the turn commits."""
        if not self.runner.mrope:
            return None
        image_token_id = self.runner.info.image_token_id
        assert image_token_id is not None, "an M-RoPE model has an image token"
        grids: list[tuple[int, int, int]] = []
        for digest in digests:  # each set when the image was described or encoded (an M-RoPE model has grids)
            grid = self.embeddings.get(digest).grid
            assert grid is not None, f"image {digest[:12]} has no grid"
            grids.append(grid)
        positions, next_position = segment_positions(token_ids, image_token_id, grids, self.runner.merge_size,
                                                     first_position)
        turn.next_rope_delta = next_position - (turn.session.kv.length - skip + len(token_ids))
        return positions[:, skip:]

    def _image_embeddings(self, old_digests: list[str], new_digests: list[str], images: Images,
                          first_new: int = 0) -> list[torch.Tensor]:
        """Embeddings for each image occurrence (``old_digests``: the transcript's, when it is recomputed;
        ``new_digests``: the turn's images from ``first_new`` on), encoding only those not cached (never
        encoded, or evicted: re-encoded from their bytes); then the cache's byte bound, sparing this
        prefill's images."""
        to_encode: dict[str, Images] = {}  # digest -> that one image
        for index, digest in enumerate(new_digests, start=first_new):
            if self._count_lookup(digest):
                to_encode.setdefault(digest, images.select(index))
        for digest in old_digests:
            if self._count_lookup(digest) and digest not in to_encode:
                to_encode[digest] = self.images_from_bytes(self.encoded_images.read(digest))
        if to_encode:
            batch = Images.join(to_encode.values())
            encoded = self.runner.encode_images(list(batch.pixels), list(batch.sizes), list(batch.grids) or None)
            for digest, tensor, grid in zip(to_encode, encoded, batch.grids or [None] * len(batch)):
                self.embeddings.store(digest, tensor.to("cpu", copy=True), grid)
        digests = old_digests + new_digests
        tensors = [self.embeddings.use(d).to(self.runner.device) for d in digests]
        self.embeddings.evict(self.encoded_images.has, keep=set(digests))
        return tensors

    def _count_lookup(self, digest: str) -> bool:
        """Is the image's embedding missing (to encode)? Counted as a miss, else as a hit."""
        if self.embeddings.get(digest).tensor is None:
            self.embeddings.num_misses += 1
            return True
        self.embeddings.num_hits += 1
        return False
