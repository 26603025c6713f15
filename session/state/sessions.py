"""The sessions' state: store, memory tiers, image embeddings and journal, behind one owner.

Who calls this: the engine loop thread only. It opens and forgets sessions, brings a session's KV
to the device for a turn (``prepare_turn``), commits or rolls back a turn (``commit_turn`` /
``rollback_turn``), journals finished turns, and exports or imports a session (draining a backend).
Its helpers, one job each: ``turn_inputs`` (what a turn's prefill is fed), ``image_bytes`` (the
encoded images the journal does not hold, kept in memory for an export or a later journal write)
and ``migration`` (the moves under way, two-phase, and the export's form).

Durability faults never fail an answer: a journal or image write that raises (a full /dev/shm,
an I/O error, the journal's own byte cap or a session's quota) leaves the answer as it is, marks the
session as not crash-recoverable (its stale journal entry is removed, so a restart never resurrects
an older transcript), counts ``journal_write_errors`` and logs once per session.

A move (``export``) ends one of three ways: ``forget_moved`` (the target imported it),
``resume_move`` (no target took it), or ``end_overdue_moves`` after ``move_timeout_s`` with neither:
live here again, so a session is never lost in transit (session/state/migration.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Protocol

import torch

from session.errors import BadRequest, CapacityExceeded, SessionExists, SessionNotFound
from session.families.vision import Images
from session.model.backend import ModelBackend
from session.model.kv_cache import KVCache
from session.model.prefix_cache import block_keys
from session.state.embeddings import EmbeddingCache
from session.state.image_bytes import MAX_KEPT_IMAGE_BYTES, ImageBytes
from session.state.invariants import block_problems, session_problems
from session.state.journal import Journal, JournalEntry, is_digest
from session.state.kv_manager import KVManager, KVNeed
from session.state.memory import MemoryManager
from session.state.migration import MOVE_TIMEOUT_S, Moves, check_token_ids, export_session, parse_export
from session.state.session import SessionState, Tier, Turn, TurnMark
from session.state.store import SessionStore
from session.state.turn_inputs import TurnInputs
from session.types import redact

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
                 images_from_bytes: Callable[[bytes], Images], move_timeout_s: float = MOVE_TIMEOUT_S,
                 max_kept_image_bytes: int = MAX_KEPT_IMAGE_BYTES, share_block_tokens: int = 0,
                 prefix_salt: Callable[[str | None], bytes] = lambda adapter: (adapter or "").encode()):
        self.store, self.memory, self.embeddings, self.journal = store, memory, embeddings, journal
        self.kv = KVManager(memory)  # the one owner of KV memory (the scheduler asks it through the executor)
        self.share_block_tokens = share_block_tokens  # the paged caches' block size; 0: nothing shared
        self.prefix_salt = prefix_salt  # adapter name -> what keys its blocks apart (session/model/prefix_cache.py)
        self.runner = runner
        self.caches = caches
        self.moves = Moves(move_timeout_s)  # the sessions exported, not yet confirmed or resumed
        self.encoded_images = ImageBytes(journal, max_kept_image_bytes)
        self.inputs = TurnInputs(runner=runner, embeddings=embeddings, encoded_images=self.encoded_images,
                                 images_from_bytes=images_from_bytes)
        self.num_journal_restored = 0
        self.num_journal_write_errors = 0

    @property
    def kept_image_bytes(self) -> int:
        """Bytes of encoded images kept in memory (those the journal does not hold)."""
        return self.encoded_images.num_bytes

    # ------------------------------------------------------------------ open, get, forget

    def open(self, session_id: str, *, now: float, ttl_s: float, ephemeral: bool, adapter: str | None,
             tier: Tier = Tier.DEVICE, cache_salt: str = "", tenant: str = "") -> SessionState:
        kv = self.caches.new_kv()
        if tier is not Tier.DEVICE:
            kv.release()
        try:
            session = self.store.open(SessionState(
                session_id=session_id, kv=kv, created_at=now, last_used_at=now, expires_at=now + ttl_s,
                ephemeral=ephemeral, tier=tier, adapter=adapter, cache_salt=cache_salt, tenant=tenant,
            ))
        except BaseException:
            kv.release()
            raise
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
        self.moves.end(session.session_id)
        for digest in session.image_digests:
            self._release_image(digest)
        journal = self.journal
        if journal is not None and not session.ephemeral:
            self._journal_io(session, lambda: journal.remove(session.session_id))

    def reap(self) -> list[str]:
        expired = [sid for sid in self.store.expired_ids() if sid not in self.moves]  # a move ends first
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
        prefix of its transcript and turn from the pool's published blocks (``_share_prefix``).
        Returns the embeddings to prefill [T, D] and, for an M-RoPE model, their positions [3, T]
        (else None); sets ``turn.cached_tokens`` (and ``turn.next_rope_delta``). On an exception the
        image references are given back (``turn.images_acquired`` empty) and the transcript is untouched.
        Who calls this: the executor, when a turn's prefill begins."""
        session = turn.session
        self._take_images(turn, digests)
        # the transcript is (re)computed from 0 (a host copy restores what it holds: nothing is shared then)
        fresh = session.kv.length == 0 and (session.tier is not Tier.HOST or session.host_length == 0)
        try:
            self._describe_images(turn, digests)
            ids, all_digests = session.token_ids + new_ids, session.image_digests + digests
            if fresh and session.tier is not Tier.HOST and self.share_block_tokens:
                self._share_prefix(session, ids, all_digests)
            self._take_room(session, ids, total_tokens)
            self._bring_to_device(session)
            turn.cached_tokens = session.kv.length
            turn.feeds_to = len(ids)
            return self.inputs.embed(turn, new_ids, digests, fresh)
        except BaseException:
            if fresh and session.tier is not Tier.DEVICE:
                session.kv.release()  # a dropped or new-on-host session holds nothing, shared prefix included
            self.release_images(turn)
            raise

    def _take_images(self, turn: Turn, digests: list[str]) -> None:
        """The turn holds a reference to each of its images (given back by ``release_images``)."""
        for digest in digests:
            self.embeddings.acquire(digest)
        turn.images_acquired = tuple(digests)

    def _describe_images(self, turn: Turn, digests: list[str]) -> None:
        """Each image's placeholder count (and grid): the shared blocks' keys and the embedding need them."""
        for index, digest in enumerate(digests):
            self.embeddings.describe(digest, turn.images.num_tokens[index],
                                     turn.images.grids[index] if turn.images.grids else None)

    def _share_prefix(self, session: SessionState, ids: list[int], digests: list[str]) -> None:
        """A session computed from 0 takes the longest prefix of ``ids`` the pool has published."""
        session.kv.release()  # what a failed first prefill left (nothing written counts)
        usable = (len(ids) - 1) // self.share_block_tokens  # at least the last token is prefilled
        session.kv.share_prefix(self.block_keys(session, ids, digests)[:usable])

    def _take_room(self, session: SessionState, ids: list[int], total_tokens: int) -> None:
        """The KV memory the turn needs (``self.kv`` demotes or evicts for it, or raises CapacityExceeded)."""
        draft_tokens = self.draft_tokens(ids, total_tokens)
        need = self.kv.blocks_needed(session, total_tokens, draft_tokens)
        self.kv.admit(session, need, total_tokens, draft_tokens)

    def _bring_to_device(self, session: SessionState) -> None:
        """A host copy is restored (sharing the published prefix); a dropped transcript is recomputed
        by the prefill (past any shared prefix)."""
        if session.tier is Tier.HOST:
            keys = self.block_keys(session, session.token_ids, session.image_digests) if self.share_block_tokens \
                else []
            self.memory.restore_from_host(session, keys)
        elif session.tier is Tier.DROPPED:
            session.tier = Tier.DEVICE
            self.memory.num_recomputed += 1

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
        counts: list[int] = []
        for digest in digests:
            count = self.embeddings.get(digest).num_tokens if digest in self.embeddings else None
            if count is None:
                return []
            counts.append(count)
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
        self.encoded_images.drop(digest)
        if self.journal is not None and is_digest(digest):
            journal = self.journal
            self._journal_io(None, lambda: journal.remove_image(digest))

    # ------------------------------------------------------------------ journal

    def journal_turn(self, session: SessionState, image_bytes: Mapping[str, bytes]) -> None:
        """After a finished turn (``image_bytes``: digest -> encoded bytes of its images): keep its images'
        bytes, then journal the session, its images then its entry; the bytes the journal now holds
        leave memory. Never raises."""
        if session.ephemeral:
            return
        self.encoded_images.keep(session, image_bytes)
        if self.journal is None:
            return
        journal = self.journal
        entry = JournalEntry(
            session_id=session.session_id, token_ids=session.token_ids, image_digests=session.image_digests,
            ended_with_eos=session.ended_with_eos, num_turns=session.num_turns, created_at=session.created_at,
            expires_at=session.expires_at, adapter=session.adapter, cache_salt=session.cache_salt,
            tenant=session.tenant,
        )
        # this turn's images (first), and those kept before; merged, as ChainMap's typing asks for mutable maps
        known: Mapping[str, bytes] = {**self.encoded_images.kept, **image_bytes}
        session.recoverable = self._journal_io(session, lambda: journal.write_session(entry, known))
        if not session.recoverable:  # a stale entry would bring back an older transcript after a crash
            self._journal_io(None, lambda: journal.remove(session.session_id))
        self.encoded_images.drop_journaled(session.image_digests)

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
        journal = self.journal
        assert journal is not None, "restore_journal is called only with a journal (the engine loop checks)"
        for entry in journal.entries():
            if entry.expires_at <= now or entry.session_id in self.store:
                journal.remove(entry.session_id)
                continue
            try:
                check_token_ids(entry, self.runner.info.vocab_size)
            except BadRequest as exc:
                logger.warning("skipping journal entry of session %s: %s", redact(entry.session_id), exc.message)
                journal.remove(entry.session_id)
                continue
            self._adopt(entry, now)
            self.num_journal_restored += 1
        journal.remove_images_except(self.embeddings)
        if self.num_journal_restored:
            logger.info("restored %d sessions from the journal at %s", self.num_journal_restored, journal.directory)

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
        assert session.session_id not in self.moves, "a second export waits for the move under way"
        exported = export_session(session, self.encoded_images.read)
        self.moves.begin(session.session_id, now)
        return exported

    def is_moving(self, session_id: str) -> bool:
        """Exported, and its move neither confirmed nor aborted yet."""
        return session_id in self.moves

    def forget_moved(self, session: SessionState) -> None:
        """The move is confirmed (the target imported the session): forget it here. Raises SessionExists
        when it is not moving (never exported, or its move timed out and it serves here again): then
        the caller must drop the copy it imported elsewhere, not this one."""
        if not self.moves.end(session.session_id):
            raise SessionExists(f"session {session.session_id} is live on this backend, not moving (its move timed "
                                f"out after {self.moves.timeout_s:g} s, or it was never exported); it stays here")
        self.forget(session, "moved to another backend")

    def resume_move(self, session: SessionState) -> bool:
        """The move is aborted (no target took the session): it serves here again. Whether it was moving."""
        return self.moves.end(session.session_id)

    def end_overdue_moves(self, now: float) -> list[str]:
        """Moves neither confirmed nor aborted within ``move_timeout_s`` (the front that began them died):
        those sessions serve here again. Returns their ids. Who calls this: the engine's admission, with
        the reaper."""
        return self.moves.end_overdue(now)

    def import_(self, exported: dict, now: float) -> SessionState:
        """Open an exported session here, KV recomputed on its next request. Checked like a journal entry
        (``check_entry``), each image against its digest; refused with nothing left behind."""
        entry, images = parse_export(exported, self.runner.info.vocab_size)
        if entry.session_id in self.store:
            raise SessionExists(f"session {entry.session_id} is already live on this backend")
        for digest in entry.image_digests:
            if digest not in images and not self.encoded_images.has(digest):
                raise SessionNotFound(f"session {entry.session_id}: image {digest[:12]} is missing from the export")
        session = self._adopt(entry, now)
        self.journal_turn(session, images)
        lacking = [d for d in dict.fromkeys(session.image_digests) if not self.encoded_images.has(d)]
        if lacking:  # its KV could never be recomputed here
            self.forget(session, "closed")
            raise CapacityExceeded(f"session {entry.session_id}: no room to keep image {lacking[0][:12]} (memory for "
                                   "images is full and the journal did not take it)", retry_after_s=5)
        return session

    # ------------------------------------------------------------------ invariant

    def check(self, active: Mapping[str, object]) -> list[str]:
        """Violations of the sessions' invariant (session/state/invariants.py); ``active``: session id ->
        the scheduler's sequence in flight, with its ``turn``. Who calls this: the engine, after a step."""
        return session_problems(self.store, self.moves, active) + block_problems(self.store, self.memory.blocks)
