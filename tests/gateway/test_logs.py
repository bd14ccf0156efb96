"""Log lines: ISO-8601 times with the zone, text or JSON, a connection's peer and name."""

from __future__ import annotations

import json
import logging
import re
import signal
import subprocess
import sys
import threading

import trio

from gateway.runtime import logs
from tests.support.tap_client import TapClient, connect_event

ISO = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d"


def record(message: str) -> logging.LogRecord:
    return logging.LogRecord("gateway.test", logging.WARNING, __file__, 1, message, None, None)


def test_text_lines_carry_an_iso_time_with_zone_and_the_bound_fields() -> None:
    filter_ = logs._ContextFilter()
    with logs.bind(peer="127.0.0.1:5000"):
        logs.name_connection("replica-1")
        entry = record("hello")
        filter_.filter(entry)
    line = logs.TextFormatter().format(entry)
    assert re.fullmatch(
        ISO + r" WARNING gateway\.test: peer=127\.0\.0\.1:5000 connection=replica-1 hello", line
    ), line
    outside = record("bye")
    filter_.filter(outside)
    assert getattr(outside, "fields", None) == {}


def test_json_lines_are_one_object_each() -> None:
    entry = record('a "quoted"\nmessage')
    with logs.bind(peer="p"):
        logs._ContextFilter().filter(entry)
    parsed = json.loads(logs.JsonFormatter().format(entry))
    assert parsed["message"] == 'a "quoted"\nmessage'
    assert parsed["level"] == "warning" and parsed["peer"] == "p"
    assert re.fullmatch(ISO, parsed["time"])


async def test_a_nodes_json_log_names_the_tap_clients_peer_and_name() -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway", "node", "--listen", "127.0.0.1:0", "--vbucket-count", "4",
         "--log-format", "json"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    watchdog = threading.Timer(60, process.kill)
    watchdog.start()
    try:
        assert process.stderr is not None
        first = json.loads(process.stderr.readline())
        port = int(re.search(r"127\.0\.0\.1:(\d+)", first["message"]).group(1))  # type: ignore[union-attr]
        with trio.fail_after(20):
            client = await TapClient.open(port, connect_event(b"ops-client"))  # new changes only
            local = "{}:{}".format(*client.stream.socket.getsockname()[:2])
            await client.aclose()  # the node logs that the client went
        about_client = None
        for line in process.stderr:
            entry = json.loads(line)
            if entry.get("connection") == "ops-client":
                about_client = entry
                break
        assert about_client is not None
        assert about_client["peer"] == local
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0
    finally:
        watchdog.cancel()
        if process.poll() is None:
            process.kill()
            process.wait()
