"""The repository stands alone: no file in it names a path that leaves it.

A fresh clone has nothing beside it, so a test, script or doc that reaches out of the tree (a
`../` path, or `Path(__file__).parents[N]` climbing past the root) works only where someone
happened to lay that folder out, and a green CI hides the missing files.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# a parent-relative path, as far as it goes: every leading step up and the path after it
_RELATIVE = re.compile(r"(?:\.\./)+[\w.-]+(?:/[\w.-]+)*")
_PARENTS = re.compile(r"__file__\)[\w.()]*\.parents\[(\d+)\]")
_SKIP_DIRS = {".git", ".venv", "build", "dist", "__pycache__", ".mypy_cache", ".ruff_cache"}
_TEXT = {".py", ".md", ".toml", ".txt", ".cfg", ".ini", ".sh", ".yml", ".yaml", ".json", ""}


def _files(root: Path) -> list[Path]:
    """The files a clone would hold: git's view when there is one, else a walk."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=root,
            check=True,
            capture_output=True,
            timeout=60,
        ).stdout.decode()
        names = [n for n in out.split("\0") if n]
    except (OSError, subprocess.CalledProcessError):
        names = []
        for here, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.endswith(".egg-info")]
            names += [os.path.relpath(os.path.join(here, f), root) for f in files]
    return [root / n for n in names if (root / n).is_file()]


def _inside(root: Path, path: Path) -> bool:
    resolved = path.resolve()
    return resolved == root or root in resolved.parents


def escapes(root: Path, file: Path) -> list[str]:
    """What `file` names outside `root`, as `line: text` for the report."""
    if file.suffix not in _TEXT and file.name not in {"Makefile", "run"}:
        return []
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return []
    found = []
    depth = len(file.relative_to(root).parts) - 1  # parents[depth] is the root itself
    for lineno, line in enumerate(text.splitlines(), 1):
        for rel in _RELATIVE.findall(line):
            # a reference may be read from the file's folder (links) or the root (commands);
            # it is fine if either reading lands on something the repository holds
            targets = (file.parent / rel, root / rel)
            if not any(_inside(root, t) and t.exists() for t in targets):
                found.append(f"{file.relative_to(root)}:{lineno}: {rel}")
        if file.suffix == ".py":
            for level in _PARENTS.findall(line):
                if int(level) > depth:
                    found.append(f"{file.relative_to(root)}:{lineno}: parents[{level}]")
    return found


def test_no_file_names_a_path_outside_the_repository() -> None:
    files = _files(ROOT)
    assert len(files) > 100  # the scan saw the tree, not an empty folder
    found = [hit for f in files for hit in escapes(ROOT, f)]
    assert found == []


def test_the_scan_catches_both_ways_out(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    (root / "tests" / "sidecar").mkdir(parents=True)
    (root / "docs").mkdir()
    (root / "README.md").write_text("see [the guide](docs/guide.md)\n")
    (root / "docs" / "guide.md").write_text("back to [the readme](../README.md)\n")
    up = ".."
    (root / "docs" / "design.md").write_text(f"the map is `{up}/shared/DESIGN.md`\n")
    climb = "__file__).resolve().parents"  # spelt apart so that this file passes its own scan
    (root / "tests" / "sidecar" / "test_x.py").write_text(
        "from pathlib import Path\n"
        f"OK = Path({climb}[2] / 'fixtures'\n"
        f"OUT = Path({climb}[3] / 'shared'\n"
    )
    found = sorted(hit for f in _files(root) for hit in escapes(root, f))
    assert found == [
        f"docs/design.md:1: {up}/shared/DESIGN.md",
        f"tests/sidecar/test_x.py:3: {climb.rsplit('.', 1)[1]}[3]",
    ]


def test_examples_cited_by_the_examples_exist() -> None:
    """A file the examples tell a reader to pass (a config under examples/) is shipped."""
    cited = re.compile(r"\bexamples/[\w./-]+\.\w+")
    missing = [
        f"{f.relative_to(ROOT)}: {name}"
        for f in _files(ROOT)
        if f.suffix in {".py", ".md", ".toml"}
        for name in cited.findall(f.read_text(encoding="utf-8"))
        if not (ROOT / name).exists()
    ]
    assert missing == []
