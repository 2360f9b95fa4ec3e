"""The dashboard's static files (``dashboard/``, shipped as package data): a shell with no data
in it. Its script asks for the admin token, keeps it in the tab's ``sessionStorage`` and sends
it as ``Authorization: Bearer`` when it polls ``status``: the token is never in a URL, so no
access log, proxy log or browser history holds it."""

from __future__ import annotations

from functools import cache
from importlib.resources import files

from ._asgi import Send

__all__ = ["ASSETS", "send_asset", "send_redirect"]

# name in the admin prefix -> (file, content type)
ASSETS = {
    "": ("index.html", b"text/html; charset=utf-8"),
    "dashboard.js": ("dashboard.js", b"text/javascript; charset=utf-8"),
    "dashboard.css": ("dashboard.css", b"text/css; charset=utf-8"),
}

# Only this origin's own files and requests; no inline code, no framing (clickjacking), no
# referrer carrying the page's address anywhere.
_HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        b"img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-cache"),
]


@cache
def _read(name: str) -> bytes:
    return files("promptlb.middleware").joinpath("dashboard", name).read_bytes()


async def send_asset(send: Send, name: str) -> None:
    filename, content_type = ASSETS[name]
    body = _read(filename)
    headers = [
        (b"content-type", content_type),
        (b"content-length", str(len(body)).encode()),
        *_HEADERS,
    ]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def send_redirect(send: Send, location: str) -> None:
    headers = [(b"location", location.encode("latin-1")), (b"content-length", b"0")]
    await send({"type": "http.response.start", "status": 308, "headers": headers})
    await send({"type": "http.response.body", "body": b""})
