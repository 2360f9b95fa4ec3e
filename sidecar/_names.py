"""The model names a node serves, learnt from its model server's ``/v1/models`` and kept
fresh (the ``models`` a snapshot carries, unless ``--models`` names them)."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from promptlb.shared._snapshot import MAX_NAME_CHARS, MAX_NAMES

from ._live import Live, Problem
from ._model_server import list_models

__all__ = ["ModelNames"]

log = logging.getLogger("promptlb.sidecar")

# Once names are known they are asked for again this often, so that a model swapped on a running
# server is picked up; until then, after a growing pause capped here.
_MODELS_REFRESH_S = 60.0
_MODELS_RETRY_MAX_S = 30.0


class ModelNames:
    """The model names learnt from the model server's ``/v1/models``, kept fresh.

    An answer that fails or lists nothing never erases names already known: a snapshot without
    names tells the gateway that the node serves any model. Until some are known they are asked
    for again after a pause that doubles from one sample interval up to 30 s; once known, every
    minute.
    """

    def __init__(self, live: Live) -> None:
        self._live = live
        self._first_retry_s = live.config.sample_interval_s
        self._retry_s = self._first_retry_s
        self._due_at = 0.0  # loop time; 0: at once
        self.problem = Problem(log, "model names from /v1/models")
        self._room = live.config.learnt_names_room

    def due(self) -> bool:
        return asyncio.get_running_loop().time() >= self._due_at

    def expire(self) -> None:
        """Ask at the next chance (a new model-server process may serve another model)."""
        self._due_at = 0.0

    async def learn(self, session: aiohttp.ClientSession) -> list[str]:
        """Ask, keep the usable names listed if there are any, and answer the whole list."""
        live = self._live
        cfg = live.config
        learnt = await list_models(session, cfg.model_url, cfg.probe_timeout_s)
        # Unusable names are reported by _usable; an empty list has nothing to report on.
        names = self._usable(learnt) if learnt else ()
        now = asyncio.get_running_loop().time()
        if names:
            if live.models and names != live.models:
                log.info(
                    "model server now lists %s (was %s)", ", ".join(names), ", ".join(live.models)
                )
            live.models = names
            self._retry_s = self._first_retry_s
            self._due_at = now + _MODELS_REFRESH_S
            return learnt
        self._due_at = now + self._retry_s
        self._retry_s = min(2 * self._retry_s, _MODELS_RETRY_MAX_S)
        if not learnt and not live.models:
            self.problem.report("none learnt yet (the request failed or listed none), asking again")
        return learnt

    def _usable(self, names: list[str]) -> tuple[str, ...]:
        """The learnt names a snapshot can carry; the others are left out, logged once."""
        kept: list[str] = []
        bad: list[str] = []
        for name in names:
            if 0 < len(name) <= MAX_NAME_CHARS and _encodable(name):
                kept.append(name)
            else:
                bad.append(name)
        problems = []
        if bad:
            shown = ", ".join(repr(n[:40] + "..." if len(n) > 40 else n) for n in bad[:3])
            problems.append(
                f"{len(bad)} empty, unencodable or over {MAX_NAME_CHARS} characters ({shown})"
            )
        if len(kept) > MAX_NAMES:
            problems.append(f"{len(kept) - MAX_NAMES} beyond the first {MAX_NAMES}")
            kept = kept[:MAX_NAMES]
        # In bytes too: beside configured tags, 64 long non-ASCII names overran the snapshot's
        # size and every /snapshot was a 500.
        room, fitting = self._room, 0
        for name in kept:
            room -= len(name.encode()) + 3
            if room < 0:
                break
            fitting += 1
        if fitting < len(kept):
            problems.append(f"{len(kept) - fitting} beyond the snapshot's room")
            kept = kept[:fitting]
        if problems:
            self.problem.report("left out " + "; ".join(problems))
        else:
            self.problem.clear()
        return tuple(kept)


def _encodable(name: str) -> bool:
    try:
        name.encode("utf-8")  # JSON may carry a lone surrogate, which msgpack cannot pack
    except UnicodeEncodeError:
        return False
    return True
