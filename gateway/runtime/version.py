"""The gateway's version, from the installed package's metadata.

Read once from ``importlib.metadata`` (the version ``pip install`` recorded);
a source tree run without installing falls back to ``pyproject.toml`` beside
the package, and to ``FALLBACK`` when neither is there, so asking the version
never fails.
"""

from __future__ import annotations

import platform
import re
from functools import cache
from importlib import metadata
from pathlib import Path

DISTRIBUTION = "tap-upr-gateway"
FALLBACK = "0+unknown"
_PYPROJECT_VERSION = re.compile(r'^version\s*=\s*"([^"]+)"', re.MULTILINE)


@cache
def version() -> str:
    """This gateway's version, e.g. ``0.1.0``."""
    from_tree = _source_tree_version()
    if from_tree is not None:
        # An editable install's metadata can lag its tree; the tree is what runs.
        return from_tree
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return FALLBACK


def _source_tree_version() -> str | None:
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    try:
        text = pyproject.read_text(encoding="utf-8")
    except OSError:
        return None
    if f'name = "{DISTRIBUTION}"' not in text:
        return None
    match = _PYPROJECT_VERSION.search(text)
    return match[1] if match else None


def python_version() -> str:
    return platform.python_version()


def describe() -> str:
    """One line for ``--version``, start-up logs and VERSION replies."""
    return f"{DISTRIBUTION} {version()} (Python {python_version()})"
