"""The tree keeps the shape the design card gives it: protocol code in ``adapters/``
without I/O, one meaning per class name, nothing loose at the ``gateway/`` root.

Read from the source (``ast``), nothing is imported."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PURE_MODULES = frozenset(
    {
        "__future__",
        "abc",
        "array",
        "binascii",
        "bisect",
        "collections",
        "contextlib",
        "copy",
        "dataclasses",
        "enum",
        "functools",
        "hashlib",
        "heapq",
        "itertools",
        "math",
        "numbers",
        "operator",
        "random",
        "re",
        "struct",
        "types",
        "typing",
        "weakref",
        "zlib",
    }
)
"""What sans-IO code may import besides ``adapters``: no sockets, clocks, files,
threads or event loop (``random`` takes its generator from the caller)."""

SHARED_NAMES: dict[str, str] = {}
"""Class names defined in more than one module, each with where and why."""


def modules(top: str) -> list[Path]:
    return sorted(p for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts)


def imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_adapters_import_no_io() -> None:
    found = {
        str(path.relative_to(ROOT)): sorted(imported(path) - PURE_MODULES - {"adapters"})
        for path in modules("adapters")
    }
    assert not {path: names for path, names in found.items() if names}


def test_each_class_name_means_one_thing() -> None:
    where: defaultdict[str, list[str]] = defaultdict(list)
    for top in ("adapters", "gateway"):
        for path in modules(top):
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.ClassDef):
                    where[node.name].append(str(path.relative_to(ROOT)))
    twice = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert set(twice) <= set(SHARED_NAMES), {n: twice[n] for n in set(twice) - set(SHARED_NAMES)}


def test_the_gateway_root_holds_only_the_package() -> None:
    loose = {p.name for p in (ROOT / "gateway").glob("*.py")}
    assert loose == {"__init__.py", "__main__.py"}, "entry points go in gateway/cli/"
