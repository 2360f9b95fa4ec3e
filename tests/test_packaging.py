"""The wheel holds every package folder of the tree, under promptlb, and nothing bare."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",  # loopback only: nothing to fetch, and no version check
            "--disable-pip-version-check",
            "-q",
            "-w",
            str(out),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (built,) = out.glob("promptlb-*.whl")
    return built


def mapped_folders() -> dict[str, str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return dict(config["tool"]["setuptools"]["package-dir"])


def test_every_package_folder_of_the_tree_is_in_the_wheel(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    expected: set[str] = set()
    for package, folder in mapped_folders().items():
        # Walk the tree, not the config: a subpackage missing from the config must fail here.
        for path in (ROOT / folder).rglob("*"):
            # Code, and the data the parts read at run time: the dashboard's files, the bench's
            # scenarios (dropped from package-data, they would be missing only when installed).
            data = path.suffix in (".html", ".js", ".css") or (
                path.suffix == ".toml" and path.parent.name == "scenarios"
            )
            if path.suffix == ".py" or path.name == "py.typed" or data:
                if "__pycache__" in path.parts:
                    continue
                inside = path.relative_to(ROOT / folder).as_posix()
                expected.add(package.replace(".", "/") + "/" + inside)
    assert expected, "no package folders found"
    assert expected <= names, f"missing from the wheel: {sorted(expected - names)}"
    assert "promptlb/__init__.py" not in names  # a namespace: every part installs alone
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)  # Apache-2.0's text
    assert not [
        n
        for n in names
        if n.split("/")[0] in {"shared", "sidecar", "emulator", "middleware", "tests", "bench"}
    ]


def test_every_folder_with_code_is_mapped() -> None:
    mapped = set(mapped_folders().values())
    top = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert top - {"tests"} <= mapped, f"folders not mapped in pyproject: {top - mapped}"


def test_installed_wheel_imports_as_promptlb_only(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "--disable-pip-version-check",
            "-q",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    code = f"""
import importlib, sys
for name in ("promptlb.shared", "promptlb.sidecar", "promptlb.emulator"):
    module = importlib.import_module(name)
    assert module.__file__.startswith({str(target)!r}), (name, module.__file__)
for bare in ("middleware", "sidecar", "shared", "emulator"):
    try:
        importlib.import_module(bare)
    except ModuleNotFoundError:
        continue
    sys.exit(f"bare import {{bare}} worked")
# Installed, the bench writes under the working directory, not into site-packages.
from promptlb.bench._report import RESULTS
assert str(RESULTS) == {str(tmp_path / "bench" / "results")!r}, RESULTS
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": str(target)}
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr + result.stdout
    assert result.stdout.strip() == "ok"
    entry_points = (next(target.glob("promptlb-*.dist-info")) / "entry_points.txt").read_text()
    assert "promptlb-sidecar = promptlb.sidecar._cli:main" in entry_points
    assert "promptlb-emulator = promptlb.emulator._cli:main" in entry_points


# The distribution that provides each third-party module the parts import.
_PROVIDES = {
    "aiohttp": "aiohttp",
    "httptools": "httptools",
    "msgpack": "msgpack",
    "prometheus_client": "prometheus-client",
    "psutil": "psutil",
    "pynvml": "nvidia-ml-py",
    "redis": "redis",
    "starlette": "starlette",
    "uvicorn": "uvicorn",
    "uvloop": "uvloop",
    "yarl": "yarl",
}


def _declared(requirements: list[str]) -> set[str]:
    names = set()
    for requirement in requirements:
        name = requirement.split(";")[0]
        for stop in "<>=![ ":
            name = name.split(stop)[0]
        names.add(name.strip().lower())
    return names


@pytest.mark.parametrize("part", ["sidecar", "middleware", "emulator"])
def test_each_part_declares_what_it_imports(part: str) -> None:
    """A part installs alone (``promptlb[emulator]``): every third-party module it imports
    at load time must come with its extra. The emulator's prometheus-client did not."""
    import ast

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = _declared(project["dependencies"] + project["optional-dependencies"][part])
    missing = set()
    for path in (ROOT / part).glob("*.py"):
        for statement in ast.parse(path.read_text()).body:  # load time: not a lazy import
            if isinstance(statement, ast.Import):
                modules = [alias.name for alias in statement.names]
            elif isinstance(statement, ast.ImportFrom) and not statement.level:
                modules = [statement.module or ""]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top in sys.stdlib_module_names or top in ("promptlb", "__future__"):
                    continue
                if _PROVIDES.get(top, top) not in declared:
                    missing.add(f"{path.name}: {top}")
    assert not missing
