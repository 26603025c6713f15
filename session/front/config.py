"""The front's settings: ``FrontConfig``, from ``RESIDENT_FRONT_*`` environment variables."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from session.config import coerce
from session.errors import ConfigError
from session.front.tenants import TENANT_RE, read_api_keys
from session.serving.protocol import TENANT_HEADER

ENV_PREFIX = "RESIDENT_FRONT_"
TAG_RE = re.compile(r"^[A-Za-z0-9]+\*?$")
HEADER_NAME_RE = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")  # an HTTP token


@dataclass(frozen=True)
class FrontConfig:
    """Every field is set by ``RESIDENT_FRONT_<FIELD>``; lists are comma-separated."""

    backends: tuple[str, ...] = ()  # inference base URLs, e.g. http://127.0.0.1:9000
    management_urls: tuple[str, ...] = ()  # TorchServe management URLs, same order; empty: health = /ping
    model_name: str = "llava"  # the TorchServe model whose workers must be READY for a backend to be healthy
    # An answer (a stream: its first and each next chunk) must come within this. Below SageMaker's 60 s, so
    # that the front's 504 (which says whether the turn was rolled back) reaches the client, not SageMaker's.
    timeout_s: float = 55.0
    max_request_bytes: int = 6 * 1024 * 1024  # SageMaker's payload limit; larger requests get 413
    header_timeout_s: float = 10.0  # a request's head must arrive within this of its first byte (else: closed)
    body_timeout_s: float = 30.0  # a request's body must arrive within this of its head (else: 408)
    # An idle kept-alive connection is closed after this. Above the 60 s idle timeout of the load balancers
    # before us (ELB's guidance: the target's keep-alive must outlast the balancer's, or a request sent on a
    # connection the target is closing fails); idle connections never lock others out (max_connections).
    idle_timeout_s: float = 75.0
    # Open connections. One more closes the longest idle one (between requests, nothing left to send) to make
    # room, or, with every one in a request, is answered 503 and closed.
    max_connections: int = 1024
    # The same per peer address (its own idle ones closed first); 0: no cap. Behind a load balancer, or on
    # SageMaker, every client comes from its few addresses: set 0 there, or its concurrency.
    max_connections_per_address: int = 64
    # An answer whose client reads none of it (the socket's buffer stays full) for this long is cut: the
    # connection aborted and the request cancelled on its backend.
    write_timeout_s: float = 30.0
    # Requests in flight per client, that is per tenant (429 past it); 0: no limit. Without a key file or a
    # trusted header the tenant is the peer address, which behind a load balancer all share (docs/DEPLOY.md).
    max_requests_per_client: int = 64
    # Who a request is for (session/front/tenants.py), first that applies: a file of "<tenant> <key>" lines
    # (clients send "Authorization: Bearer <key>"; without a valid one, 401); a header trusted to name the
    # tenant (its whole value, or with tenant_attribute its "<attribute>=<tenant>" pair, as in SageMaker's
    # X-Amzn-SageMaker-Custom-Attributes); else the peer address. Only one of the file and the header.
    api_keys_file: str = ""
    tenant_header: str = ""
    tenant_attribute: str = ""
    health_interval_s: float = 5.0  # between health probes of every backend
    health_timeout_s: float = 5.0  # for one probe, and for connecting to a backend
    unhealthy_after: int = 3  # failed probes in a row before a backend is taken out
    drain_s: float = 10.0  # on shutdown, how long requests in flight may finish (SIGKILL comes at 30 s)
    default_session_ttl_s: float = 1200.0  # pin lifetime when a backend's New-Session-Id has no Expires
    admin_token: str = ""  # shared with the backends (RESIDENT_ADMIN_TOKEN): adapters, session look-up, drain
    # Each backend's RESIDENT_SESSION_ID_TAG, same order; empty: b0, b1, ...; "none": ids carry no tag.
    backend_tags: tuple[str, ...] = ()
    cancel_timeout_s: float = 2.0  # a cancel sent to a backend (best effort)
    # What GET /v1/models lists: the name the backends serve the model under (EngineConfig.model_name, which
    # clients send as "model"; the launcher sets it from the checkpoint; "" = model_name) and its context
    # length in tokens (0: unknown, not listed).
    served_model_name: str = ""
    max_model_len: int = 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> FrontConfig:
        """Called once at start-up by the launcher (and by tests): environment, then overrides."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            name = ENV_PREFIX + f.name.upper()
            if name in env:
                values[f.name] = coerce(f.type, env[name], name)
        config = cls(**{**values, **overrides})
        config = replace(config, backends=_without_slash(config.backends),
                         management_urls=_without_slash(config.management_urls))
        config.validate()
        return config

    def validate(self) -> None:
        if not self.backends:
            raise ConfigError(f"set {ENV_PREFIX}BACKENDS to the backends' URLs, comma-separated")
        for url in self.backends + self.management_urls:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"{url!r} in {ENV_PREFIX}BACKENDS/MANAGEMENT_URLS is not an http(s) URL")
        if self.management_urls and len(self.management_urls) != len(self.backends):
            raise ConfigError(f"{ENV_PREFIX}MANAGEMENT_URLS has {len(self.management_urls)} URLs for "
                              f"{len(self.backends)} backends; give one per backend or none")
        tags = self.session_tags()
        if len(tags) != len(self.backends):
            raise ConfigError(f"{ENV_PREFIX}BACKEND_TAGS has {len(tags)} tags for {len(self.backends)} backends; "
                              "give one per backend, or 'none'")
        for tag in tags:
            if tag and not TAG_RE.match(tag):
                raise ConfigError(f"session id tag {tag!r} in {ENV_PREFIX}BACKEND_TAGS: use letters and digits, "
                                  "optionally ending in * (a prefix)")
        for name in ("timeout_s", "max_request_bytes", "health_interval_s", "health_timeout_s", "unhealthy_after",
                     "default_session_ttl_s", "cancel_timeout_s", "header_timeout_s", "body_timeout_s",
                     "idle_timeout_s", "max_connections", "write_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{ENV_PREFIX}{name.upper()} must be > 0, got {getattr(self, name)}")
        if self.max_connections_per_address < 0:
            raise ConfigError(f"{ENV_PREFIX}MAX_CONNECTIONS_PER_ADDRESS must be >= 0 (0: no cap), got "
                              f"{self.max_connections_per_address}")
        if self.max_requests_per_client < 0:
            raise ConfigError(f"{ENV_PREFIX}MAX_REQUESTS_PER_CLIENT must be >= 0 (0: no limit), got "
                              f"{self.max_requests_per_client}")
        self._validate_tenants()
        if self.max_model_len < 0:
            raise ConfigError(f"{ENV_PREFIX}MAX_MODEL_LEN must be >= 0 (0: unknown), got {self.max_model_len}")
        if self.drain_s < 0:
            raise ConfigError(f"{ENV_PREFIX}DRAIN_S must be >= 0, got {self.drain_s}")

    def _validate_tenants(self) -> None:
        if self.api_keys_file and self.tenant_header:
            raise ConfigError(f"set {ENV_PREFIX}API_KEYS_FILE or {ENV_PREFIX}TENANT_HEADER, not both: with a key "
                              "file every request needs a key, and the key names its tenant")
        if self.tenant_attribute and not self.tenant_header:
            raise ConfigError(f"{ENV_PREFIX}TENANT_ATTRIBUTE names a pair in {ENV_PREFIX}TENANT_HEADER: set that "
                              "too (X-Amzn-SageMaker-Custom-Attributes on SageMaker)")
        if self.tenant_header and not HEADER_NAME_RE.fullmatch(self.tenant_header):
            raise ConfigError(f"{ENV_PREFIX}TENANT_HEADER={self.tenant_header!r} is not a header name")
        if self.tenant_header.lower() in ("authorization", TENANT_HEADER.lower()):
            raise ConfigError(f"{ENV_PREFIX}TENANT_HEADER cannot be {self.tenant_header}: name the header your "
                              "proxy sets, e.g. X-Amzn-SageMaker-Custom-Attributes or X-Tenant-Id")
        if self.tenant_attribute and not TENANT_RE.fullmatch(self.tenant_attribute):
            raise ConfigError(f"{ENV_PREFIX}TENANT_ATTRIBUTE={self.tenant_attribute!r}: use letters, digits "
                              "and -_.")
        if self.api_keys_file:
            read_api_keys(self.api_keys_file)  # now, with the setting named, not at the first request

    @property
    def listed_model_name(self) -> str:
        """The base model's id in ``/v1/models``."""
        return self.served_model_name or self.model_name

    def session_tags(self) -> tuple[str, ...]:
        """The session id tag of each backend ("" where ids carry none)."""
        if self.backend_tags == ("none",):
            return ("",) * len(self.backends)
        return self.backend_tags or tuple(f"b{i}" for i in range(len(self.backends)))


def _without_slash(urls: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(url.rstrip("/") for url in urls)
