"""``stats``, ``vbucket``, ``node --replica-vbuckets``: the README's move between fresh nodes."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

GATEWAY = [sys.executable, "-m", "gateway"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*GATEWAY, *args], capture_output=True, text=True, timeout=120)


@contextmanager
def node(*args: str) -> Iterator[int]:
    """A reference node process on a free port; yields the port."""
    process = subprocess.Popen(
        [*GATEWAY, "node", "--listen", "127.0.0.1:0", *args], stderr=subprocess.PIPE, text=True
    )
    watchdog = threading.Timer(60, process.kill)  # a node that never starts ends the read
    watchdog.start()
    try:
        assert process.stderr is not None
        port = None
        for line in process.stderr:
            found = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
            if found:
                port = int(found.group(1))
                break
        assert port is not None, "the node did not start"
        yield port
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0
    finally:
        watchdog.cancel()
        if process.poll() is None:
            process.kill()
            process.wait()


def test_stats_vbucket_and_replica_vbuckets_on_a_node() -> None:
    with node("--vbucket-count", "4", "--replica-vbuckets", "2-3") as port:
        shown = run("stats", f"127.0.0.1:{port}", "vbucket")
        assert shown.returncode == 0, shown.stderr
        lines = dict(line.split(":", 1) for line in shown.stdout.splitlines())
        assert {k: v.strip() for k, v in lines.items()} == {
            "vb_0": "active", "vb_1": "active", "vb_2": "replica", "vb_3": "replica",
        }  # fmt: skip
        changed = run("vbucket", f"127.0.0.1:{port}", "2", "dead")
        assert changed.returncode == 0, changed.stderr
        as_json = run("stats", f"127.0.0.1:{port}", "vbucket", "--json")
        assert json.loads(as_json.stdout)["vb_2"] == "dead"
        seqnos = run("stats", f"127.0.0.1:{port}", "vbucket-seqno", "1", "--json")
        assert "vb_1:high_seqno" in json.loads(seqnos.stdout)


def test_stats_of_nothing_listening_is_one_line() -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        done = run("stats", f"127.0.0.1:{port}")
    assert done.returncode == 1
    assert done.stderr.strip() == (
        f"stats: 127.0.0.1:{port}: connection refused (nothing listens there)"
    )


def test_replica_vbuckets_beyond_the_node_are_refused() -> None:
    done = run("node", "--vbucket-count", "4", "--replica-vbuckets", "3-9")
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "node: --replica-vbuckets names vbucket 4, but the node has 4 (--vbucket-count)"
    )


def test_the_readme_move_between_two_fresh_nodes() -> None:
    with (
        node("--vbucket-count", "4", "--sample-items", "200") as source,
        node("--vbucket-count", "4", "--replica-vbuckets", "0-3") as destination,
    ):
        moved = run(
            "move", "--from-tap", f"127.0.0.1:{source}", "--to-upr", f"127.0.0.1:{destination}",
            "--vbuckets", "1", "--takeover",
        )  # fmt: skip
        assert moved.returncode == 0, moved.stderr
        before = json.loads(run("stats", f"127.0.0.1:{source}", "vbucket", "--json").stdout)
        after = json.loads(run("stats", f"127.0.0.1:{destination}", "vbucket", "--json").stdout)
        assert before["vb_1"] == "dead" and after["vb_1"] == "active"
        source_seqno = run("stats", f"127.0.0.1:{source}", "vbucket-seqno", "1", "--json")
        moved_seqno = run("stats", f"127.0.0.1:{destination}", "vbucket-seqno", "1", "--json")
        assert (
            int(json.loads(moved_seqno.stdout)["vb_1:high_seqno"])
            >= int(json.loads(source_seqno.stdout)["vb_1:high_seqno"])
            > 0
        )
