"""Who a request is for: its tenant, resolved once per request by the front's middleware.

Behind SageMaker, a load balancer or another front, every tenant arrives from the same few peer
addresses, so the peer address cannot tell them apart. The tenant comes from the first configured
source (``FrontConfig``; docs/DEPLOY.md, "Tenants"):

1. an API-key file (``api_keys_file``): lines ``<tenant> <key>``; the client sends
   ``Authorization: Bearer <key>`` (the openai SDK's ``api_key``). With a key file, a request
   without a valid key is 401 ``authentication_error`` (``/ping`` excepted, which never gets here);
2. a trusted header (``tenant_header``), honoured only when configured: its whole value, or with
   ``tenant_attribute`` the value of ``<attribute>=<tenant>`` among the ``,``/``;``-separated pairs
   of SageMaker's ``X-Amzn-SageMaker-Custom-Attributes``. A request without it falls through to 3;
3. the peer address, as ``addr:<ip>``: the colon no configured tenant may contain, so the two never
   collide.

Every per-client limit keys on the tenant, the access log names it, and the front sends it to the
backend as ``X-Resident-Tenant`` (``forwarding.Call``); a client's own ``X-Resident-Tenant`` never
passes. The key itself is never logged nor forwarded.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

from session.errors import BadRequest, ConfigError, Unauthorized

if TYPE_CHECKING:
    from session.front.config import FrontConfig

# A configured tenant: what the key file and the trusted header may name.
TENANT_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
PEER_PREFIX = "addr:"
MIN_KEY_CHARS = 16  # a shorter key is guessable by trying
TENANT = web.RequestKey("tenant", str)  # request[TENANT]: the tenant the middleware resolved
_PAIR_SEPARATORS = re.compile(r"[,;]")


def read_api_keys(path: str) -> dict[bytes, str]:
    """The key file: ``# sha256(key) -> tenant``. Lines ``<tenant> <key>``; blank lines and ``#``
    comments are skipped; a tenant may have several keys (rotation), a key names one tenant. Called
    at start-up (``FrontConfig.validate``, ``Tenants.from_config``); raises ConfigError naming the
    line, never the key."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read the API-key file RESIDENT_FRONT_API_KEYS_FILE={path!r}: {exc}") from None
    digests: dict[bytes, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{path}, line {number}"
        parts = line.split()
        if len(parts) != 2:
            raise ConfigError(f"{where}: write '<tenant> <key>' (two fields separated by a space)")
        tenant, key = parts
        if not TENANT_RE.fullmatch(tenant):
            raise ConfigError(f"{where}: tenant {tenant!r}: use letters, digits and -_. (at most 64)")
        if len(key) < MIN_KEY_CHARS:
            raise ConfigError(f"{where}: the key is shorter than {MIN_KEY_CHARS} characters; make one with "
                              "python -c 'import secrets; print(secrets.token_urlsafe(32))'")
        digest = _digest(key)
        if digest in digests:
            raise ConfigError(f"{where}: this key is already given to tenant {digests[digest]!r}")
        digests[digest] = tenant
    if not digests:
        raise ConfigError(f"the API-key file {path} holds no '<tenant> <key>' line: every request would be 401")
    return digests


def attribute_value(value: str, attribute: str) -> str | None:
    """The value of ``attribute`` among ``k=v`` pairs separated by ``,`` or ``;`` (SageMaker's
    CustomAttributes), None when absent. Named twice with two values: 400."""
    found = {v.strip() for k, _, v in (pair.partition("=") for pair in _PAIR_SEPARATORS.split(value))
             if k.strip() == attribute}
    if len(found) > 1:
        raise BadRequest(f"the custom attributes give {attribute!r} twice, with different values; give it once")
    return found.pop() if found else None


def check_tenant(tenant: str, source: str) -> str:
    if not TENANT_RE.fullmatch(tenant):
        raise BadRequest(f"tenant {tenant[:80]!r} in {source}: use letters, digits and -_. (1 to 64 characters)")
    return tenant


def peer_tenant(request: web.BaseRequest) -> str:
    return PEER_PREFIX + (request.remote or "-")


class Tenants:
    """Built once by ``Front``; who calls ``identify``: the front's middleware, once per request but
    ``/ping``, on the event loop."""

    def __init__(self, *, api_keys: dict[bytes, str] | None = None, header: str = "", attribute: str = ""):
        self.api_keys = api_keys  # sha256(key) -> tenant; None: no key file
        self.header = header  # the trusted header; "": none
        self.attribute = attribute  # the tenant's name among the header's pairs; "": its whole value

    @classmethod
    def from_config(cls, config: FrontConfig) -> Tenants:
        api_keys = read_api_keys(config.api_keys_file) if config.api_keys_file else None
        return cls(api_keys=api_keys, header=config.tenant_header, attribute=config.tenant_attribute)

    def identify(self, request: web.BaseRequest) -> str:
        """The request's tenant. Raises Unauthorized (401) or BadRequest (400)."""
        if self.api_keys is not None:
            return self._by_key(request, self.api_keys)
        if self.header:
            tenant = self._by_header(request)
            if tenant is not None:
                return tenant
        return peer_tenant(request)

    def _by_key(self, request: web.BaseRequest, api_keys: dict[bytes, str]) -> str:
        scheme, _, key = request.headers.get("Authorization", "").strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthorized("send your API key as 'Authorization: Bearer <key>' (the openai client's api_key)")
        # Looked up by digest: how long the look-up takes tells nothing about how much of a key matched.
        tenant = api_keys.get(_digest(key.strip()))
        if tenant is None:
            raise Unauthorized("the API key is not valid")
        return tenant

    def _by_header(self, request: web.BaseRequest) -> str | None:
        values = request.headers.getall(self.header, [])
        if len(values) > 1:
            raise BadRequest(f"{self.header} is sent {len(values)} times; send it once")
        if not values:
            return None
        if not self.attribute:
            return check_tenant(values[0].strip(), self.header)
        tenant = attribute_value(values[0], self.attribute)
        return None if tenant is None else check_tenant(tenant, f"{self.header} ({self.attribute}=)")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode(errors="surrogatepass")).digest()  # a header's odd bytes: a wrong key, not a 500
