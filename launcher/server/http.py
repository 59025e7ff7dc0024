"""The HTTP layer's defences: what a request must look like before any of it is parsed.

- **Bodies**: JSON only (`Content-Type: application/json`, else 415); a `Content-Length` above
  `server.max_body_bytes` is refused before a byte is read (also before `100 Continue`), and a
  body must arrive within `server.read_timeout_s` (else 408). Headers must arrive within
  `server.keepalive_timeout_s` of the connection opening or of the previous reply (aiohttp's
  keep-alive timer runs from the connection's start, and closes a connection whose request
  is incomplete when it fires), so a client cannot hold sockets open by trickling bytes.
- **JSON**: nesting deeper than `MAX_JSON_DEPTH` and strings that are not valid Unicode (lone
  surrogates, which JSON's `\\ud800` escapes can carry) are a 400 naming what is wrong.
- **Where a request comes from**: a server bound to loopback answers only requests whose `Host`
  is a loopback name (and whose `Origin`, when a browser sends one, is too), so a web page
  on this host cannot drive it through DNS rebinding.
- **What the server says about itself**: one `Server: lockstep` header, on aiohttp's own
  error replies too, and one log line (no traceback) for a request aiohttp could not parse.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
from typing import Any
from urllib.parse import urlsplit

import aiohttp.web_response
from aiohttp import hdrs, web

from launcher.server.protocol import RequestError, shorten

SERVER_NAME = "lockstep"
MAX_JSON_DEPTH = 32
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})

# aiohttp's replies to requests it cannot parse (a bad request line, an oversized header) never
# reach the application's response signals; their Server header comes from this constant,
# which otherwise names aiohttp's and Python's versions.
aiohttp.web_response.SERVER_SOFTWARE = SERVER_NAME


async def set_server_header(request: web.Request, response: web.StreamResponse) -> None:
    response.headers[hdrs.SERVER] = SERVER_NAME


class OneLineLogger(logging.LoggerAdapter):
    """aiohttp's server logger, with each error it logs (a request it could not parse, a
    client that went away) as one warning line instead of a traceback."""

    def exception(self, msg: object, *args: Any, exc_info: Any = True, **kwargs: Any) -> None:
        error = exc_info if isinstance(exc_info, BaseException) else None
        detail = f": {type(error).__name__}: {shorten(str(error), 200)}" if error else ""
        self.warning(f"{msg}{detail}", *args, **kwargs)


def is_loopback(host: str) -> bool:
    """A host name or address that only this machine can reach."""
    host = host.strip("[]").lower()
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_origin(request: web.Request, bound_host: str) -> None:
    """For a server bound to loopback: refuse a request that names another host."""
    if not is_loopback(bound_host):
        return
    host = request.headers.get(hdrs.HOST, "")
    name = urlsplit(f"//{host}").hostname if host else None
    if name is None or not is_loopback(name):
        raise RequestError(
            f"this server listens on {bound_host} and answers only requests for a loopback "
            f"host; Host is {shorten(host)}",
            status=421,
            code="misdirected_request",
        )
    origin = request.headers.get(hdrs.ORIGIN)
    if origin is not None and origin != "null":
        origin_host = urlsplit(origin).hostname
        if origin_host is None or not is_loopback(origin_host):
            raise RequestError(
                f"requests from the web origin {shorten(origin)} are not allowed",
                status=403,
                code="forbidden_origin",
            )


def check_body_headers(request: web.Request, max_body_bytes: int) -> None:
    """The headers of a request with a body: JSON, and not announced larger than allowed."""
    if request.content_type != "application/json":
        raise RequestError(
            f"the request body must be JSON (Content-Type: application/json), got "
            f"{shorten(request.headers.get(hdrs.CONTENT_TYPE, '(none)'))}",
            status=415,
        )
    length = request.content_length
    if length is not None and length > max_body_bytes:
        raise RequestError(
            f"the request body ({length} bytes) is larger than server.max_body_bytes "
            f"({max_body_bytes} bytes)",
            status=413,
        )


async def read_body(request: web.Request, max_body_bytes: int, timeout_s: float) -> bytes:
    """The body's bytes, within the size limit and the time limit."""
    check_body_headers(request, max_body_bytes)
    try:
        return await asyncio.wait_for(request.read(), timeout_s)
    except web.HTTPRequestEntityTooLarge:  # a chunked body that grew past client_max_size
        raise RequestError(
            f"the request body is larger than server.max_body_bytes ({max_body_bytes} bytes)",
            status=413,
        ) from None
    except asyncio.TimeoutError:
        raise RequestError(
            f"the request body did not arrive within server.read_timeout_s ({timeout_s} s)",
            status=408,
        ) from None


def parse_json(raw: bytes) -> Any:
    """The body as JSON, refusing what could not be handled downstream (too deep, not
    Unicode)."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise RequestError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as error:
        raise RequestError(f"the request body is not valid JSON: {shorten(str(error))}") from None
    check_json(value)
    return value


def check_json(value: Any) -> None:
    """Walk the value without recursion: depth at most MAX_JSON_DEPTH, every string (keys
    too) encodable as UTF-8."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise RequestError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(item, str):
            _check_text(item)
        elif isinstance(item, dict):
            for key, child in item.items():
                _check_text(key)
                stack.append((child, depth + 1))
        elif isinstance(item, list):
            stack.extend((child, depth + 1) for child in item)


def _check_text(text: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise RequestError(
            f"the request holds a string that is not valid Unicode ({error.reason} at "
            f"character {error.start}: {shorten(text[max(0, error.start - 10) : error.start])}"
            "...)"
        ) from None
