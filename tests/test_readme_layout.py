"""The README's layout table names every package of the tree, and every module of
the packages whose rows list their modules, so a newcomer's map stays true."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LISTED_MODULES = ("gateway/io", "gateway/fronts/tap", "gateway/fronts/upr", "gateway/node")
"""The rows that name each of their modules."""


def layout_rows() -> dict[str, str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        found = re.match(r"\| `([^`]+)` \| (.*) \|$", line)
        if found:
            rows[found.group(1).rstrip("/")] = found.group(2)
    return rows


def packages(top: str) -> list[str]:
    return sorted(
        str(p.parent.relative_to(ROOT))
        for p in (ROOT / top).glob("*/__init__.py")
        if p.parent.name != "__pycache__"
    )


def test_every_package_has_a_row() -> None:
    rows = layout_rows()
    wanted = [*packages("gateway"), *packages("gateway/fronts")]
    missing = [p for p in wanted if p not in rows and p != "gateway/fronts"]
    assert not missing, f"README layout table lacks rows for {missing}"
    assert all(Path(ROOT, path).exists() for path in rows), "a row names no path of the tree"


def test_every_adapters_package_is_named() -> None:
    row = layout_rows()["adapters"]
    missing = [p for p in packages("adapters") if f"`{Path(p).name}" not in row]
    assert not missing, f"the adapters row does not name {missing}"


def test_the_listed_rows_name_each_module() -> None:
    rows = layout_rows()
    for package in LISTED_MODULES:
        named = set(re.findall(r"`([a-z_]+)`", rows[package]))
        modules = {p.stem for p in (ROOT / package).glob("*.py") if p.stem != "__init__"}
        new = sorted(modules - named)
        assert not new, f"add {new} to the README's layout row of {package}/ (a word each)"
