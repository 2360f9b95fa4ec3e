"""One balanced request, read once: the body raw and parsed, the client's headers, and what
routing needs (model, size, priority, class, affinity key), carried down the whole path.

`RequestReader` is the one place a request is read: the proxy reads it off the ASGI
connection, the in-app client builds it from a body, and both get the same `Request`.
"""

# Over 350 lines: the reader and the checks a body must pass before any node sees it (the
# size, the JSON, its depth and surrogates, the model and token limits), read together as the
# one place a request is judged.

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, TypeGuard
from urllib.parse import quote_from_bytes

from promptlb.shared import BYTES_PER_TOKEN, first_ids

from ._affinity import KeyMaker
from ._asgi import Receive, Scope
from ._classify import Classifier, load_classifier
from ._config import Config, RequestsConfig
from ._config_base import MODEL_CHARS
from ._prefix import body_blocks
from ._refusals import BadRequest, TooLarge
from ._shedding import Admission
from ._view import Priority, RouteRequest

__all__ = ["Request", "RequestReader", "caller_names"]

Headers = list[tuple[bytes, bytes]]

# Headers that name whose request it is, which the nodes get as the client sent them (Azure's
# api-key, x-api-key, OpenAI's organisation and project); Authorization when forwarded.
_CALLER = (b"api-key", b"x-api-key", b"openai-organization", b"openai-project")


def caller_names(authorization: bool, extra: Iterable[str] = ()) -> tuple[bytes, ...]:
    """The headers `Request.caller` reads: the usual credentials, ``Authorization`` when it is
    forwarded (``authorization``), and the configured ``caller_headers`` (``extra``)."""
    names = ((b"authorization",) if authorization else ()) + _CALLER
    return names + tuple(
        dict.fromkeys(n.lower().encode() for n in extra if n.lower().encode() not in names)
    )


_MAX_TOKENS = 10_000_000  # beyond any context window: a value over it is not a length
_YES = (b"1", b"true", b"yes")
# Text no UTF-8 encoder takes: a tokenizer fails on it, and the node answers 500.
_SURROGATE = re.compile("[\ud800-\udfff]")
_QUERY_KEPT = "".join(chr(b) for b in range(0x21, 0x7F) if b != 0x23)  # printable, bar "#"


@dataclass(slots=True)
class Request:
    """What the client asked, as the nodes will get it."""

    path: str  # the route, as the cache and the stream replay know it
    target: str  # the path and query string sent upstream
    raw: bytes  # the body as the node gets it
    body: Mapping[str, Any]  # ... parsed
    headers: Headers  # the client's, as received
    route: RouteRequest  # what the strategy sees
    no_fallback: bool = False  # the client asked for no fallback chain

    @property
    def model(self) -> str:
        return self.route.model

    def header(self, name: bytes) -> bytes | None:
        """The client's header ``name`` (lower case), the first if sent twice; None if not."""
        return next((v for k, v in self.headers if k == name), None)

    def caller(self, names: tuple[bytes, ...]) -> tuple[bytes | None, ...]:
        """Whose request it is, as the nodes are told: the value of each header of ``names``
        (`caller_names`), None for each one absent. An answer or a merged batch is shared only
        among requests of one caller: a node may answer each key differently, or refuse one."""
        found = dict.fromkeys(names)
        for name, value in self.headers:
            if name in found and found[name] is None:
                found[name] = value
        return tuple(found.values())

    def for_model(self, model: str) -> Request:
        """The same request to another model (a fallback hop): the body names it."""
        if model == self.route.model:
            return self
        body = {**self.body, "model": model}
        return replace(self, raw=_dumps(body), body=body, route=replace(self.route, model=model))

    def with_body(self, body: Mapping[str, Any]) -> Request:
        """The same request with another body (the batcher's merged one), asking for an
        answer the gateway can read and split: without the caller's Accept-Encoding (the
        session does not decompress, and a node that compresses would answer gzip)."""
        raw = _dumps(body)
        headers = [(k, v) for k, v in self.headers if k != b"accept-encoding"]
        route = replace(self.route, input_tokens=_tokens(raw))
        return replace(self, raw=raw, body=body, headers=headers, route=route)


def _tokens(raw: bytes) -> int:
    # About four bytes a token: a body-size estimate costs nothing and ranks prompts right.
    return len(raw) // 4


def _count(value: object) -> TypeGuard[int]:
    """A token count: a positive integer, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _plausible(max_tokens: object) -> TypeGuard[int]:
    """A ``max_tokens`` routing may believe (the node still gets the body as sent)."""
    return _count(max_tokens) and max_tokens <= _MAX_TOKENS


# The answer's length fields, in the order a node reads them: vLLM and SGLang take
# ``max_completion_tokens or max_tokens`` (a completions body, read as its endpoint reads it,
# has no ``max_completion_tokens``: `_as_read`).
_LENGTH_KEYS = ("max_completion_tokens", "max_tokens")


def _length_field(body: Mapping[str, Any]) -> tuple[str, int] | None:
    """The field a node takes the answer's length from, and its value."""
    for key in _LENGTH_KEYS:
        value = body.get(key)
        if _count(value):
            return key, value
    return None


def _length_fields(body: Mapping[str, Any]) -> list[tuple[str, int]]:
    """Both length fields that hold a count."""
    return [(key, value) for key in _LENGTH_KEYS if _count(value := body.get(key))]


def asked_tokens(body: Mapping[str, Any]) -> int | None:
    """The answer's length ``body`` asks, as a node reads it (`_length_field`), when routing
    may believe it. Read the other way round, a request for 5,000 tokens with max_tokens 100
    read as a short answer: its slow try was charged to the node, and a lighter model fitted
    to 100 answered 400."""
    found = _length_field(body)
    return found[1] if found is not None and _plausible(found[1]) else None


def route_of(
    body: Mapping[str, Any],
    size: int,
    priority: Priority = "standard",
    prompt_class: str = "",
    session_key: str | None = None,
) -> RouteRequest:
    tokens = size // BYTES_PER_TOKEN
    ids = first_ids(body)  # a batch by its first
    if ids is not None and type(ids[0]) is int:
        tokens = len(ids)  # token ids are counted: their JSON is 1.4-1.8 times as long
    return RouteRequest(
        model=body["model"],
        input_tokens=tokens,
        max_tokens=asked_tokens(body),
        stream=body.get("stream") is True,
        session_key=session_key,
        priority=priority,
        prompt_class=prompt_class,
        # Hashed as the engine will see the prompt (its chat template's text, not this JSON):
        # the same conversation sent with other spacing or key order is the same prefix.
        blocks=body_blocks(body, size),
    )


class _ClientGone(Exception):
    pass


class RequestReader:
    """Reads requests per the config: the body limit, the class (a trusted header, else the
    classifier when something routes by class), the affinity key (only under [affinity]) and
    the priority (raised only for trusted clients)."""

    def __init__(self, config: Config, admission: Admission) -> None:
        self.limit = config.max_body_bytes
        self.checks = config.requests
        header = config.class_header
        self._class_header = header.lower().encode() if header else None
        # Classes cost a scan of the prompt: only when something routes by them.
        wanted = config.strategy == "model_aware" or config.classifier is not None
        self.classify: Classifier | None = load_classifier(config.classifier) if wanted else None
        # Keys cost a look at the body (and a hash of a long prompt's head).
        affinity = config.affinity
        self.keys: KeyMaker | None = KeyMaker(affinity) if affinity is not None else None
        self._admission = admission

    async def read(self, scope: Scope, receive: Receive) -> Request | None:
        """The request on this connection; None when the client left while sending it.
        Raises `BadRequest` (and `TooLarge`) for what no node should see."""
        priority = token = asked_class = None
        no_fallback = False
        class_header = self._class_header
        headers: Headers = scope["headers"]
        for name, value in headers:
            if name == b"content-length":
                # (Its length first: past 4,300 digits int() raises, a 500 for a 413.)
                digits = value.lstrip(b"0")
                if value.isdigit() and (len(digits) > 19 or int(digits or b"0") > self.limit):
                    raise TooLarge(self.limit)
            elif name.startswith(b"x-promptlb-"):
                if name == b"x-promptlb-priority":
                    priority = value
                elif name == b"x-promptlb-priority-token":
                    token = value
                elif name == b"x-promptlb-no-fallback":
                    no_fallback = value.strip() in _YES
            if name == class_header:
                asked_class = value.decode("latin-1").strip()
        # Its deadline (``requests.body_timeout``) is the caller's `RequestWatch`: one timer
        # per request for that and the disconnect watch.
        try:
            raw = await _read_body(receive, self.limit)
        except _ClientGone:
            return None
        rank: Priority = "standard"
        if priority is not None:
            rank = self._admission.priority(priority, token, scope.get("client"))
        query = scope.get("query_string")
        path = scope["path"]
        target = path + "?" + _query(query) if query else path
        body = _parse(raw, self.checks)
        return self._build(path, target, raw, body, headers, rank, asked_class, no_fallback)

    def build(self, path: str, body: Mapping[str, Any], headers: Headers | None = None) -> Request:
        """The in-app client's request: ``body`` as it would arrive over HTTP."""
        raw = _dumps(body)
        if len(raw) > self.limit:  # as over HTTP: no node sees what the proxy refuses
            raise TooLarge(self.limit)
        sent = headers if headers is not None else [(b"content-type", b"application/json")]
        return self._build(path, path, raw, _parse(raw, self.checks), sent, "standard", None, False)

    def _build(
        self,
        path: str,
        target: str,
        raw: bytes,
        body: dict[str, Any],
        headers: Headers,
        priority: Priority,
        asked_class: str | None,
        no_fallback: bool,
    ) -> Request:
        # Routing reads the prompt its endpoint reads (for the blocks, the size in tokens, the
        # affinity key and the class): the one place the endpoint decides, not each reader.
        chat = _endpoint(path)
        read = _as_read(body, chat)
        # A length no context holds only ties a node up until the try times out. On a chat or
        # completions route only the field its node reads (the other, ignored, refused a
        # request it would answer); on embeddings neither, which its node ignores; elsewhere
        # both, as no reading is known.
        found = _length_field(read)
        if found is not None and not path.endswith("/embeddings"):
            limit = self.checks.token_limit(body["model"])
            for key, asked in (found,) if chat is not None else _length_fields(read):
                if asked > limit:
                    message = f"`{key}` is {asked}; at most {limit} for this model"
                    raise BadRequest(message, param=key)
        prompt_class = asked_class or (self.classify(read) if self.classify is not None else "")
        keys = self.keys
        session_key = keys(read, keys.header_value(headers)) if keys is not None else None
        route = route_of(read, len(raw), priority, prompt_class, session_key)
        return Request(path, target, raw, body, headers, route, no_fallback)


def _as_read(body: dict[str, Any], chat: bool | None) -> dict[str, Any]:
    """``body`` as its endpoint reads it: without the other endpoint's prompt field when it
    carries it, nor a completion's ``max_completion_tokens`` (a chat field its endpoint
    ignores: read, it excused a node 50 times the time asked). Rare: a copy then only."""
    if chat:
        other: tuple[str, ...] = ("prompt",)
    elif chat is False:
        other = ("messages", "max_completion_tokens")
    else:
        return body
    if not any(key in body for key in other):
        return body
    return {k: v for k, v in body.items() if k not in other}


def _endpoint(path: str) -> bool | None:
    """Whether a route is a chat one (the engine reads ``messages``) or a completions one (it
    reads ``prompt``), whatever else the body carries; None for another."""
    if path.endswith("/chat/completions"):
        return True
    return False if path.endswith("/completions") else None


async def _read_body(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise TooLarge(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _query(raw: bytes) -> str:
    """The query string as the client sent it, its escapes kept, and any byte outside printable
    ASCII escaped (the URL is passed on as encoded: re-quoted, ``?q=é`` reached the node
    encoded twice and a malformed ``%zz`` as ``%25zz``)."""
    return quote_from_bytes(raw, safe=_QUERY_KEPT)


def _parse(raw: bytes, checks: RequestsConfig) -> dict[str, Any]:
    """The body, if it is one no node should fail on: `BadRequest` otherwise."""
    text = None
    try:
        text = _text(raw)
        body = json.loads(text)
    except (ValueError, UnicodeDecodeError, RecursionError):
        # RecursionError: a deeply nested body is bad input, not a crash.
        raise BadRequest("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("`model` is required", param="model")
    if len(model) > MODEL_CHARS or not model.isprintable():
        # It is echoed in the x-promptlb-model header: a control character there made the
        # server drop the connection with no answer at all (a node naming no model takes any).
        raise BadRequest(
            f"`model` must be printable text of at most {MODEL_CHARS} characters", param="model"
        )
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        # A node may take "true" for true and stream, where routing and the cache took the
        # request as not streaming.
        raise BadRequest("`stream` must be true or false", param="stream")
    depth = checks.max_json_depth
    # The walk visits every value, so it runs only when it can find something: a body with
    # fewer brackets than the depth limit is not too deep, and one without a \ud escape holds
    # no lone surrogate (UTF-8 cannot encode one; `_text` refused such bytes above). A UTF-16
    # or UTF-32 body spells neither in these bytes: it is walked whole.
    other = isinstance(text, bytes)
    deep = other or raw.count(b"[") + raw.count(b"{") > depth
    escaped = other or b"\\ud" in raw or b"\\uD" in raw
    if deep or escaped:
        _walk(body, depth if deep else None, escaped)
    return body


def _text(raw: bytes) -> str | bytes:
    """The body as text for `json.loads`: decoded here when it is UTF-8 (what JSON between
    systems is, RFC 8259), since json.loads of bytes guesses the encoding on every call. A UTF-8
    byte-order mark is dropped; UTF-16 and UTF-32 (a zero byte among the first four) go to
    json.loads as bytes, which reads them as before. Bytes that are none of these are not JSON:
    UTF-8 text cannot hold a lone surrogate, which no node's tokenizer takes."""
    if b"\x00" in raw[:4]:
        return raw
    text = raw.decode()
    return text[1:] if text.startswith("\ufeff") else text


_NESTED = (dict, list)


def _dumps(body: Mapping[str, Any]) -> bytes:
    """A body as JSON in UTF-8, as clients send it: ASCII escapes (json.dumps's default) made
    a request in another script twice as long, or six times, than the proxy forwards (the
    limit, the node's bytes and the size estimate the strategies read all differed). Text with
    a lone surrogate, which UTF-8 cannot hold, is escaped, and the checks refuse it by name."""
    try:
        return json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return json.dumps(body).encode()


def _walk(body: dict[str, Any], max_depth: int | None, surrogates: bool) -> None:
    """Raise `BadRequest` for nesting deeper than ``max_depth`` or a string (key or value)
    with an unpaired surrogate. Iterative: the body may be as deep as json.loads allows.

    Only what can fail is visited: containers, and strings when looking for surrogates (json
    gives exact types, so a class check is enough). A value's path is worked out only for
    the error, from its parents: pushing every value with its path spelled out took 1.3 s of
    the event loop for a 4 MB embeddings body of token arrays, now a scan of each list in C."""
    parents: list[tuple[int, str | int]] = [(-1, "")]  # per container: its parent's, its key
    stack: list[tuple[dict[str, Any] | list[Any], int, int]] = [(body, 1, 0)]
    while stack:
        value, depth, at = stack.pop()
        if max_depth is not None and depth > max_depth:
            raise BadRequest(f"request body nests deeper than {max_depth} levels")
        if value.__class__ is dict:
            items: Any = value.items()
        else:
            items = enumerate(value)
        if surrogates:
            for key, item in items:
                if key.__class__ is str and _SURROGATE.search(key):
                    raise _unpaired(parents, at)
                if item.__class__ is str:
                    if _SURROGATE.search(item):
                        parents.append((at, key))
                        raise _unpaired(parents, len(parents) - 1)
                elif item.__class__ in _NESTED:
                    parents.append((at, key))
                    stack.append((item, depth + 1, len(parents) - 1))
            continue
        inner = [(key, item) for key, item in items if item.__class__ in _NESTED]
        for key, item in inner:
            parents.append((at, key))
            stack.append((item, depth + 1, len(parents) - 1))


def _unpaired(parents: list[tuple[int, str | int]], at: int) -> BadRequest:
    return BadRequest(
        "text with an unpaired UTF-16 surrogate cannot be encoded", param=_path(parents, at)
    )


def _path(parents: list[tuple[int, str | int]], at: int) -> str | None:
    """``messages[0].content``: the value ``at`` as the error's ``param``; None for the body."""
    keys: list[str | int] = []
    while at > 0:
        at, key = parents[at]
        keys.append(key)
    path = ""
    for key in reversed(keys):
        if isinstance(key, int):
            path += f"[{key}]"
        else:
            path = f"{path}.{key}" if path else key
    return path or None
