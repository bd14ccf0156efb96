"""Debian's headless Chromium, driven from the command line: the DOM after the
page's scripts ran (``--dump-dom``), or a screenshot.

Each run gets a fresh ``--user-data-dir`` and the switches that keep it off
the network (no component updates, sync or background fetches). The
``--virtual-time-budget`` lets the page's timers and fetches run before the
DOM is read. ``CHROMIUM`` is ``None`` when the package is missing
(``scripts/test`` installs it).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import trio

CHROMIUM = shutil.which("chromium")
MISSING = "the Debian chromium package is not installed (scripts/test installs it)"
RUN_TIMEOUT = 90.0
SWITCHES = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--hide-scrollbars",
)  # fmt: skip


async def _run(url: str, *switches: str, budget_ms: int) -> bytes:
    assert CHROMIUM is not None, MISSING
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        command = [
            CHROMIUM, *SWITCHES, f"--user-data-dir={profile}",
            f"--virtual-time-budget={budget_ms}", *switches, url,
        ]  # fmt: skip
        with trio.fail_after(RUN_TIMEOUT):
            done = await trio.run_process(command, capture_stdout=True, capture_stderr=True)
    return bytes(done.stdout)


async def dump_dom(url: str, *, budget_ms: int = 3000) -> str:
    """The page's DOM, serialized after its scripts ran for ``budget_ms`` (virtual)."""
    return (await _run(url, "--dump-dom", budget_ms=budget_ms)).decode()


async def screenshot(
    url: str, out: Path, *, size: tuple[int, int] = (1280, 900), budget_ms: int = 3000
) -> None:
    """A PNG of the page at ``size`` (pixels) into ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    await _run(
        url, f"--screenshot={out.resolve()}", f"--window-size={size[0]},{size[1]}",
        budget_ms=budget_ms,
    )  # fmt: skip
    assert out.exists() and out.stat().st_size > 0, f"chromium wrote no screenshot to {out}"
