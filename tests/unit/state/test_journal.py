"""The journal on its own: what it reads back is checked before it names a file, it opens only a
directory of its own under trusted parents and trusts no path twice, images are verified by their
hash, it caps each session's share, and it fsyncs where that buys durability."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from session.errors import BadRequest, ConfigError, InvalidSessionId
from session.state.journal import Journal, JournalImageCorrupt
from session.state.journal_entry import JournalEntry
from session.state.journal_files import filesystem_type, mount_type
from session.state.journal_quota import JournalFull, JournalQuota, JournalSessionFull

OTHER_UID = 12345
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")

RAW = b"an encoded image"
DIGEST = hashlib.sha256(RAW).hexdigest()


def entry(session_id: str = "s1", digests: tuple[str, ...] = (), **fields) -> JournalEntry:
    values = dict(session_id=session_id, token_ids=[1, 2, 3], image_digests=list(digests), ended_with_eos=True,
                  num_turns=1, created_at=0.0, expires_at=9e9)
    return JournalEntry(**{**values, **fields})


def entry_bytes(e: JournalEntry) -> int:
    """Bytes of its journal file."""
    return len(json.dumps({"version": 1, **e.__dict__}))


def entry_file(journal: Journal, name: str, **fields) -> Path:
    """An entry written behind the journal's back (what a crashed or tampered run leaves)."""
    data = {"version": 1, "session_id": "s1", "token_ids": [1], "image_digests": [], "ended_with_eos": False,
            "num_turns": 1, "created_at": 0.0, "expires_at": 0.0, "adapter": None, **fields}
    path = journal.sessions_dir / name
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def victim(tmp_path) -> Path:
    """A file outside the journal that no entry may make it touch."""
    path = tmp_path / "victim"
    path.write_bytes(b"precious")
    (tmp_path / "victim.json").write_bytes(b"precious")
    return path


# ------------------------------------------------------------ what is read back is checked


@pytest.mark.parametrize("fields", [
    {"session_id": "../../victim"},
    {"image_digests": ["../../victim"]},
    {"image_digests": [DIGEST.upper()]},  # hex, but not as sha256().hexdigest() writes it
    {"image_digests": "0" * 64},  # a string, not a list
    {"token_ids": ["1"]},
    {"token_ids": [True]},
    {"token_ids": [-1]},
    {"ended_with_eos": 1},
    {"num_turns": 1.5},
    {"expires_at": "never"},
    {"adapter": 7},
    {"unknown_field": 1},
    {"version": 2},
    {"version": True},
], ids=lambda f: next(iter(f)))
def test_an_unsafe_or_mistyped_entry_is_moved_aside_and_touches_nothing_outside(tmp_path, victim, fields):
    journal = Journal(tmp_path / "journal")
    name = "s1.json" if fields.get("session_id") is None else "x.json"
    entry_file(journal, name, **fields)
    assert journal.entries() == []
    assert journal.num_corrupt == 1
    assert [p.name for p in journal.sessions_dir.iterdir()] == [Path(name).with_suffix(".corrupt").name]
    journal.remove_images_except(set())
    assert victim.read_bytes() == b"precious" and (tmp_path / "victim.json").read_bytes() == b"precious"


@pytest.mark.parametrize("content", ["[1, 2]", "{not json", '{"version": 1}'])
def test_an_entry_that_is_no_object_of_the_fields_is_moved_aside(tmp_path, content):
    journal = Journal(tmp_path / "journal")
    (journal.sessions_dir / "s1.json").write_text(content)
    assert journal.entries() == [] and journal.num_corrupt == 1


def test_an_entry_under_another_sessions_file_name_is_moved_aside(tmp_path):
    journal = Journal(tmp_path / "journal")
    entry_file(journal, "other.json", session_id="s1")
    assert journal.entries() == [] and journal.num_corrupt == 1


def test_a_valid_entry_with_its_image_reads_back(tmp_path):
    journal = Journal(tmp_path / "journal")
    journal.write_session(entry("s1", (DIGEST, DIGEST), adapter="support"), {DIGEST: RAW})
    assert journal.entries() == [entry("s1", (DIGEST, DIGEST), adapter="support")]
    assert journal.read_image(DIGEST) == RAW and journal.num_corrupt == 0


@pytest.mark.parametrize("bad", ["../victim", "../../victim", "a/b", "", "x" * 300])
def test_every_method_that_names_a_file_refuses_an_unsafe_session_id(tmp_path, victim, bad):
    journal = Journal(tmp_path / "journal")
    with pytest.raises(InvalidSessionId):
        journal.remove(bad)
    with pytest.raises(InvalidSessionId):
        journal.write(entry(bad))
    with pytest.raises(InvalidSessionId):
        journal.write_session(entry(bad), {})
    assert (tmp_path / "victim.json").read_bytes() == b"precious"
    assert list(journal.sessions_dir.iterdir()) == []


@pytest.mark.parametrize("bad", ["../victim", "../../victim", "px-" + DIGEST, DIGEST[:-1], DIGEST + "0", ""])
def test_every_method_that_names_a_file_refuses_an_unsafe_digest(tmp_path, victim, bad):
    journal = Journal(tmp_path / "journal")
    for call in (lambda: journal.has_image(bad), lambda: journal.write_image(bad, RAW),
                 lambda: journal.read_image(bad), lambda: journal.remove_image(bad),
                 lambda: journal.write(entry("s1", (bad,))), lambda: journal.write_session(entry("s1", (bad,)), {bad: RAW})):
        with pytest.raises(BadRequest):
            call()
    assert victim.read_bytes() == b"precious"
    assert list(journal.images_dir.iterdir()) == [] and list(journal.sessions_dir.iterdir()) == []


def test_write_session_needs_every_image_it_names(tmp_path):
    journal = Journal(tmp_path / "journal")
    with pytest.raises(FileNotFoundError):
        journal.write_session(entry("s1", (DIGEST,)), {})
    assert journal.nbytes == 0 and list(journal.sessions_dir.iterdir()) == []


# ------------------------------------------------------------ a directory of its own


def test_a_symlinked_journal_directory_is_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "journal").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match=f"{tmp_path / 'journal'} is a symbolic link"):
        Journal(tmp_path / "journal")
    assert list((tmp_path / "elsewhere").iterdir()) == []


@pytest.mark.parametrize("folder", ["sessions", "images"])
def test_a_symlinked_sessions_or_images_folder_is_refused(tmp_path, folder):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "journal").mkdir()
    (tmp_path / "journal" / folder).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match=f"{tmp_path / 'journal' / folder} is a symbolic link"):
        Journal(tmp_path / "journal")


def test_a_dangling_symlink_is_refused_not_followed(tmp_path):
    (tmp_path / "journal").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="is a symbolic link"):
        Journal(tmp_path / "journal")
    assert not (tmp_path / "nowhere").exists()


@as_root
def test_a_directory_another_user_created_first_is_refused(tmp_path):
    (tmp_path / "journal").mkdir(mode=0o777)
    os.chown(tmp_path / "journal", OTHER_UID, OTHER_UID)
    with pytest.raises(ConfigError, match=f"{tmp_path / 'journal'} belongs to uid {OTHER_UID}"):
        Journal(tmp_path / "journal")
    assert list((tmp_path / "journal").iterdir()) == []


@as_root
@pytest.mark.parametrize("folder", ["sessions", "images"])
def test_a_sessions_or_images_folder_of_another_user_is_refused(tmp_path, folder):
    (tmp_path / "journal" / folder).mkdir(parents=True)
    os.chown(tmp_path / "journal" / folder, OTHER_UID, OTHER_UID)
    with pytest.raises(ConfigError, match=f"{tmp_path / 'journal' / folder} belongs to uid {OTHER_UID}"):
        Journal(tmp_path / "journal")


@as_root
def test_a_parent_another_user_owns_is_refused_naming_it_and_what_to_set(tmp_path):
    """Its owner could swap the journal under it after start-up (issue #39)."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chown(shared, OTHER_UID, OTHER_UID)
    with pytest.raises(ConfigError, match=f"{shared / 'backend-0'} is under {shared}, which belongs to uid "
                                          f"{OTHER_UID}.*set RESIDENT_JOURNAL_DIR"):
        Journal(shared / "backend-0")
    assert not (shared / "backend-0").exists()


def test_a_parent_others_may_write_is_refused_unless_sticky(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ConfigError, match=f"is under {shared}, which is writable by other users"):
        Journal(shared / "journal")
    shared.chmod(0o1777)  # as /tmp and /dev/shm: others cannot rename what is ours in it
    Journal(shared / "journal").write(entry("s1"))


def test_links_in_the_parents_resolve_once_at_open(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    journal = Journal(tmp_path / "link" / "journal")
    journal.write(entry("s1"))
    assert os.listdir(tmp_path / "real" / "journal" / "sessions") == ["s1.json"]


def test_missing_parents_are_made_private(tmp_path):
    journal = Journal(tmp_path / "a" / "b" / "journal")
    journal.write(entry("s1"))
    assert (tmp_path / "a").stat().st_mode & 0o777 == 0o700


# ------------------------------------------------------------ no path trusted twice


def test_swapping_the_directory_for_a_link_after_start_up_redirects_nothing(tmp_path):
    """Issue #39: whoever could rename backend-0 after start-up read every new session id."""
    parent = tmp_path / "shared"
    parent.mkdir()
    journal = Journal(parent / "backend-0")
    journal.write_session(entry("s1", (DIGEST,)), {DIGEST: RAW})
    evil = tmp_path / "evil"
    for folder in ("sessions", "images"):
        (evil / folder).mkdir(parents=True)
    (parent / "backend-0").rename(parent / "moved")
    (parent / "backend-0").symlink_to(evil)

    journal.write_session(entry("s2", (DIGEST,)), {})
    journal.write_adapters({"a": {"src": "/adapters/a", "pinned": False}})
    journal.remove("s1")
    assert sorted(p.name for p in evil.rglob("*")) == ["images", "sessions"]  # nothing reached the link
    assert sorted(os.listdir(parent / "moved" / "sessions")) == ["s2.json"]
    assert os.path.exists(parent / "moved" / "adapters.json")
    assert [e.session_id for e in journal.entries()] == ["s2"] and journal.read_image(DIGEST) == RAW


@pytest.mark.parametrize("folder", ["sessions", "images"])
def test_swapping_a_folder_for_a_link_after_start_up_redirects_nothing(tmp_path, folder):
    journal = Journal(tmp_path / "journal")
    (tmp_path / "evil").mkdir()
    (tmp_path / "journal" / folder).rename(tmp_path / "journal" / "moved")
    (tmp_path / "journal" / folder).symlink_to(tmp_path / "evil")
    journal.write_session(entry("s1", (DIGEST,)), {DIGEST: RAW})
    assert list((tmp_path / "evil").iterdir()) == []
    assert os.listdir(tmp_path / "journal" / "moved") == ["s1.json" if folder == "sessions" else DIGEST]


# ------------------------------------------------------------ images verified by their hash


def test_a_tampered_image_is_rejected_by_its_hash_and_its_session_not_restored(tmp_path):
    journal = Journal(tmp_path / "journal")
    journal.write_session(entry("s1", (DIGEST,)), {DIGEST: RAW})
    journal.write_session(entry("s2"), {})
    (tmp_path / "journal" / "images" / DIGEST).write_bytes(b"planted")  # behind the journal's back
    journal.close()

    reopened = Journal(tmp_path / "journal")
    assert [e.session_id for e in reopened.entries()] == ["s2"]
    assert reopened.num_corrupt == 1 and reopened.num_images_rejected == 1
    assert (tmp_path / "journal" / "sessions" / "s1.corrupt").exists()
    assert not reopened.has_image(DIGEST)  # removed: the next turn that sends it journals it afresh
    assert reopened.nbytes == entry_bytes(entry("s2"))


def test_an_image_read_back_that_does_not_match_raises_and_is_removed(tmp_path):
    journal = Journal(tmp_path / "journal")
    journal.write_session(entry("s1", (DIGEST,)), {DIGEST: RAW})
    assert journal.read_image(DIGEST) == RAW
    (tmp_path / "journal" / "images" / DIGEST).write_bytes(b"planted")
    with pytest.raises(JournalImageCorrupt, match=f"image {DIGEST[:12]} in the journal does not match") as refused:
        journal.read_image(DIGEST)
    assert isinstance(refused.value, OSError)  # Sessions logs it; that session cannot be recomputed, no crash
    assert not journal.has_image(DIGEST)
    journal.write_image(DIGEST, RAW)  # the same image sent again is journaled again
    assert journal.read_image(DIGEST) == RAW


def test_an_image_that_is_a_link_is_refused(tmp_path, victim):
    journal = Journal(tmp_path / "journal")
    (tmp_path / "journal" / "images" / DIGEST).symlink_to(victim)
    with pytest.raises(OSError):
        journal.read_image(DIGEST)
    assert victim.read_bytes() == b"precious"


def test_a_file_where_the_directory_should_be_is_refused(tmp_path):
    (tmp_path / "journal").write_text("")
    with pytest.raises(ConfigError, match="is not a directory"):
        Journal(tmp_path / "journal")


def test_our_own_directory_is_made_private_and_stale_temporaries_go(tmp_path):
    (tmp_path / "journal" / "sessions").mkdir(parents=True, mode=0o755)
    (tmp_path / "journal" / "sessions").chmod(0o755)
    (tmp_path / "journal" / "sessions" / ".s1.json.123.tmp").write_bytes(b"half")
    journal = Journal(tmp_path / "journal")
    for path in (journal.directory, journal.sessions_dir, journal.images_dir):
        assert path.stat().st_mode & 0o777 == 0o700
    assert list(journal.sessions_dir.iterdir()) == [] and journal.nbytes == 0


# ------------------------------------------------------------ caps


def test_a_session_over_its_quota_is_refused_before_anything_is_written(tmp_path):
    journal = Journal(tmp_path / "journal", session_max_bytes=entry_bytes(entry("greedy", (DIGEST,))) + 100)
    big = b"x" * 101
    big_digest = hashlib.sha256(big).hexdigest()
    with pytest.raises(JournalSessionFull) as refused:
        journal.write_session(entry("greedy", (big_digest,)), {big_digest: big})
    assert isinstance(refused.value, JournalFull) and "greedy" in str(refused.value)
    assert journal.nbytes == 0 and list(journal.images_dir.iterdir()) == []
    journal.write_session(entry("modest"), {})  # the others are journaled as before
    assert [e.session_id for e in journal.entries()] == ["modest"]


def test_an_image_another_session_names_is_not_counted_against_a_session(tmp_path):
    journal = Journal(tmp_path / "journal", session_max_bytes=entry_bytes(entry("s1", (DIGEST,))) + len(RAW))
    journal.write_session(entry("s1", (DIGEST,)), {DIGEST: RAW})  # entry + image: exactly its quota
    with pytest.raises(JournalSessionFull):
        journal.write(entry("s1", (DIGEST,), token_ids=[1, 2, 3, 4]))  # a longer entry no longer fits
    journal.write_session(entry("s2", (DIGEST,), token_ids=[1, 2, 3, 4]), {})  # the image is s1's too: fits
    journal.write(entry("s1", (DIGEST,), token_ids=[1, 2, 3, 4]))  # and now s1 shares it: fits as well
    journal.remove("s2")
    with pytest.raises(JournalSessionFull):
        journal.write(entry("s1", (DIGEST,), token_ids=[1, 2, 3, 4, 5]))


def test_a_write_sizes_its_share_once_and_nothing_without_quotas(tmp_path, monkeypatch):
    """write_session sizes the session's share once, with its images as given, and charges exactly
    that to its tenant; with neither a quota nor a share nothing is sized."""
    sized = []
    own_digests = JournalQuota.own_digests
    monkeypatch.setattr(JournalQuota, "own_digests", lambda quota, e: sized.append(e.session_id) or own_digests(quota, e))
    share = entry_bytes(entry("s1", (DIGEST,), tenant="acme")) + len(RAW)
    bounded = Journal(tmp_path / "bounded", tenant_max_bytes=share)
    bounded.write_session(entry("s1", (DIGEST,), tenant="acme"), {DIGEST: RAW})  # exactly its tenant's share
    assert sized == ["s1"] and bounded.nbytes == share
    with pytest.raises(JournalFull):  # s1 was charged the whole share: no other entry of acme fits
        bounded.write_session(entry("s2", tenant="acme", token_ids=[]), {})
    sized.clear()
    unbounded = Journal(tmp_path / "unbounded")
    unbounded.write_session(entry("s1", (DIGEST,)), {DIGEST: RAW})
    unbounded.write(entry("s1", (DIGEST,), num_turns=2))
    assert [e.session_id for e in unbounded.entries()] == ["s1"]
    assert sized == [] and unbounded.nbytes == entry_bytes(entry("s1", (DIGEST,), num_turns=2)) + len(RAW)


def test_the_global_cap_still_holds(tmp_path):
    cap = entry_bytes(entry("s1")) + 50
    journal = Journal(tmp_path / "journal", max_bytes=cap, session_max_bytes=cap)
    journal.write(entry("s1"))
    with pytest.raises(JournalFull) as refused:
        journal.write(entry("s2"))
    assert not isinstance(refused.value, JournalSessionFull)
    assert journal.nbytes == entry_bytes(entry("s1"))


# ------------------------------------------------------------ fsync where it buys durability


def test_on_a_disk_a_write_fsyncs_the_file_then_the_directory(tmp_path, monkeypatch):
    journal = Journal(tmp_path / "journal")
    journal.fsync = True  # as on a disk (whatever holds tmp_path here)
    synced: list[str] = []
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")))
    journal.write_session(entry("s1", (DIGEST,)), {DIGEST: RAW})
    tmp_image = str(journal.images_dir / f".{DIGEST}.{os.getpid()}.tmp")
    tmp_entry = str(journal.sessions_dir / f".s1.json.{os.getpid()}.tmp")
    assert synced == [tmp_image, str(journal.images_dir), tmp_entry, str(journal.sessions_dir)]
    synced.clear()
    journal.remove("s1")
    assert synced == [str(journal.sessions_dir)]


def test_on_tmpfs_nothing_is_fsynced(tmp_path, monkeypatch):
    journal = Journal(tmp_path / "journal")
    journal.fsync = False
    synced = []
    monkeypatch.setattr(os, "fsync", synced.append)
    journal.write_session(entry("s1", (DIGEST,)), {DIGEST: RAW})
    journal.remove("s1")
    assert synced == []


MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
25 24 0:23 / /dev/shm rw,relatime shared:5 - tmpfs tmpfs rw,size=24683584k
27 1 254:0 / / rw,relatime master:1 unbindable - ext4 /dev/vda rw,discard
"""


def test_the_filesystem_is_told_by_device_number():
    assert mount_type(MOUNTINFO, 0, 23) == "tmpfs"
    assert mount_type(MOUNTINFO, 254, 0) == "ext4"  # optional fields before the separator
    assert mount_type(MOUNTINFO, 8, 1) is None  # not listed: the journal fsyncs


@pytest.mark.skipif(filesystem_type(Path("/dev/shm")) != "tmpfs", reason="no tmpfs at /dev/shm here")
def test_a_journal_under_dev_shm_does_not_fsync():
    import tempfile

    with tempfile.TemporaryDirectory(dir="/dev/shm") as directory:
        assert Journal(Path(directory) / "journal").fsync is False


def test_an_entry_keeps_its_tenant_and_cache_salt(tmp_path):
    journal = Journal(tmp_path / "journal")
    salted = entry("s1", tenant="acme", cache_salt=hashlib.sha256(b"acme").hexdigest())
    journal.write_session(salted, {})
    [back] = journal.entries()
    assert (back.tenant, back.cache_salt) == ("acme", salted.cache_salt)
    with pytest.raises(BadRequest, match="tenant must be a string of at most 128 characters"):
        journal.write_session(entry("s2", tenant="x" * 129), {})


def test_a_tenant_past_its_share_is_refused_and_others_are_not(tmp_path):
    one = len(json.dumps({"version": 1, **entry("s1", tenant="acme").__dict__}).encode())
    journal = Journal(tmp_path / "journal", tenant_max_bytes=2 * one + 50)
    journal.write_session(entry("s1", tenant="acme"), {})
    journal.write_session(entry("s2", tenant="acme"), {})
    with pytest.raises(JournalFull, match=r"this tenant's sessions would take \d+ bytes of the journal; its share is \d+"):
        journal.write_session(entry("s3", tenant="acme"), {})
    journal.write_session(entry("s4", tenant="globex"), {})  # another tenant's room is its own
    journal.write_session(entry("s2", tenant="acme", num_turns=2), {})  # rewriting one's own entry fits
    journal.remove("s1")
    journal.write_session(entry("s3", tenant="acme"), {})  # a removed session frees its tenant's room
    reopened = Journal(tmp_path / "journal", tenant_max_bytes=2 * one + 50)
    assert sorted(e.session_id for e in reopened.entries()) == ["s2", "s3", "s4"]
    with pytest.raises(JournalFull):
        reopened.write_session(entry("s5", tenant="acme"), {})  # the shares are counted again at start-up
