"""Administrative requests the engine answers between steps: adapters (register, unregister, list)
and sessions (list; export, forget, resume and import: moving a session when a backend is drained).
Each returns the JSON body of its answer.

Who calls this: the engine loop thread, when such a request is admitted (so it never races a step).
"""

from __future__ import annotations

import logging

from session.engine.requests import AdapterRequest, SessionAdminRequest
from session.errors import AdapterNotFound, BadRequest, ResidentError
from session.state.journal import Journal
from session.state.sessions import Sessions

logger = logging.getLogger(__name__)


def build_adapter_registry(config, runner, journal: Journal | None):
    """The LoRA registry per the config (None when adapters are off), with the adapters found in
    RESIDENT_ADAPTERS_DIR, those registered through the API before a restart, and the pinned ones."""
    if config.max_device_adapters <= 0:
        return None
    from session.model.lora import AdapterRegistry

    bank, shapes = runner.enable_lora(config.max_device_adapters, config.max_lora_rank)
    registry = AdapterRegistry(bank, shapes, max_device=config.max_device_adapters,
                               max_host=config.max_host_adapters, max_rank=config.max_lora_rank,
                               adapters_dir=config.adapters_dir)
    if config.adapters_dir:
        logger.info("adapters found in %s: %s", config.adapters_dir, registry.scan(config.adapters_dir))
    for name, entry in (journal.adapters() if journal is not None else {}).items():
        try:
            if name not in registry:
                registry.register(name, entry["src"], pinned=entry.get("pinned", False))
        except ResidentError as exc:
            logger.warning("adapter %s from the journal cannot be registered again: %s", name, exc.message)
    for name in filter(None, (n.strip() for n in config.pinned_adapters.split(","))):
        registry.get(name).pinned = True
        registry.acquire(name)
        registry.release(name)
    return registry


def prefix_salt(registry):
    """Adapter name (or None) -> the salt of its KV blocks' keys (session/model/prefix_cache.py): the
    base model's blocks are unsalted, an adapter's carry its registration (``AdapterRegistry.cache_key``)."""
    def salt(name: str | None) -> bytes:
        if name is None:
            return b""
        return registry_or_404(registry, name).cache_key(name)
    return salt


def registry_or_404(registry, name: str):
    if registry is None:
        raise AdapterNotFound(f"adapter {name!r}: adapters are disabled on this server "
                              "(RESIDENT_MAX_DEVICE_ADAPTERS=0)")
    return registry


def adapter_admin(request: AdapterRequest, registry, sessions: Sessions) -> dict:
    registry_or_404(registry, request.name or "")
    if request.action == "list":
        return {"adapters": registry.list()}
    if request.action == "register":
        info = registry.register(request.name, request.src, pinned=request.pinned)
        _journal_adapters(sessions.journal, added=(info.name, {"src": info.path, "pinned": info.pinned}))
        return {"registered": info.name, "src": info.path}
    if request.action == "unregister":
        in_use = sum(1 for s in sessions.store.all_sessions() if s.adapter == request.name)
        registry.unregister(request.name, in_use, dry_run=request.dry_run)
        if not request.dry_run:
            _journal_adapters(sessions.journal, removed=request.name)
        return {"unregistered": request.name, "dry_run": request.dry_run}
    raise BadRequest(f"unknown adapter action {request.action!r}; use register, unregister or list")


def _journal_adapters(journal: Journal | None, added: tuple[str, dict] | None = None,
                      removed: str | None = None) -> None:
    if journal is None:
        return
    adapters = journal.adapters()
    if added is not None:
        adapters[added[0]] = added[1]
    if removed is not None:
        adapters.pop(removed, None)
    journal.write_adapters(adapters)


def session_admin(request: SessionAdminRequest, sessions: Sessions, now: float) -> dict:
    """list / export / forget / resume / import: a move in two phases (``session/state/sessions.py``).
    An export reaches here only once its session is idle and not moving (admission queues it behind
    the request in flight, or holds it behind the move under way)."""
    if request.action == "list":
        return {"sessions": [{"session_id": s.session_id, "busy": s.busy, "num_turns": s.num_turns,
                              "expires_at": s.expires_at, "recoverable": s.recoverable,
                              "moving": sessions.is_moving(s.session_id)}
                             for s in sessions.store.all_sessions() if not s.ephemeral]}
    if request.action == "import":
        if not isinstance(request.exported, dict):  # the request's "session": any JSON value
            raise BadRequest("import needs the exported session object in 'session'")
        return {"imported": sessions.import_(request.exported, now).session_id}
    if request.action not in ("export", "forget", "resume"):
        raise BadRequest(f"unknown sessions action {request.action!r}; use list, export, forget, resume or import")
    if not isinstance(request.session_id, str):
        raise BadRequest(f"{request.action} needs the session's id in 'session_id'")
    session = sessions.get(request.session_id)
    if request.action == "export":
        return {"session": sessions.export(session, now)}
    if request.action == "forget":
        sessions.forget_moved(session)
        return {"forgotten": session.session_id}
    return {"resumed": session.session_id, "was_moving": sessions.resume_move(session)}
