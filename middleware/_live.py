"""What one config builds, as one object: the middleware reads it once per request, and a
reload swaps it whole.

A request holds the `Live` it started with until it ends: its retries, fallbacks, cache and
shedding follow the config it began under, and a reload never touches it half-way. The long-
lived state (the node table and what it knows, the metrics, the upstream session, the learnt
strategy when it is unchanged) passes from each `Live` to the next through `Balancer`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields

from ._balancer import Balancer
from ._config import Config
from ._dashboard import ASSETS
from ._degrade import Dispatcher
from ._proxy import Proxy
from ._request import RequestReader

__all__ = ["Live", "build_live"]

log = logging.getLogger("promptlb.middleware")


@dataclass(frozen=True, slots=True, eq=False)
class Live:
    config: Config
    balancer: Balancer
    dispatcher: Dispatcher
    reader: RequestReader
    proxy: Proxy
    routes: frozenset[str]
    models_route: str | None
    admin: dict[str, str]  # path -> which admin page
    admin_token: bytes | None


def build_live(config: Config, previous: Live | None = None) -> Live:
    """Everything ``config`` needs, taking over ``previous``'s long-lived state when given.

    Raises `ConfigError` for anything the config's own checks could not see (a strategy
    option, a classifier that does not import, an unreadable key or token file) before any
    state shared with ``previous`` is touched: a refused reload leaves the running one whole.
    """
    config.sign_keys()  # the files are read here too, so that a bad one refuses the reload
    config.sidecar_token()
    token = config.admin_secret()
    balancer = Balancer(config, previous=previous.balancer if previous else None)
    reader = RequestReader(config, balancer.admission)
    # Last: it may retire the previous cache, which must not happen for a refused config.
    dispatcher = Dispatcher(balancer, previous=previous.dispatcher if previous else None)
    prefix = config.admin_prefix
    admin = {prefix + "/status": "status", prefix + "/metrics": "metrics", prefix: "home"}
    admin.update({f"{prefix}/{name}": f"asset:{name}" for name in ASSETS})
    return Live(
        config=config,
        balancer=balancer,
        dispatcher=dispatcher,
        reader=reader,
        proxy=Proxy(dispatcher, reader, config),
        routes=frozenset(config.routes),
        models_route=config.models_route,
        admin=admin,
        admin_token=token.encode() if token else None,
    )


def describe(old: Config, new: Config, added: list[str], removed: list[str]) -> str:
    """One log line: what a reload changed."""
    parts = []
    if added:
        parts.append("nodes added " + ", ".join(added))
    if removed:
        parts.append("nodes removed " + ", ".join(removed))
    # Every key but the nodes (told apart below): a list of keys to compare fell behind the
    # config, and a reload of [index_share] or stale_after alone logged "nothing changed".
    changed = [
        f.name
        for f in fields(new)
        if f.name != "nodes" and getattr(old, f.name) != getattr(new, f.name)
    ]
    kept = {n.name: n for n in old.nodes}
    changed += [
        f"nodes.{n.name}"
        for n in new.nodes
        if n.name in kept and n.name not in added and kept[n.name] != n
    ]
    if changed:
        parts.append("changed " + ", ".join(changed))
    return "; ".join(parts) or "nothing changed"
