"""Where `lorafit serve` listens, and who may ask it: requests addressed to the name it listens on (a page
whose own name was made to point at 127.0.0.1, DNS rebinding, is refused), and changes (an upload) only from the
server's own page (any other page the user has open could otherwise POST to it: a `text/plain` POST needs no CORS
preflight).

The guard is a plain ASGI middleware, so that this module needs no web framework and its answer is the API's
one-line JSON.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import socket
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from lorafit.errors import InvalidConfig

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

WILDCARDS = ("0.0.0.0", "::", "")
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def name_and_port(authority: str, default_port: int = 80) -> tuple[str, int] | None:
    """("127.0.0.1", 8765) of a Host header or an origin's "host:port"; None where it is not one."""
    try:
        parts = urlsplit("//" + authority)
        return (parts.hostname or "", parts.port or default_port) if parts.hostname else None
    except ValueError:  # a port that is not a number, an unbalanced bracket
        return None


def shown(name: str) -> str:
    return f"[{name}]" if ":" in name else name


@dataclass(frozen=True)
class Listening:
    """The address the server listens on: `host` as given to --host, `port` None where it is picked at start."""

    host: str
    port: int | None = None

    def names(self) -> tuple[str, ...] | None:
        """The host names a request may be addressed to; None: any (listening on every network)."""
        if self.host in WILDCARDS:
            return None
        own = self.host.strip("[]").lower()
        return tuple(dict.fromkeys([own, *LOOPBACK_NAMES])) if is_loopback(own) else (own,)

    def host_refusal(self, host_header: str) -> str | None:
        """Why a request with this Host header is not answered, or None."""
        names = self.names()
        if names is None:
            return None
        asked = name_and_port(host_header)
        if asked and asked[0] in names and (self.port is None or asked[1] == self.port):
            return None
        port = f":{self.port}" if self.port is not None else ""
        allowed = ", ".join(shown(name) + port for name in names)
        return f"Host {host_header or '(none)'!r} is not this server's address; it answers only as {allowed}"


def origin_refusal(headers: dict[str, str]) -> str | None:
    """Why a change (POST) is not taken from the page that sent it, or None: the browser names the sending page
    in Origin (and Sec-Fetch-Site); it must be the server's own, as the Host header names it. A request without
    either header is not from a web page (curl, a script) and is taken."""
    site = headers.get("sec-fetch-site", "")
    origin = headers.get("origin")
    if origin is None:
        return "a request from another site may not change this server" if site in ("cross-site", "same-site") else None
    parts = urlsplit(origin)
    default = 443 if parts.scheme == "https" else 80
    sender = name_and_port(parts.netloc, default) if parts.scheme in ("http", "https") else None
    if sender is not None and sender == name_and_port(headers.get("host", ""), default):
        return None
    return f"a page from {origin[:100]!r} may not change this server; use the page it serves"


class AccessGuard:
    """Answers 403 with one line to a request for another host name, or to a change from another page."""

    def __init__(self, app: App, listening: Listening) -> None:
        self.app = app
        self.listening = listening

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # the app has no websocket route; lifespan passes
            await self.app(scope, receive, send)
            return
        headers = {key.decode("latin-1").lower(): value.decode("latin-1") for key, value in scope["headers"]}
        refusal = self.listening.host_refusal(headers.get("host", ""))
        if refusal is None and scope["method"] not in SAFE_METHODS:
            refusal = origin_refusal(headers)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        body = json.dumps({"error": refusal, "field": None}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 403,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})


def check_can_listen(host: str, port: int) -> None:
    """Bind `host`:`port` as uvicorn will (each address the name has, reusable, IPv6 apart from IPv4), so that a
    bad --host or a busy --port is one line before the server starts instead of uvicorn's log and exit 3."""
    try:
        found = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as error:
        reason = getattr(error, "strerror", None) or error
        raise InvalidConfig(f"--host {host}: not an address of this machine ({reason})") from None
    families = {family for family, *_ in found}
    for family, kind, protocol, _, address in found:
        with socket.socket(family, kind, protocol) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
            except OSError as error:
                reason = error.strerror or str(error)
                if error.errno == errno.EADDRINUSE:
                    raise InvalidConfig(
                        f"--port {port}: {host}:{port} is in use by another program; pass another --port"
                    ) from None
                if error.errno == errno.EADDRNOTAVAIL and family == socket.AF_INET6 and len(families) > 1:
                    continue  # IPv6 is off on this machine: uvicorn listens on the name's IPv4 address
                flag = "--port" if error.errno == errno.EACCES else "--host"
                raise InvalidConfig(
                    f"{flag} {port if flag == '--port' else host}: cannot listen on {host}:{port} ({reason})"
                ) from None
