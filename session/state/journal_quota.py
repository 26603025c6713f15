"""The journal's bounds: the errors a write past them raises, and the share each session and tenant holds.

Bounds: the journal holds at most ``max_bytes``, one session at most ``session_max_bytes`` (its entry
and the images no other journaled session names), and one tenant's sessions together at most
``tenant_max_bytes``, so one client's few large images, or one tenant's many sessions, cannot take
the room every other session's crash recovery needs. A write past either raises
``JournalFull`` (an OSError, ENOSPC; ``JournalSessionFull`` for the quota, EDQUOT) before anything
is written, like a full disk would, and the caller treats both the same way (docs/ENGINE.md,
"durability faults").

``JournalQuota`` is plain bookkeeping (ids, digests and byte counts, no files): which images each
journaled entry names and the bytes charged to each tenant. Who calls this: ``Journal``
(session/state/journal.py), which owns one, on the engine loop thread; the journal-wide cap is
the journal's own (it counts every file).
"""

from __future__ import annotations

import errno
from collections import Counter
from collections.abc import Collection

from session.state.journal_entry import JournalEntry
from session.types import redact


class JournalFull(OSError):
    def __init__(self, need: int, max_bytes: int):
        super().__init__(errno.ENOSPC, f"the journal would exceed its cap of {max_bytes} bytes (+{need})")


class JournalTenantFull(JournalFull):
    """One tenant's sessions would take more of the journal than its share (RESIDENT_JOURNAL_TENANT_MAX_BYTES)."""

    def __init__(self, need: int, max_bytes: int):
        OSError.__init__(self, errno.EDQUOT, f"this tenant's sessions would take {need} bytes of the journal; its "
                                             f"share is {max_bytes} (RESIDENT_JOURNAL_TENANT_MAX_BYTES)")


class JournalSessionFull(JournalFull):
    """One session would take more of the journal than its quota (RESIDENT_JOURNAL_SESSION_MAX_BYTES)."""

    def __init__(self, session_id: str, need: int, max_bytes: int):
        OSError.__init__(self, errno.EDQUOT, f"session {redact(session_id)} would take {need} bytes of the journal; its "
                                             f"quota is {max_bytes} (RESIDENT_JOURNAL_SESSION_MAX_BYTES)")


class JournalQuota:
    """Each journaled session's share of the journal, and each tenant's (see the module). The
    journal tells the bytes (it knows the files); this keeps who names what and who holds how much."""

    def __init__(self, session_max_bytes: int = 0, tenant_max_bytes: int = 0):
        self.session_max_bytes = session_max_bytes  # 0: no quota per session
        self.tenant_max_bytes = tenant_max_bytes  # 0: no share per tenant
        self._charged: dict[str, tuple[str, int]] = {}  # session_id -> (tenant, the bytes counted against it)
        self._tenant_bytes: Counter[str] = Counter()  # tenant -> the bytes charged to its sessions
        self._digests_of: dict[str, frozenset[str]] = {}  # session_id -> the digests its journaled entry names
        self._num_refs: Counter[str] = Counter()  # digest -> journaled entries naming it

    @property
    def enabled(self) -> bool:
        """Whether there is a quota per session or a share per tenant: without, nothing needs counting."""
        return bool(self.session_max_bytes or self.tenant_max_bytes)

    def check(self, entry: JournalEntry, total: int) -> None:
        """Raise JournalSessionFull when ``total`` (the bytes of the session's entry and of the images
        only it names: ``own_digests``) passes its quota, JournalTenantFull when it would take its
        tenant past its share."""
        if self.session_max_bytes and total > self.session_max_bytes:
            raise JournalSessionFull(entry.session_id, total, self.session_max_bytes)
        if self.tenant_max_bytes:
            before = self._charged.get(entry.session_id, ("", 0))
            after = self._tenant_bytes[entry.tenant] - (before[1] if before[0] == entry.tenant else 0) + total
            if after > self.tenant_max_bytes:
                raise JournalTenantFull(after, self.tenant_max_bytes)

    def own_digests(self, entry: JournalEntry) -> list[str]:
        """The images the entry names that no other journaled entry names (dropping it would free them)."""
        own = self._digests_of.get(entry.session_id, frozenset())
        return [digest for digest in set(entry.image_digests) if self._num_refs[digest] - (digest in own) <= 0]

    def charge(self, session_id: str, tenant: str, nbytes: int) -> None:
        """Count ``nbytes`` of the journal against ``tenant`` for this session (0: the session left)."""
        old_tenant, old = self._charged.pop(session_id, ("", 0))
        self._tenant_bytes[old_tenant] -= old
        if self._tenant_bytes[old_tenant] <= 0:
            del self._tenant_bytes[old_tenant]
        if nbytes:
            self._charged[session_id] = (tenant, nbytes)
            self._tenant_bytes[tenant] += nbytes

    def note_refs(self, session_id: str, digests: Collection[str]) -> None:
        """The session's journaled entry now names ``digests`` (none: it left the journal)."""
        old = self._digests_of.pop(session_id, frozenset())
        self._num_refs.subtract(old)
        for digest in old:
            if self._num_refs[digest] <= 0:
                del self._num_refs[digest]
        if digests:
            self._digests_of[session_id] = frozenset(digests)
            self._num_refs.update(self._digests_of[session_id])

    def clear(self) -> None:
        """Forget every session: the journal is read back from disk (``Journal.entries``)."""
        self._charged.clear()
        self._tenant_bytes.clear()
        self._digests_of.clear()
        self._num_refs.clear()
