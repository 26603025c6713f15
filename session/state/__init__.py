"""What each session holds, and where it lives.

``session`` is ``SessionState`` and its memory ``Tier``; ``sessions`` the one owner and writer of
session state (open, forget, restore, roll back a turn), with ``turn_inputs`` (a turn's steps before
its prefill), ``image_bytes`` (encoded images the journal does not hold), ``migration`` (export and import)
and ``invariants`` (the checks tests run); ``store`` ids, expiry and byte counts; ``kv_manager`` the
one owner of KV room the scheduler asks (blocks needed, can admit, admit); ``memory`` the demotion
policy: the tiers under the device budget; ``embeddings`` image embeddings shared by digest;
``journal`` crash recovery on disk: ``journal_entry`` one session's record, ``journal_files`` the
directory and its files, ``journal_quota`` each session's and tenant's share of its bytes.

May import: ``model`` (KV caches), ``families`` and the top modules. Never ``engine``, ``serving``
or ``front``.
"""
