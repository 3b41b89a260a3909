"""Browser safety at the door: which Origins and Host headers may drive the server, and POST bodies as JSON.

A web page the user visits can send requests to a server on the user's own
machine. Three rules keep such pages out by default (Ollama's defaults,
and its fix for DNS rebinding, CVE-2024-28224):

- an ``Origin`` header (browsers send one on every cross-origin request) must
  be a loopback origin (``http(s)://localhost|127.0.0.1|[::1]``, any port),
  the server's own (the ``Host`` it was reached by), or one given with
  ``--allowed-origins``; otherwise 403. Refusing, not merely
  leaving out the CORS headers, matters: a "no-cors" request still runs;
- on a loopback bind, the ``Host`` header must name a loopback host or one
  given with ``--allowed-hosts``; otherwise 403. A DNS-rebinding page reaches
  127.0.0.1 under its own name, and its requests carry that name;
- a POST with a body must say ``Content-Type: application/json``: a page can
  send ``text/plain`` or a form cross-origin without a CORS preflight (415).

Pure ASGI (streams pass through untouched), decided by ``GuardPolicy.refusal``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mlxq.server.errors import APIError, error_response

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
LOOPBACK_ORIGIN_REGEX = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d{1,5})?"
_LOOPBACK_ORIGIN = re.compile(LOOPBACK_ORIGIN_REGEX)
_JSON_TYPES = ("application/json",)


def host_name(host_header: str) -> str:
    """``example.com:8080`` -> ``example.com``; ``[::1]:8080`` -> ``::1``; lower-cased."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    if host.count(":") == 1:
        return host.split(":", 1)[0]
    return host


@dataclass(frozen=True)
class GuardPolicy:
    allowed_origins: tuple[str, ...] = ()  # beyond the loopback origins; "*" allows every origin
    allowed_hosts: tuple[str, ...] = ()  # beyond the loopback names; "*" turns the Host check off
    check_host: bool = True  # on loopback binds (elsewhere the host names are the operator's own)

    @classmethod
    def of(cls, config) -> GuardPolicy:
        """The policy of a ``ServerConfig``."""
        return cls(config.allowed_origins, config.allowed_hosts, check_host=config.is_loopback)

    def origin_allowed(self, origin: str, host: bytes | None = None) -> bool:
        """Allowed, loopback, or the server's own origin (a page it served, e.g. /dashboard on a LAN address:
        same-origin, and on loopback binds its ``Host`` has already passed the Host check)."""
        return ("*" in self.allowed_origins or origin in self.allowed_origins
                or _LOOPBACK_ORIGIN.fullmatch(origin) is not None
                or (host is not None and origin.lower() in _own_origins(host.decode("latin-1"))))

    def host_allowed(self, host_header: str | None) -> bool:
        if not self.check_host or host_header is None or "*" in self.allowed_hosts:
            return True
        name = host_name(host_header)
        return name in LOOPBACK_HOSTS or name in {h.lower() for h in self.allowed_hosts}

    def refusal(self, method: str, headers: dict[bytes, bytes]) -> APIError | None:
        """Why this request may not proceed, or None."""
        host = headers.get(b"host")
        if not self.host_allowed(None if host is None else host.decode("latin-1")):
            return APIError(403, f"Host {host.decode('latin-1')!r} is not allowed on this loopback server "
                                 "(DNS rebinding protection); add it with --allowed-hosts",
                            type="permission_error", code="host_not_allowed")
        origin = headers.get(b"origin")
        if origin is not None and not self.origin_allowed(origin.decode("latin-1"), host):
            return APIError(403, f"Origin {origin.decode('latin-1')!r} is not allowed; add it with "
                                 "--allowed-origins", type="permission_error", code="origin_not_allowed")
        if method == "POST" and _has_body(headers) and not _is_json(headers.get(b"content-type", b"")):
            return APIError(415, "POST bodies must be sent with 'Content-Type: application/json'",
                            type="invalid_request_error", code="unsupported_media_type")
        return None


def _own_origins(host_header: str) -> tuple[str, str]:
    host = host_header.strip().lower()
    return f"http://{host}", f"https://{host}"


def _has_body(headers: dict[bytes, bytes]) -> bool:
    return headers.get(b"content-length", b"0").strip() not in (b"0", b"") or b"transfer-encoding" in headers


def _is_json(content_type: bytes) -> bool:
    media = content_type.split(b";", 1)[0].strip().lower().decode("latin-1")
    return media in _JSON_TYPES


class Guard:
    """Pure ASGI middleware applying a ``GuardPolicy`` to every HTTP request."""

    def __init__(self, app, policy: GuardPolicy):
        self.app = app
        self.policy = policy

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            err = self.policy.refusal(scope["method"], dict(scope.get("headers") or []))
            if err is not None:
                return await error_response(err, scope["path"])(scope, receive, send)
        return await self.app(scope, receive, send)
