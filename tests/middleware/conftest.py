"""A real cluster for end-to-end tests: emulators, sidecars, and the example app on uvicorn."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from promptlb.emulator import Service, start_command, start_service

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Node:
    name: str
    model: Service
    sidecar: Service | None
    flags: tuple[str, ...]


@dataclass
class Cluster:
    app: Service
    nodes: dict[str, Node]
    config_path: Path
    started: list[Service] = field(default_factory=list)

    def another_app(self) -> Service:
        """A second middleware instance with the same config (the same nodes and cache)."""
        app = start_command(
            "example-app",
            [str(ROOT / "examples" / "app.py"), "--config", str(self.config_path), "--port", "0"],
        )
        self.started.append(app)
        return app

    def restart_model(self, name: str) -> Service:
        """Start the node's emulator again on the port it had (its sidecar points there)."""
        node = self.nodes[name]
        node.model.stop()
        port = str(node.model.port)
        model = start_command("emulator", ["-m", "promptlb.emulator", "--port", port, *node.flags])
        self.started.append(model)
        node.model = model
        return model


MakeCluster = Callable[..., Cluster]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[MakeCluster]:
    """``cluster({"a": ("--slots", "2"), "b": ()}, config="strategy='p2c'")``.

    Every node serves model ``m`` (unless its flags name ``--model``s of their own) and has a
    sidecar unless its flags start with ``"nosidecar"``. The config text is prepended to the
    generated ``[[nodes]]`` tables. ``app_config`` (a path) starts one more app, sharing them.
    """
    started: list[Service] = []

    def make(
        nodes: dict[str, tuple[str, ...]], config: str = "", *, sidecar_flags: tuple[str, ...] = ()
    ) -> Cluster:
        made: dict[str, Node] = {}
        tables = []
        for name, raw_flags in nodes.items():
            with_sidecar = not raw_flags or raw_flags[0] != "nosidecar"
            own = raw_flags if with_sidecar else raw_flags[1:]
            models = [own[i + 1] for i, f in enumerate(own) if f == "--model"] or ["m"]
            flags = own if "--model" in own else ("--model", "m", *own)
            model = start_service("emulator", *flags)
            started.append(model)
            sidecar = None
            if with_sidecar:
                sidecar = start_service(
                    "sidecar",
                    "--model-url",
                    model.url,
                    "--node-name",
                    name,
                    "--sample-interval",
                    "100ms",
                    "--no-warmup-required",
                    "--log-level",
                    "WARNING",
                    *sidecar_flags,
                )
                started.append(sidecar)
            made[name] = Node(name, model, sidecar, flags)
            table = f"[[nodes]]\nname = '{name}'\nurl = '{model.url}'\nmodels = {models!r}\n"
            if sidecar is not None:
                table += f"sidecar = '{sidecar.url}'\n"
            tables.append(table)
        path = tmp_path / "promptlb.toml"
        path.write_text("admin_local_only = true\n" + config + "\n" + "\n".join(tables))
        app = start_command(
            "example-app", [str(ROOT / "examples" / "app.py"), "--config", str(path), "--port", "0"]
        )
        started.append(app)
        return Cluster(app, made, path, started)

    yield make
    for service in reversed(started):
        service.stop()
