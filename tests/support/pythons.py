"""Interpreters that lack some packages, to run commands as on a machine without them."""

from __future__ import annotations

import site
import sys
from pathlib import Path


def python_without(tmp: Path, *prefixes: str) -> Path:
    """A wrapper running this Python with its site-packages minus ``prefixes`` (lower case).

    ``-S`` turns off site processing, so ``.pth`` files (and the editable install
    of this package) are not read; the filtered site-packages come after any
    PYTHONPATH the caller sets.
    """
    lib = tmp / ("site-without-" + "-".join(p.strip("_") for p in prefixes))
    lib.mkdir()
    for root in site.getsitepackages():
        for entry in Path(root).iterdir():
            if entry.suffix == ".pth" or entry.name.lower().startswith(prefixes):
                continue
            if not (lib / entry.name).exists():
                (lib / entry.name).symlink_to(entry)
    wrapper = tmp / f"python-{lib.name}"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'PYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}{lib}"\nexport PYTHONPATH\n'
        f'exec {sys.executable} -S "$@"\n'
    )
    wrapper.chmod(0o755)
    return wrapper
