"""The sessions' state: store, memory tiers, image embeddings and journal, behind one owner.

Who calls this: the engine loop thread only. It opens and forgets sessions, brings a session's KV
to the device for a turn (``prepare_turn``), commits or rolls back a turn (``commit_turn`` /
``rollback_turn``), journals finished turns, and exports or imports a session (draining a backend).

Durability faults never fail an answer: a journal or image write that raises (a full /dev/shm,
an I/O error, the journal's own byte cap) leaves the answer as it is, marks the session as not
crash-recoverable (its stale journal entry is removed, so a restart never resurrects an older
transcript), counts ``journal_write_errors`` and logs once per session.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable
from typing import Protocol

import torch

from session.errors import BadRequest, SessionExists, SessionNotFound
from session.families.mrope import segment_positions
from session.families.vision import Images
from session.model.backend import ModelBackend
from session.model.kv_cache import KVCache
from session.state.embeddings import EmbeddingCache
from session.state.journal import Journal, JournalEntry
from session.state.memory import MemoryManager, kv_bytes
from session.state.session import SessionState, Tier, Turn, TurnMark
from session.state.store import SessionStore
from session.types import validate_session_id

logger = logging.getLogger(__name__)


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
                 images_from_bytes: Callable[[bytes], Images]):
        self.store, self.memory, self.embeddings, self.journal = store, memory, embeddings, journal
        self.runner = runner
        self.caches = caches
        self.images_from_bytes = images_from_bytes  # encoded image -> Images of one (images from the journal)
        self.num_journal_restored = 0
        self.num_journal_write_errors = 0

    # ------------------------------------------------------------------ open, get, forget

    def open(self, session_id: str, *, now: float, ttl_s: float, ephemeral: bool, adapter: str | None,
             tier: Tier = Tier.DEVICE) -> SessionState:
        kv = self.caches.new_kv()
        if tier is not Tier.DEVICE:
            kv.release()
        session = self.store.open(SessionState(
            session_id=session_id, kv=kv, created_at=now, last_used_at=now, expires_at=now + ttl_s,
            ephemeral=ephemeral, tier=tier, adapter=adapter,
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
        for digest in session.image_digests:
            self._release_image(digest)
        if self.journal is not None and not session.ephemeral:
            self._journal_io(session, lambda: self.journal.remove(session.session_id))

    def reap(self) -> list[str]:
        expired = self.store.expired_ids()
        for session_id in expired:
            self.forget(self.store.get(session_id), "expired")
            logger.info("session %s expired", session_id)
        return expired

    # ------------------------------------------------------------------ a turn

    def prepare_turn(self, turn: Turn, new_ids: list[int], digests: list[str],
                     total_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Take the turn's image references, bring the session's KV to the device sized for
        ``total_tokens`` (restoring or recomputing it), and embed what it has not cached.
        Returns the embeddings to prefill [T, D] and, for an M-RoPE model, their positions [3, T]
        (else None); sets ``turn.cached_tokens`` (and ``turn.next_rope_delta``). On an exception the
        image references are given back (``turn.images_acquired`` empty) and the transcript is untouched."""
        session = turn.session
        for digest in digests:
            self.embeddings.acquire(digest)
        turn.images_acquired = tuple(digests)
        try:
            kv = session.kv
            held = kv.nbytes if session.tier is Tier.DEVICE else 0
            need = kv_bytes(kv, total_tokens) - held
            draft_tokens = self.caches.draft_text_tokens(session.token_ids + new_ids) + (total_tokens - len(
                session.token_ids) - len(new_ids))
            if session.draft_kv is not None:  # the draft reads the text only (no image placeholders)
                need += kv_bytes(session.draft_kv, draft_tokens) - session.draft_kv.nbytes
            self.memory.reserve(session, need)
            if session.draft_kv is not None:
                session.draft_kv.ensure_capacity(draft_tokens)
            kv.ensure_capacity(total_tokens)
            if session.tier is Tier.HOST:
                self.memory.restore_from_host(session)
            elif session.tier is Tier.DROPPED:
                session.tier = Tier.DEVICE  # kv.length is 0: the whole transcript is recomputed below
                self.memory.num_recomputed += 1
            turn.cached_tokens = kv.length
            # The transcript's unfed tail: normally the previous answer's last token; all of it after a drop.
            old_digests = session.image_digests if kv.length == 0 else []
            images = self._image_embeddings(old_digests, digests, turn.images)
            segment = session.token_ids[kv.length:] + new_ids
            return self.runner.embed(segment, images), self._positions(turn, segment, old_digests + digests)
        except BaseException:
            self.release_images(turn)
            raise

    def _positions(self, turn: Turn, segment: list[int], digests: list[str]) -> torch.Tensor | None:
        """M-RoPE positions of a prefill segment (None for other models): it starts at the session's
        next position (0 when its whole transcript is recomputed), its images laid out by their grids."""
        if not self.runner.mrope:
            return None
        session, cached = turn.session, turn.session.kv.length
        start = cached + session.rope_delta if cached else 0
        grids = [self.embeddings.get(d).grid for d in digests]
        positions, next_position = segment_positions(segment, self.runner.info.image_token_id, grids,
                                                     self.runner.merge_size, start)
        turn.next_rope_delta = next_position - (cached + len(segment))
        return positions

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
        self.memory.note_usage()

    def rollback_turn(self, turn: Turn) -> None:
        """Undo a committed turn (cancelled or failed): transcript, images and KV as before it."""
        session, mark = turn.session, turn.mark
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
        if self.embeddings.release(digest) and self.journal is not None:
            journal = self.journal
            self._journal_io(None, lambda: journal.remove_image(digest))

    def _image_embeddings(self, old_digests: list[str], new_digests: list[str], images: Images) -> list[torch.Tensor]:
        """Embeddings for each image occurrence, encoding only those no session has encoded yet."""
        to_encode: dict[str, Images] = {}  # digest -> that one image
        for index, digest in enumerate(new_digests):
            if self.embeddings.get(digest).tensor is None:
                to_encode.setdefault(digest, images.select(index))
                self.embeddings.num_misses += 1
            else:
                self.embeddings.num_hits += 1
        for digest in old_digests:
            if self.embeddings.get(digest).tensor is None and digest not in to_encode:
                to_encode[digest] = self._image_from_journal(digest)
        if to_encode:
            batch = Images.join(to_encode.values())
            encoded = self.runner.encode_images(list(batch.pixels), list(batch.sizes), list(batch.grids) or None)
            for digest, tensor, grid in zip(to_encode, encoded, batch.grids or [None] * len(batch)):
                entry = self.embeddings.get(digest)
                entry.tensor, entry.grid = tensor.to("cpu", copy=True), grid
        return [self.embeddings.get(d).tensor.to(self.runner.device) for d in old_digests + new_digests]

    def _image_from_journal(self, digest: str) -> Images:
        if self.journal is None:
            raise RuntimeError(f"image {digest[:12]} has no embedding and no journal to recompute it from")
        return self.images_from_bytes(self.journal.read_image(digest))

    # ------------------------------------------------------------------ journal

    def journal_turn(self, session: SessionState, image_bytes: dict[str, bytes]) -> None:
        """After a finished turn: write its new images, then the session's entry. Never raises."""
        if self.journal is None or session.ephemeral:
            return
        journal = self.journal

        def write() -> None:
            for digest in session.image_digests:
                if not journal.has_image(digest):
                    if digest not in image_bytes:
                        raise FileNotFoundError(f"image {digest[:12]} is not in the journal")
                    journal.write_image(digest, image_bytes[digest])
            journal.write(JournalEntry(
                session_id=session.session_id, token_ids=session.token_ids, image_digests=session.image_digests,
                ended_with_eos=session.ended_with_eos, num_turns=session.num_turns, created_at=session.created_at,
                expires_at=session.expires_at, adapter=session.adapter,
            ))

        session.recoverable = self._journal_io(session, write)
        if not session.recoverable:  # a stale entry would bring back an older transcript after a crash
            self._journal_io(None, lambda: journal.remove(session.session_id))

    def _journal_io(self, session: SessionState | None, operation: Callable[[], None]) -> bool:
        try:
            operation()
            return True
        except OSError as exc:
            self.num_journal_write_errors += 1
            if session is None or session.recoverable:  # log once per session (until it recovers)
                logger.warning("journal write failed%s: %s", f" for session {session.session_id}; it is not "
                               "crash-recoverable until a later turn is journaled" if session else "", exc)
            return False

    def restore_journal(self, now: float) -> None:
        """At start-up: every live journaled session comes back, without KV (DROPPED tier); expired
        entries and images no session uses are purged."""
        for entry in self.journal.entries():
            if entry.expires_at <= now or entry.session_id in self.store:
                self.journal.remove(entry.session_id)
                continue
            self._adopt(entry, now)
            self.num_journal_restored += 1
        for path in self.journal.images_dir.iterdir():
            if path.name not in self.embeddings:
                self.journal.remove_image(path.name)
        if self.num_journal_restored:
            logger.info("restored %d sessions from the journal at %s", self.num_journal_restored,
                        self.journal.directory)

    def _adopt(self, entry: JournalEntry, now: float) -> SessionState:
        session = self.open(entry.session_id, now=now, ttl_s=0, ephemeral=False, adapter=entry.adapter,
                            tier=Tier.DROPPED)
        session.created_at, session.expires_at = entry.created_at, entry.expires_at
        session.token_ids, session.image_digests = list(entry.token_ids), list(entry.image_digests)
        session.ended_with_eos, session.num_turns = entry.ended_with_eos, entry.num_turns
        for digest in session.image_digests:
            self.embeddings.acquire(digest)
        return session

    # ------------------------------------------------------------------ migration (drain)

    def export(self, session: SessionState) -> dict:
        """An idle session as JSON (transcript and images), then forgotten here ("moved")."""
        if self.journal is None:
            raise BadRequest("exporting a session needs the journal (RESIDENT_JOURNAL_DIR)")
        images = {d: base64.b64encode(self.journal.read_image(d)).decode() for d in dict.fromkeys(session.image_digests)}
        exported = {"session_id": session.session_id, "token_ids": list(session.token_ids),
                    "image_digests": list(session.image_digests), "ended_with_eos": session.ended_with_eos,
                    "num_turns": session.num_turns, "created_at": session.created_at,
                    "expires_at": session.expires_at, "adapter": session.adapter, "images": images}
        self.forget(session, "moved to another backend")
        return exported

    def import_(self, exported: dict, now: float) -> SessionState:
        """Open an exported session here, KV recomputed on its next request."""
        try:
            entry = JournalEntry(**{k: v for k, v in exported.items() if k != "images"})
            images = {d: base64.b64decode(raw, validate=True) for d, raw in exported.get("images", {}).items()}
            if not all(isinstance(t, int) for t in entry.token_ids) or not all(
                    isinstance(d, str) and "/" not in d for d in [*entry.image_digests, *images]):
                raise ValueError("token_ids must be integers and image digests plain names")
            validate_session_id(entry.session_id)
        except (TypeError, ValueError, AttributeError) as exc:
            raise BadRequest(f"not an exported session: {exc}") from None
        if entry.session_id in self.store:
            raise SessionExists(f"session {entry.session_id} is already live on this backend")
        if self.journal is not None:
            for digest, raw in images.items():
                self.journal.write_image(digest, raw)
        session = self._adopt(entry, now)
        for digest in session.image_digests:
            if self.journal is None or not self.journal.has_image(digest):
                self.forget(session, "closed")
                raise SessionNotFound(f"session {entry.session_id}: image {digest[:12]} is missing from the export")
        self.journal_turn(session, images)
        return session

    # ------------------------------------------------------------------ invariant

    def check(self, active_ids) -> list[str]:
        """Violations of the sessions' invariant: on the device, the KV holds the transcript but at most
        its last token (sampled, fed by the next step); elsewhere no device bytes are held; a session is
        busy only with a request in flight (``active_ids``: the scheduler's)."""
        problems = []
        for session in self.store.all_sessions():
            if session.busy and session.session_id not in active_ids:
                problems.append(f"session {session.session_id}: busy without a request in flight")
            gap = len(session.token_ids) - session.kv.length
            if session.tier is Tier.DEVICE and not 0 <= gap <= 1:
                problems.append(f"session {session.session_id}: KV holds {session.kv.length} tokens, "
                                f"transcript {len(session.token_ids)}")
            if session.tier is not Tier.DEVICE and session.kv.length:
                problems.append(f"session {session.session_id}: {session.tier.value} tier but KV on the device")
        return problems
