"""Every way the middleware answers without a node's answer, and how each is told.

A `Refusal` knows its status, its OpenAI-shaped error body and its headers, so the proxy, the
embedding batcher and the in-app client answer one refusal alike: there is one mapping from a
failure to a response, and it is here. Strategies raise `NoNodeAvailable`, the balancer
`UnknownModel` and `UpstreamError`, admission `Shed`, the fallback chain `Exhausted`, and the
request reader `BadRequest` (and `TooLarge`, `SlowBody`); nothing else turns an exception into a
status. Messages name no node: under DNS discovery a node's name is its address, and what a
client is told must not map the inside of the cluster (the log has the detail).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "BadRequest",
    "Exhausted",
    "NoNodeAvailable",
    "Refusal",
    "Shed",
    "SlowBody",
    "TooLarge",
    "UnknownModel",
    "UpstreamError",
    "error_body",
]


def error_body(status: int, message: str, kind: str, param: str | None = None) -> dict[str, Any]:
    """An error in the OpenAI shape, so that the official clients raise the right exception."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


class Refusal(Exception):
    """No answer for the client: ``status``, ``kind`` (the OpenAI error type) and ``param``
    say how; ``attempts`` is how many node tries it took, when any were made."""

    status = 500
    kind = "internal_error"
    param: str | None = None
    attempts: int | None = None
    # The client may come back after the health checks had a round (503s); None: no hint.
    retry_after: int | None = None
    later = False
    close = False  # the connection is not to be reused (its client is not to be trusted)

    def error(self) -> dict[str, Any]:
        return error_body(self.status, str(self), self.kind, self.param)

    def headers(self, retry_after: bytes) -> list[tuple[bytes, bytes]]:
        """``retry_after`` is the gateway's default hint (its health-check interval), used
        when the refusal carries none of its own."""
        out = []
        if self.attempts is not None:
            out.append((b"x-promptlb-attempts", str(self.attempts).encode()))
        if self.retry_after is not None:
            out.append((b"retry-after", str(self.retry_after).encode()))
        elif self.later:
            out.append((b"retry-after", retry_after))
        if self.close:
            out.append((b"connection", b"close"))
        return out


class BadRequest(Refusal):
    """The request itself is wrong: answered 400, never tried on a node."""

    status = 400
    kind = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class TooLarge(BadRequest):
    status = 413
    # The rest of the body would be read and thrown away on a kept-alive connection: a
    # declared terabyte trickled a byte at a time held it open for good.
    close = True

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body over {limit} bytes")


class SlowBody(BadRequest):
    """The client did not send its body within ``requests.body_timeout``: a slow client holds a
    connection and a task for as long as it likes otherwise (slowloris)."""

    status = 408
    close = True  # what is left of its body would be read as the next request

    def __init__(self, timeout: float) -> None:
        super().__init__(f"request body not received within {timeout:g}s")


class UnknownModel(Refusal, LookupError):
    status = 404
    kind = "model_not_found"
    param = "model"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.")
        self.model = model


class NoNodeAvailable(Refusal):
    """No candidate node can take a request for ``model``."""

    status = 503
    kind = "service_unavailable"
    later = True

    def __init__(self, model: str, reason: str = "no candidate node") -> None:
        # Both in args, so that the exception survives pickling (a simulator's worker pool).
        super().__init__(model, reason)
        self.model = model
        self.reason = reason

    def __str__(self) -> str:
        return f"no node available for model {self.model!r}: {self.reason}"


class UpstreamError(Refusal):
    """Every try failed before a response could be passed on: ``status`` is the last
    failure's (502 for a broken connection, 504 for a timeout, or the node's 5xx/429)."""

    kind = "upstream_error"
    later = True

    def __init__(self, status: int, message: str, attempts: int) -> None:
        super().__init__(message)
        self.status = status
        self.attempts = attempts


class Shed(Refusal):
    """The pool is saturated and the request may not wait (or waited long enough)."""

    status = 429
    kind = "rate_limit_error"

    def __init__(self, model: str, retry_after: int) -> None:
        super().__init__(f"model {model!r} is saturated; retry later")
        self.model = model
        self.retry_after = retry_after


class Exhausted(Refusal):
    """Every hop of the fallback chain failed and no cached answer was there."""

    status = 503
    kind = "service_unavailable"
    later = True

    def __init__(self, model: str, failures: list[str], attempts: int) -> None:
        super().__init__(f"no answer for {model!r}: " + "; ".join(failures))
        self.model = model
        self.attempts = attempts
