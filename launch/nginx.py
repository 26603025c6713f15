"""``python -m launch.nginx``: an nginx configuration that routes sessions to N backends, no table.

A backend started with RESIDENT_SESSION_ID_TAG=<tag> creates session ids ``<uuid4>-<tag>``
(``make cluster`` tags backend i ``b<i>``), so a stock nginx can route without any state:

- a request whose ``X-Amzn-SageMaker-Session-Id`` ends in a backend's tag goes to that backend
  (a ``map`` on the header picks the upstream);
- new sessions (``NEW_SESSION``) and stateless requests go to the least busy backend
  (``least_conn`` over a shared ``zone``, so that every worker process counts the same
  connections); a backend that refuses the connection or answers 503 is skipped;
- when the tagged backend answers 404 (the session was moved off it by a drain) or cannot be
  reached, the request is tried on every backend in turn until one holds the session
  (``proxy_next_upstream http_404``); only a session found nowhere answers 404;
- answers stream through unbuffered (server-sent events); ``/v1/chat/completions`` is sent to the
  backends' ``/invocations`` (the same OpenAI body), and so is ``/v1/completions``, marked
  ``X-Resident-Endpoint: completions`` as the front marks it (a ``map`` on the request's URI, so that
  the search of a moved session carries it too);
- only a raw path (before percent-decoding) as plain as the location it matched is forwarded (404 else):
  nginx matches locations on the decoded, resolved path but forwards the raw one, so
  ``/predictions/..%2Fping`` would otherwise match ``/ping`` and reach TorchServe's route of that name;
- abuse is bounded as at the front: our control headers (``X-Resident-Cancel``,
  ``X-Resident-Admin-Token``, ``X-Resident-Request-Id``, a client's ``X-Resident-Endpoint`` and
  ``X-Resident-Tenant``) never reach a backend (the engine names the request itself; the tenant is
  the client's address, ``addr:<ip>``, as at a front with no key file or tenant header), request
  heads and bodies have deadlines, header buffers are small, a body past 64 KiB waits on disk rather
  than in memory, and each client address holds at most ``max_requests_per_client`` connections
  (``limit_conn``, 429 past it).

The aiohttp front (``make cluster``) stays for what nginx cannot do: the SageMaker runtime paths
(AWS event stream for boto3), ``/backends/{i}/drain``, ``/adapters``, and 410 for a session whose
backend died. It keeps no state either, so fronts and nginx can stand before the same backends.

Usage (backends and tags default to RESIDENT_FRONT_BACKENDS and RESIDENT_FRONT_BACKEND_TAGS):

    python -m launch.nginx --backends http://127.0.0.1:8090,http://127.0.0.1:8100 --listen 0.0.0.0:8080 \\
        --snippet > /etc/nginx/conf.d/resident.conf     # the http-context part, for Debian's nginx
    python -m launch.nginx --prefix /tmp/resident-nginx > /tmp/resident-nginx/nginx.conf  # a whole nginx.conf
    nginx -p /tmp/resident-nginx -c /tmp/resident-nginx/nginx.conf -e /tmp/resident-nginx/error.log
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from session.errors import ConfigError
from session.front.config import FrontConfig

# The session id a tag follows: a uuid4 (36 characters of hex digits and dashes).
_UUID_PATTERN = "[0-9a-fA-F-]{36}"
# The raw paths forwarded: a model name as the front allows one (session/front/request_checks.py).
PLAIN_PATHS = "ping|invocations|v1/chat/completions|v1/completions|predictions/[A-Za-z0-9_-]+(\\.[A-Za-z0-9_-]+)*"


@dataclass(frozen=True)
class NginxSite:
    """What the configuration is generated from: built by ``site_from_config`` (CLI and tests)."""

    servers: tuple[str, ...]  # host:port of each backend's inference API, in backend order
    tags: tuple[str, ...]  # each backend's session id tag ("<prefix>*" for an instance's many); "" = none
    listen: str  # nginx's listen address, e.g. 127.0.0.1:8080
    max_request_bytes: int
    timeout_s: float  # an answer, or the next chunk of a stream
    connect_timeout_s: float
    header_timeout_s: float = 10.0  # a client's request head
    body_timeout_s: float = 30.0  # between two reads of a client's body
    idle_timeout_s: float = 75.0  # an idle kept-alive client connection
    max_requests_per_client: int = 64  # connections per client address (limit_conn); 0: no limit


def site_from_config(config: FrontConfig, listen: str) -> NginxSite:
    servers = []
    for url in config.backends:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.port or parts.path not in ("", "/"):
            raise ConfigError(f"nginx needs backends as http://host:port, got {url!r}")
        servers.append(f"{parts.hostname}:{parts.port}")
    return NginxSite(servers=tuple(servers), tags=config.session_tags(), listen=listen,
                     max_request_bytes=config.max_request_bytes, timeout_s=config.timeout_s,
                     connect_timeout_s=config.health_timeout_s, header_timeout_s=config.header_timeout_s,
                     body_timeout_s=config.body_timeout_s, idle_timeout_s=config.idle_timeout_s,
                     max_requests_per_client=config.max_requests_per_client)


def tag_regex(tag: str) -> str:
    """The map pattern for session ids carrying ``tag`` ("ia*": any tag starting with "ia")."""
    suffix = f"{tag[:-1]}[A-Za-z0-9]*" if tag.endswith("*") else tag
    return f"~^{_UUID_PATTERN}-{suffix}$"


def render_http(site: NginxSite) -> str:
    """The http-context part: upstreams, the session map, the server. Include it in any nginx.conf."""
    tagged = [(i, tag) for i, tag in enumerate(site.tags) if tag]
    lines = ["# Generated by `python -m launch.nginx` (docs/ROUTING.md): sessions routed by the tag in their id.",
             "map $http_x_amzn_sagemaker_session_id $resident_upstream {",
             "    default resident_any;  # NEW_SESSION, stateless, and ids without a known tag"]
    lines += [f'    "{tag_regex(tag)}" resident_b{i};' for i, tag in tagged]
    lines += ["}", "", "# X-Resident-Endpoint: completions on /v1/completions; on any other path empty (not sent), whatever a",
              "# client sent.",
              "map $request_uri $resident_endpoint {", '    default "";', '    "~^/v1/completions(\\?|$)" completions;',
              "}", "",
              "# 1 for a raw request path (before decoding) as plain as the location it matches. nginx matches on the",
              "# decoded, resolved path but forwards the raw one: /predictions/..%2Fping would match /ping here and",
              "# reach the backend as a path TorchServe resolves to another of its routes.",
              "map $request_uri $resident_plain_path {", "    default 0;",
              f'    "~^/({PLAIN_PATHS})(\\?|$)" 1;',
              "}", "", "upstream resident_any {",
              "    zone resident_any 64k;  # least_conn counts shared by every worker", "    least_conn;"]
    lines += [f"    server {server} max_fails=1 fail_timeout=5s;" for server in site.servers]
    lines += ["    keepalive 32;", "}"]
    for i, _ in tagged:
        lines += ["", f"upstream resident_b{i} {{", f"    server {site.servers[i]} max_fails=0;", "    keepalive 8;",
                  "}"]
    if site.max_requests_per_client:
        lines += ["", "limit_conn_zone $binary_remote_addr zone=resident_per_client:10m;"]
    lines += ["", _server(site)]
    return "\n".join(lines) + "\n"


def _server(site: NginxSite) -> str:
    timeout, connect = _seconds(site.timeout_s), _seconds(site.connect_timeout_s)
    per_client = (f"\n    limit_conn resident_per_client {site.max_requests_per_client};\n    limit_conn_status 429;"
                  if site.max_requests_per_client else "")
    return f"""server {{
    listen {site.listen};
    client_max_body_size {site.max_request_bytes};
    client_body_buffer_size 64k;  # a larger body waits in a temp file (still sent again to search a moved session)
    client_header_buffer_size 1k;
    large_client_header_buffers 4 16k;
    client_header_timeout {_seconds(site.header_timeout_s)};
    client_body_timeout {_seconds(site.body_timeout_s)};
    send_timeout {timeout};
    keepalive_timeout {_seconds(site.idle_timeout_s)};{per_client}
    proxy_http_version 1.1;
    proxy_set_header Connection "";
    # Ours, never a client's: a cancel or an admin call through here, or a request id another could name.
    proxy_set_header X-Resident-Cancel "";
    proxy_set_header X-Resident-Admin-Token "";
    proxy_set_header X-Resident-Request-Id "";
    # The tenant: nginx knows only the client's address (a client's own X-Resident-Tenant is replaced).
    proxy_set_header X-Resident-Tenant "addr:$remote_addr";
    proxy_set_header X-Resident-Endpoint $resident_endpoint;
    proxy_buffering off;  # server-sent events go out as they come
    proxy_connect_timeout {connect};
    proxy_read_timeout {timeout};
    proxy_send_timeout {timeout};
    add_header X-Resident-Upstream $upstream_addr always;
    default_type application/json;

    if ($resident_plain_path = 0) {{
        return 404 '{{"error": {{"type": "not_found", "message": "no such path on this proxy"}}}}';
    }}

    location = /ping {{
        proxy_pass http://resident_any;
    }}

    location ~ ^/(invocations|predictions/[A-Za-z0-9_.-]+)$ {{
        proxy_pass http://$resident_upstream;
        # New sessions and stateless requests: skip a backend that refuses or is full (503), never one
        # that timed out (it may still be running the request).
        proxy_next_upstream error http_503 non_idempotent;
        # A session not on its tagged backend (moved by a drain), or that backend unreachable: search.
        proxy_intercept_errors on;
        error_page 404 502 = @resident_search;
    }}

    location ~ ^/v1/(chat/)?completions$ {{
        rewrite ^ /invocations break;
        proxy_pass http://$resident_upstream;
        proxy_next_upstream error http_503 non_idempotent;
        proxy_intercept_errors on;
        error_page 404 502 = @resident_search;
    }}

    location @resident_search {{
        proxy_pass http://resident_any;
        proxy_next_upstream error http_404 non_idempotent;
        proxy_next_upstream_tries 0;
    }}

    location / {{
        default_type application/json;
        return 404 '{{"error": {{"type": "not_found", "message": "no such path on this proxy"}}}}';
    }}
}}"""


def render_main(site: NginxSite, prefix: Path, user: str | None = None) -> str:
    """A whole nginx.conf running in the foreground with every path under ``prefix`` (tests, local runs)."""
    temp = "\n".join(f"    {kind}_temp_path {prefix / (kind + '_temp')};"
                     for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    http = "\n".join(("    " + line) if line else "" for line in render_http(site).splitlines())
    return (f"{'user ' + user + ';' + chr(10) if user else ''}daemon off;\nworker_processes 2;\n"
            f"pid {prefix / 'nginx.pid'};\nerror_log {prefix / 'error.log'} info;\n"
            f"events {{\n    worker_connections 1024;\n}}\n"
            f"http {{\n    access_log {prefix / 'access.log'};\n{temp}\n\n{http}\n}}\n")


def _seconds(value: float) -> str:
    return f"{max(1, round(value))}s"


def main(argv: list[str] | None = None, environ: Mapping[str, str] = os.environ) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.nginx", description=__doc__.split("\n")[0])
    parser.add_argument("--backends", help="backend URLs, comma-separated (default: RESIDENT_FRONT_BACKENDS)")
    parser.add_argument("--tags", help="their session id tags (default: RESIDENT_FRONT_BACKEND_TAGS, else b0,b1,..)")
    parser.add_argument("--listen", default="127.0.0.1:8080", help="nginx's listen address (default %(default)s)")
    parser.add_argument("--snippet", action="store_true", help="only the http-context part (for conf.d/)")
    parser.add_argument("--prefix", type=Path, default=Path("/tmp/resident-nginx"),
                        help="for a whole nginx.conf: where its pid, logs and temp files go")
    args = parser.parse_args(argv)
    env = dict(environ)
    if args.backends:
        env["RESIDENT_FRONT_BACKENDS"] = args.backends
    if args.tags:
        env["RESIDENT_FRONT_BACKEND_TAGS"] = args.tags
    try:
        site = site_from_config(FrontConfig.from_env(env), args.listen)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(render_http(site) if args.snippet else render_main(site, args.prefix.resolve()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
