"""The sessions' state: store, memory tiers, image embeddings and journal, behind one owner.

Who calls this: the engine loop thread only. It opens and forgets sessions, brings a session's KV
to the device for a turn (``prepare_turn``), commits or rolls back a turn (``commit_turn`` /
``rollback_turn``), journals finished turns, and exports or imports a session (draining a backend).

Durability faults never fail an answer: a journal or image write that raises (a full /dev/shm,
an I/O error, the journal's own byte cap or a session's quota) leaves the answer as it is, marks the
session as not crash-recoverable (its stale journal entry is removed, so a restart never resurrects
an older transcript), counts ``journal_write_errors`` and logs once per session.

Image bytes: the encoded images of live sessions that the journal does not hold (no journal, a
failed write, a session over its quota) are kept in memory, up to ``max_kept_image_bytes`` in all,
so that an export and a later journal write have them; the journal's copy serves otherwise.

Moves (draining a backend) are two-phase. ``export`` hands a session over and marks it as moving:
it stays here, and the engine holds its requests (``session/engine/admission.py``). The move then
ends one of three ways: ``forget_moved`` (the target imported it: forgotten here), ``resume_move``
(no target took it: live here again), or ``end_overdue_moves`` after ``move_timeout_s`` with
neither (the front that began it died): live here again, so a session is never lost in transit.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
from collections import ChainMap
from collections.abc import Callable, Mapping
from typing import Protocol

import torch

from session.errors import BadRequest, CapacityExceeded, InvalidSessionId, ResidentError, SessionExists, SessionNotFound
from session.families.mrope import segment_positions
from session.families.vision import Images
from session.model.backend import ModelBackend
from session.model.kv_cache import KVCache, PagedKVCache
from session.model.prefix_cache import block_keys
from session.state.embeddings import EmbeddingCache
from session.state.journal import Journal, JournalEntry, check_entry, is_digest, validate_digest
from session.state.kv_manager import KVManager, KVNeed
from session.state.memory import MemoryManager
from session.state.session import SessionState, Tier, Turn, TurnMark
from session.state.store import SessionStore
from session.types import redact

logger = logging.getLogger(__name__)

MOVE_TIMEOUT_S = 120.0  # an exported session neither confirmed nor resumed within this is live here again
MAX_KEPT_IMAGE_BYTES = 256 << 20  # encoded images kept in memory (those the journal does not hold)


class CacheMaker(Protocol):
    """A new session's caches, and what the draft holds of a transcript. Built by the engine's
    assembly (``SessionCaches``), which knows the runner, the speculator and the cache sizes."""

    def new_kv(self) -> KVCache:
        """An empty KV cache for the target model."""
        ...

    def new_draft_kv(self) -> KVCache | None:
        """An empty KV cache for the draft model, or None without one."""
        ...

    def draft_text_tokens(self, token_ids: list[int]) -> int:
        """Tokens the (text-only) draft holds for a transcript: the image placeholders left out."""
        ...


class Sessions:
    def __init__(self, *, store: SessionStore, memory: MemoryManager, embeddings: EmbeddingCache,
                 journal: Journal | None, runner: ModelBackend, caches: CacheMaker,
                 images_from_bytes: Callable[[bytes], Images], move_timeout_s: float = MOVE_TIMEOUT_S,
                 max_kept_image_bytes: int = MAX_KEPT_IMAGE_BYTES, share_block_tokens: int = 0,
                 prefix_salt: Callable[[str | None], bytes] = lambda adapter: (adapter or "").encode()):
        self.store, self.memory, self.embeddings, self.journal = store, memory, embeddings, journal
        self.kv = KVManager(memory)  # the one owner of KV memory (the scheduler asks it through the executor)
        self.share_block_tokens = share_block_tokens  # the paged caches' block size; 0: nothing shared
        self.prefix_salt = prefix_salt  # adapter name -> what keys its blocks apart (session/model/prefix_cache.py)
        self.runner = runner
        self.caches = caches
        self.images_from_bytes = images_from_bytes  # encoded image -> Images of one (to recompute an embedding)
        self.move_timeout_s = move_timeout_s
        self.max_kept_image_bytes = max_kept_image_bytes
        self._moving: dict[str, float] = {}  # session_id -> when its move times out (the engine's clock)
        self._image_bytes: dict[str, bytes] = {}  # digest -> encoded image the journal does not hold
        self.kept_image_bytes = 0  # sum of len() over _image_bytes
        self.num_journal_restored = 0
        self.num_journal_write_errors = 0

    # ------------------------------------------------------------------ open, get, forget

    def open(self, session_id: str, *, now: float, ttl_s: float, ephemeral: bool, adapter: str | None,
             tier: Tier = Tier.DEVICE, cache_salt: str = "", tenant: str = "") -> SessionState:
        kv = self.caches.new_kv()
        if tier is not Tier.DEVICE:
            kv.release()
        session = self.store.open(SessionState(
            session_id=session_id, kv=kv, created_at=now, last_used_at=now, expires_at=now + ttl_s,
            ephemeral=ephemeral, tier=tier, adapter=adapter, cache_salt=cache_salt, tenant=tenant,
        ))
        session.draft_kv = self.caches.new_draft_kv()
        return session

    def get(self, session_id: str) -> SessionState:
        return self.store.get(session_id)

    def is_live(self, session: SessionState) -> bool:
        """Is this very session still open (not forgotten, nor replaced under its id)?"""
        return self.store.peek(session.session_id) is session

    def forget(self, session: SessionState, reason: str) -> None:
        """Close a session: free its KV, release its images, remove it from the journal."""
        self.store.close(session.session_id, reason=reason)
        self._moving.pop(session.session_id, None)
        for digest in session.image_digests:
            self._release_image(digest)
        if self.journal is not None and not session.ephemeral:
            self._journal_io(session, lambda: self.journal.remove(session.session_id))

    def reap(self) -> list[str]:
        expired = [sid for sid in self.store.expired_ids() if sid not in self._moving]  # a move ends first
        for session_id in expired:
            self.forget(self.store.get(session_id), "expired")
            logger.info("session %s expired", redact(session_id))
        return expired

    # ------------------------------------------------------------------ a turn

    def prepare_turn(self, turn: Turn, new_ids: list[int], digests: list[str],
                     total_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Take the turn's image references, bring the session's KV to the device sized for
        ``total_tokens`` (restoring or recomputing it), and embed what it has not cached.
        A session with nothing cached (new, stateless, or dropped) first takes the longest shared
        prefix of its transcript and turn from the pool's published blocks (``share_prefix``).
        Returns the embeddings to prefill [T, D] and, for an M-RoPE model, their positions [3, T]
        (else None); sets ``turn.cached_tokens`` (and ``turn.next_rope_delta``). On an exception the
        image references are given back (``turn.images_acquired`` empty) and the transcript is untouched."""
        session = turn.session
        for digest in digests:
            self.embeddings.acquire(digest)
        turn.images_acquired = tuple(digests)
        kv = session.kv
        # the transcript is (re)computed from 0 (a host copy restores what it holds: nothing is shared then)
        fresh = kv.length == 0 and (session.tier is not Tier.HOST or session.host_length == 0)
        try:
            for index, digest in enumerate(digests):
                self.embeddings.describe(digest, turn.images.num_tokens[index],
                                         turn.images.grids[index] if turn.images.grids else None)
            ids, all_digests = session.token_ids + new_ids, session.image_digests + digests
            if fresh and session.tier is not Tier.HOST and self.share_block_tokens:
                kv.release()  # what a failed first prefill left (nothing written counts)
                usable = (len(ids) - 1) // self.share_block_tokens  # at least the last token is prefilled
                kv.share_prefix(self.block_keys(session, ids, all_digests)[:usable])
            draft_tokens = self.draft_tokens(ids, total_tokens)
            need = self.kv.blocks_needed(session, total_tokens, draft_tokens)
            self.kv.admit(session, need, total_tokens, draft_tokens)
            if session.tier is Tier.HOST:
                keys = self.block_keys(session, session.token_ids, session.image_digests) if self.share_block_tokens \
                    else []
                self.memory.restore_from_host(session, keys)
            elif session.tier is Tier.DROPPED:
                session.tier = Tier.DEVICE  # the transcript is recomputed below, past any shared prefix
                self.memory.num_recomputed += 1
            turn.cached_tokens = start = kv.length
            turn.feeds_to = len(ids)
            if not fresh:  # a resident follow-up: the unfed tail (the previous answer's last token) + the turn
                segment = session.token_ids[start:] + new_ids
                images = self._image_embeddings([], digests, turn.images)
                return self.runner.embed(segment, images), self._positions(turn, segment, digests,
                                                                           start + session.rope_delta)
            # From the shared prefix's end: images wholly inside it are not embedded (nor encoded),
            # one it cuts into gives its remaining rows.
            first, offset = self._first_image_after(ids, all_digests, start)
            old = len(session.image_digests)
            images = self._image_embeddings(session.image_digests[first:], digests[max(0, first - old):],
                                            turn.images, first_new=max(0, first - old))
            if offset:
                images[0] = images[0][offset:]
            return self.runner.embed(ids[start:], images), self._positions(turn, ids, all_digests, 0, skip=start)
        except BaseException:
            if fresh and session.tier is not Tier.DEVICE:
                kv.release()  # a dropped or new-on-host session holds nothing, shared prefix included
            self.release_images(turn)
            raise

    def turn_need(self, session: SessionState, new_ids: list[int], total_tokens: int) -> KVNeed:
        """What the session's next turn (``new_ids``, sized for ``total_tokens``) asks of KV memory:
        the scheduler's question to ``self.kv`` before it begins the prefill (an upper bound)."""
        draft_tokens = self.draft_tokens(session.token_ids + new_ids, total_tokens)
        return self.kv.blocks_needed(session, total_tokens, draft_tokens)

    def draft_tokens(self, ids: list[int], total_tokens: int) -> int:
        """What the draft's cache holds for a turn over ``ids`` sized for ``total_tokens`` (text only)."""
        return self.caches.draft_text_tokens(ids) + (total_tokens - len(ids))

    def block_keys(self, session: SessionState, token_ids: list[int], digests: list[str]) -> list[bytes]:
        """The content keys of the full blocks of ``token_ids`` under the session's adapter and cache salt
        (session/model/prefix_cache.py); [] when an image's placeholder count is not known here."""
        counts = [self.embeddings.get(d).num_tokens if d in self.embeddings else None for d in digests]
        if None in counts:
            return []
        return block_keys(token_ids, self.share_block_tokens, salt=self.salt(session),
                          image_token_id=self.runner.info.image_token_id, image_digests=digests, image_counts=counts)

    def salt(self, session: SessionState) -> bytes:
        """What keys the session's shared blocks apart: its adapter's salt, and its cache salt if any."""
        salt = self.prefix_salt(session.adapter)
        return salt + b"\0" + session.cache_salt.encode() if session.cache_salt else salt

    def publish(self, session: SessionState) -> int:
        """Publish the full blocks the session's KV has written of its transcript, for other
        sessions and requests to share (after each prefill, and when an answer ends); how many."""
        if not self.share_block_tokens or session.tier is not Tier.DEVICE:
            return 0
        return session.kv.publish(self.block_keys(session, session.token_ids, session.image_digests))

    def _first_image_after(self, token_ids: list[int], digests: list[str], start: int) -> tuple[int, int]:
        """The first image occurrence with a placeholder at or after ``start``, and how many of its
        placeholders lie before ``start`` (0 when it begins there or later)."""
        if not start or not digests:
            return 0, 0
        placeholders = [i for i, t in enumerate(token_ids) if t == self.runner.info.image_token_id]
        first = 0
        for index, digest in enumerate(digests):
            count = self.embeddings.get(digest).num_tokens
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
        grids = [self.embeddings.get(d).grid for d in digests]
        positions, next_position = segment_positions(token_ids, self.runner.info.image_token_id, grids,
                                                     self.runner.merge_size, first_position)
        turn.next_rope_delta = next_position - (turn.session.kv.length - skip + len(token_ids))
        return positions[:, skip:]

    def commit_turn(self, turn: Turn, new_ids: list[int]) -> None:
        """The turn's prefill ran: its prompt joins the transcript (until a rollback)."""
        session = turn.session
        turn.mark = TurnMark(num_tokens=len(session.token_ids), num_images=len(session.image_digests),
                            num_turns=session.num_turns, ended_with_eos=session.ended_with_eos,
                            rope_delta=session.rope_delta)
        session.rope_delta = turn.next_rope_delta
        session.token_ids.extend(new_ids)
        session.image_digests.extend(turn.images_acquired)
        session.num_turns += 1
        turn.images_acquired = ()  # now the session's references
        turn.feeds_to = 0
        self.memory.note_usage()

    def rollback_turn(self, turn: Turn) -> None:
        """Undo a committed turn (cancelled or failed): transcript, images and KV as before it."""
        session, mark = turn.session, turn.mark
        turn.feeds_to = 0
        self.release_images(turn)
        if mark is None:  # not committed; the KV may have run ahead of the transcript
            self._crop_to_transcript(session)
            return
        for digest in session.image_digests[mark.num_images:]:
            self._release_image(digest)
        del session.image_digests[mark.num_images:]
        del session.token_ids[mark.num_tokens:]
        session.num_turns, session.ended_with_eos = mark.num_turns, mark.ended_with_eos
        session.rope_delta = mark.rope_delta
        self._crop_to_transcript(session)
        turn.mark = None

    def _crop_to_transcript(self, session: SessionState) -> None:
        session.kv.crop(len(session.token_ids))
        if session.tier is Tier.DEVICE and len(session.token_ids) - session.kv.length > 1:
            self.memory.drop(session)  # a recompute failed part-way: the next turn recomputes again
        elif session.draft_kv is not None:
            session.draft_kv.crop(max(0, self.caches.draft_text_tokens(session.token_ids) - 1))

    def append_token(self, session: SessionState, token: int) -> None:
        """A sampled token joins the transcript (the output processor, once per token)."""
        session.token_ids.append(token)

    def end_answer(self, session: SessionState, ended_with_eos: bool) -> None:
        """The turn's answer is complete; did it end with EOS (the template's end of turn)?"""
        session.ended_with_eos = ended_with_eos

    def release_images(self, turn: Turn) -> None:
        for digest in turn.images_acquired:
            self._release_image(digest)
        turn.images_acquired = ()

    def _release_image(self, digest: str) -> None:
        if not self.embeddings.release(digest):
            return
        self._drop_image_bytes(digest)
        if self.journal is not None and is_digest(digest):
            journal = self.journal
            self._journal_io(None, lambda: journal.remove_image(digest))

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
                to_encode[digest] = self.images_from_bytes(self._encoded_image(digest))
        if to_encode:
            batch = Images.join(to_encode.values())
            encoded = self.runner.encode_images(list(batch.pixels), list(batch.sizes), list(batch.grids) or None)
            for digest, tensor, grid in zip(to_encode, encoded, batch.grids or [None] * len(batch)):
                self.embeddings.store(digest, tensor.to("cpu", copy=True), grid)
        digests = old_digests + new_digests
        tensors = [self.embeddings.use(d).to(self.runner.device) for d in digests]
        self.embeddings.evict(self._has_encoded_image, keep=set(digests))
        return tensors

    def _count_lookup(self, digest: str) -> bool:
        """Is the image's embedding missing (to encode)? Counted as a miss, else as a hit."""
        if self.embeddings.get(digest).tensor is None:
            self.embeddings.num_misses += 1
            return True
        self.embeddings.num_hits += 1
        return False

    # ------------------------------------------------------------------ image bytes

    def _encoded_image(self, digest: str) -> bytes:
        """An image's encoded bytes: kept in memory, else from the journal. Raises ResidentError (500)
        when neither has them (an image that came without bytes, or memory for them was full)."""
        raw = self._image_bytes.get(digest)
        if raw is not None:
            return raw
        if self.journal is not None and is_digest(digest):
            try:
                return self.journal.read_image(digest)
            except OSError as exc:
                logger.warning("image %s cannot be read back from the journal: %s", digest[:12], exc)
        raise ResidentError(f"image {digest[:12]}: its bytes are neither kept in memory nor in the journal")

    def _has_encoded_image(self, digest: str) -> bool:
        """Can the image's encoded bytes be got back (kept in memory, or journaled)? The embedding
        cache's bound evicts only such images' tensors (``EmbeddingCache.evict``)."""
        return digest in self._image_bytes or (self.journal is not None and is_digest(digest)
                                               and self.journal.has_image(digest))

    def _keep_image_bytes(self, session: SessionState, image_bytes: Mapping[str, bytes]) -> None:
        """Keep the session's images from ``image_bytes`` in memory, while ``max_kept_image_bytes`` allows;
        each stays until its last reference is released (``_release_image``)."""
        for digest in dict.fromkeys(session.image_digests):
            raw = image_bytes.get(digest)
            if raw is None or digest in self._image_bytes:
                continue
            if self.kept_image_bytes + len(raw) > self.max_kept_image_bytes:
                logger.info("image %s of session %s is not kept in memory: %d bytes are already", digest[:12],
                            redact(session.session_id), self.kept_image_bytes)
                continue
            self._image_bytes[digest] = raw
            self.kept_image_bytes += len(raw)

    def _drop_image_bytes(self, digest: str) -> None:
        raw = self._image_bytes.pop(digest, None)
        if raw is not None:
            self.kept_image_bytes -= len(raw)

    # ------------------------------------------------------------------ journal

    def journal_turn(self, session: SessionState, image_bytes: Mapping[str, bytes]) -> None:
        """After a finished turn (``image_bytes``: digest -> encoded bytes of its images): keep its images'
        bytes, then journal the session, its images then its entry; the bytes the journal now holds
        leave memory. Never raises."""
        if session.ephemeral:
            return
        self._keep_image_bytes(session, image_bytes)
        if self.journal is None:
            return
        journal = self.journal
        entry = JournalEntry(
            session_id=session.session_id, token_ids=session.token_ids, image_digests=session.image_digests,
            ended_with_eos=session.ended_with_eos, num_turns=session.num_turns, created_at=session.created_at,
            expires_at=session.expires_at, adapter=session.adapter, cache_salt=session.cache_salt,
            tenant=session.tenant,
        )
        known = ChainMap(image_bytes, self._image_bytes)  # this turn's images, and those kept before
        session.recoverable = self._journal_io(session, lambda: journal.write_session(entry, known))
        if not session.recoverable:  # a stale entry would bring back an older transcript after a crash
            self._journal_io(None, lambda: journal.remove(session.session_id))
        for digest in dict.fromkeys(session.image_digests):
            if digest in self._image_bytes and is_digest(digest) and journal.has_image(digest):
                self._drop_image_bytes(digest)

    def _journal_io(self, session: SessionState | None, operation: Callable[[], None]) -> bool:
        """Run a journal operation; False when it failed (a filesystem error, a cap, or an id or digest
        that cannot name a file: BadRequest), counted and logged once per session."""
        try:
            operation()
            return True
        except (OSError, BadRequest) as exc:
            self.num_journal_write_errors += 1
            if session is None or session.recoverable:  # log once per session (until it recovers)
                logger.warning("journal write failed%s: %s", f" for session {redact(session.session_id)}; it is not "
                               "crash-recoverable until a later turn is journaled" if session else "", exc)
            return False

    def restore_journal(self, now: float) -> None:
        """At start-up: every live journaled session comes back, without KV (DROPPED tier); expired
        entries and images no session uses are purged."""
        for entry in self.journal.entries():
            if entry.expires_at <= now or entry.session_id in self.store:
                self.journal.remove(entry.session_id)
                continue
            try:
                self._check_token_ids(entry)
            except BadRequest as exc:
                logger.warning("skipping journal entry of session %s: %s", redact(entry.session_id), exc.message)
                self.journal.remove(entry.session_id)
                continue
            self._adopt(entry, now)
            self.num_journal_restored += 1
        self.journal.remove_images_except(self.embeddings)
        if self.num_journal_restored:
            logger.info("restored %d sessions from the journal at %s", self.num_journal_restored,
                        self.journal.directory)

    def _adopt(self, entry: JournalEntry, now: float) -> SessionState:
        session = self.open(entry.session_id, now=now, ttl_s=0, ephemeral=False, adapter=entry.adapter,
                            tier=Tier.DROPPED, cache_salt=entry.cache_salt, tenant=entry.tenant)
        session.created_at, session.expires_at = entry.created_at, entry.expires_at
        session.token_ids, session.image_digests = list(entry.token_ids), list(entry.image_digests)
        session.ended_with_eos, session.num_turns = entry.ended_with_eos, entry.num_turns
        for digest in session.image_digests:
            self.embeddings.acquire(digest)
        return session

    # ------------------------------------------------------------------ migration (drain)

    def export(self, session: SessionState, now: float) -> dict:
        """An idle session as JSON (transcript, image bytes, settings), for its move to another backend.
        It stays here, marked as moving, until ``forget_moved``, ``resume_move`` or its timeout
        (``end_overdue_moves``). Who calls this: the engine's admin code, once no request is in flight
        on the session and no other move of it is under way."""
        assert session.session_id not in self._moving, "a second export waits for the move under way"
        images = {d: base64.b64encode(self._encoded_image(d)).decode() for d in dict.fromkeys(session.image_digests)}
        exported = {"session_id": session.session_id, "token_ids": list(session.token_ids),
                    "image_digests": list(session.image_digests), "ended_with_eos": session.ended_with_eos,
                    "num_turns": session.num_turns, "created_at": session.created_at,
                    "expires_at": session.expires_at, "adapter": session.adapter,
                    "cache_salt": session.cache_salt, "tenant": session.tenant, "images": images}
        self._moving[session.session_id] = now + self.move_timeout_s
        return exported

    def is_moving(self, session_id: str) -> bool:
        """Exported, and its move neither confirmed nor aborted yet."""
        return session_id in self._moving

    def forget_moved(self, session: SessionState) -> None:
        """The move is confirmed (the target imported the session): forget it here. Raises SessionExists
        when it is not moving (never exported, or its move timed out and it serves here again): then
        the caller must drop the copy it imported elsewhere, not this one."""
        if self._moving.pop(session.session_id, None) is None:
            raise SessionExists(f"session {session.session_id} is live on this backend, not moving (its move timed "
                                f"out after {self.move_timeout_s:g} s, or it was never exported); it stays here")
        self.forget(session, "moved to another backend")

    def resume_move(self, session: SessionState) -> bool:
        """The move is aborted (no target took the session): it serves here again. Whether it was moving."""
        return self._moving.pop(session.session_id, None) is not None

    def end_overdue_moves(self, now: float) -> list[str]:
        """Moves neither confirmed nor aborted within ``move_timeout_s`` (the front that began them died):
        those sessions serve here again. Returns their ids. Who calls this: the engine's admission, with
        the reaper."""
        overdue = [sid for sid, deadline in self._moving.items() if deadline <= now]
        for session_id in overdue:
            del self._moving[session_id]
            logger.warning("the move of session %s was neither confirmed nor aborted within %g s; it serves "
                           "here again", redact(session_id), self.move_timeout_s)
        return overdue

    def import_(self, exported: dict, now: float) -> SessionState:
        """Open an exported session here, KV recomputed on its next request. Checked like a journal entry
        (``check_entry``), each image against its digest; refused with nothing left behind."""
        if not isinstance(exported, dict):
            raise BadRequest("import needs the exported session object in 'session'")
        try:
            entry = check_entry({k: v for k, v in exported.items() if k != "images"})
            images = _decode_images(exported.get("images", {}))
            self._check_token_ids(entry)
        except InvalidSessionId:
            raise
        except BadRequest as exc:
            raise BadRequest(f"not an exported session: {exc.message}") from None
        if entry.session_id in self.store:
            raise SessionExists(f"session {entry.session_id} is already live on this backend")
        for digest in entry.image_digests:
            if digest not in images and not self._has_encoded_image(digest):
                raise SessionNotFound(f"session {entry.session_id}: image {digest[:12]} is missing from the export")
        session = self._adopt(entry, now)
        self.journal_turn(session, images)
        lacking = [d for d in dict.fromkeys(session.image_digests) if not self._has_encoded_image(d)]
        if lacking:  # its KV could never be recomputed here
            self.forget(session, "closed")
            raise CapacityExceeded(f"session {entry.session_id}: no room to keep image {lacking[0][:12]} (memory for "
                                   "images is full and the journal did not take it)", retry_after_s=5)
        return session

    def _check_token_ids(self, entry: JournalEntry) -> None:
        """Token ids the model can embed (an id past the vocabulary fails on the device, not here)."""
        vocab_size = self.runner.info.vocab_size
        if any(t >= vocab_size for t in entry.token_ids):
            raise BadRequest(f"token_ids must be below the model's vocabulary size {vocab_size}")

    # ------------------------------------------------------------------ invariant

    def check(self, active: Mapping[str, object]) -> list[str]:
        """Violations of the sessions' invariant: on the device, the KV holds the transcript but at most
        its last token (sampled, fed by the next step), or, while a turn's prefill runs in chunks, that
        and part of the turn; elsewhere no device bytes are held; a session is busy only with a request
        in flight (``active``: session id -> the scheduler's sequence, with its ``turn``), and never
        while moving."""
        problems = [f"session {sid}: moving but not live" for sid in self._moving if sid not in self.store]
        for session in self.store.all_sessions():
            if session.busy and session.session_id not in active:
                problems.append(f"session {session.session_id}: busy without a request in flight")
            if session.busy and session.session_id in self._moving:
                problems.append(f"session {session.session_id}: a request in flight while it is moving")
            gap = len(session.token_ids) - session.kv.length
            turn = getattr(active.get(session.session_id), "turn", None)
            if turn is not None and turn.feeds_to and turn.mark is None:  # its prefill under way
                if not turn.cached_tokens <= session.kv.length <= turn.feeds_to:
                    problems.append(f"session {session.session_id}: KV holds {session.kv.length} tokens, its "
                                    f"prefill from {turn.cached_tokens} to {turn.feeds_to}")
            elif session.tier is Tier.DEVICE and not 0 <= gap <= 1:
                problems.append(f"session {session.session_id}: KV holds {session.kv.length} tokens, "
                                f"transcript {len(session.token_ids)}")
            if session.tier is not Tier.DEVICE and session.kv.length:
                problems.append(f"session {session.session_id}: {session.tier.value} tier but KV on the device")
        return problems + self._check_blocks()

    def _check_blocks(self) -> list[str]:
        """Every paged pool's own invariant over the block tables of every live session (and draft)."""
        pools = {id(p): p for p in getattr(self.memory.blocks, "pools", ())}
        tables: dict[int, list[list[int]]] = {key: [] for key in pools}
        for session in self.store.all_sessions():
            for kv in (session.kv, session.draft_kv):
                if isinstance(kv, PagedKVCache):
                    pools.setdefault(id(kv.pool), kv.pool)
                    tables.setdefault(id(kv.pool), []).append(kv.block_ids)
        return [f"KV pool: {problem}" for key, pool in pools.items() for problem in pool.blocks.check(tables[key])]


def _decode_images(images: object) -> dict[str, bytes]:
    """An export's images (digest -> base64) as bytes, each checked against its sha256 digest: a shared
    embedding is keyed by digest, so a wrong pair would feed another session's image to others."""
    if not isinstance(images, dict):
        raise BadRequest("images must be an object of digest -> base64 bytes")
    decoded = {}
    for digest, encoded in images.items():
        validate_digest(digest)
        try:
            raw = base64.b64decode(encoded, validate=True)
        except (TypeError, ValueError, binascii.Error):
            raise BadRequest(f"image {digest[:12]} is not valid base64") from None
        if hashlib.sha256(raw).hexdigest() != digest:
            raise BadRequest(f"image {digest[:12]}: its bytes do not hash to its digest")
        decoded[digest] = raw
    return decoded

