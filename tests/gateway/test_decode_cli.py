"""``tap-upr-gateway decode`` end to end, as a user runs it (subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.vectors import vectors

TAP = vectors("tap")
DCP = vectors("dcp")
DRAFT = vectors("upr-draft")


def decode(stdin: bytes, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", "decode", *args],
        input=stdin,
        capture_output=True,
        timeout=60,
        check=False,
    )


def records(result: subprocess.CompletedProcess[bytes]) -> list[dict[str, object]]:
    return [json.loads(line) for line in result.stdout.decode().splitlines()]


def test_hex_stream_of_tap_and_dcp_packets() -> None:
    packets = [TAP[504].packet, TAP[436].packet, DCP[60].packet, DCP[210].packet, DCP[120].packet]
    text = "\n".join(
        " ".join(p.hex()[i : i + 8] for i in range(0, len(p.hex()), 8)) for p in packets
    )
    result = decode(text.encode(), "--hex")
    assert result.returncode == 0, result.stderr
    mutation, connect, stream_req, stream_ok, rollback = records(result)
    assert mutation == {
        "protocol": "tap",
        "opcode": "MUTATION",
        "magic": "request",
        "vbucket": 102,
        "opaque": 0,
        "cas": 3,
        "key": "mykey",
        "value": "value",
        "flags": 0,
        "expiration": 0,
        "rev_seqno": None,
        "nru": None,
        "tap_flags": 0,
        "ttl": 255,
        "datatype": 0,
    }
    assert connect["opcode"] == "CONNECT" and connect["name"] == "node1"
    assert connect["connect_flags"] == 0x35 and connect["backfill_date"] == 5
    assert connect["vbuckets"] == [0, 1, 2, 3, 4]
    assert connect["connect_flag_names"] == [
        "backfill",
        "list_vbuckets",
        "support_ack",
        "keys_only",
    ]
    assert stream_req["protocol"] == "upr" and stream_req["opcode"] == "STREAM_REQ"
    assert stream_req["start_seqno"] == 0xFFEEDD and stream_req["end_seqno"] == 2**64 - 1
    assert stream_req["vbucket_uuid"] == 0xFEEDDECA and stream_req["snap_end_seqno"] == 0xFFEEFF
    assert stream_ok["magic"] == "response" and stream_ok["status"] == 0
    assert stream_ok["failover_log"][0] == [0xFEEDDECA, 0x5432]
    assert rollback["status"] == 0x23 and rollback["rollback_seqno"] == 0


def test_raw_bytes_from_a_file_in_the_draft_dialect(tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "capture.bin"
    path.write_bytes(DRAFT[81].packet + DRAFT[868].packet)
    result = decode(b"", str(path), "--dialect", "upr-draft")
    assert result.returncode == 0, result.stderr
    failover, state = records(result)
    assert failover["opcode"] == "GET_FAILOVER_LOG" and len(failover["failover_log"]) == 4
    assert state["opcode"] == "SET_VBUCKET_STATE" and state["state"] == "dead"


def test_plain_memcached_and_binary_values() -> None:
    noop = bytes.fromhex("800a0000000000000000000000000001" + "00" * 8)
    set_ = (
        bytes.fromhex("80010001080000000000000b00000002" + "00" * 8) + bytes(8) + b"k" + b"\xff\xfe"
    )
    result = decode(noop + set_)
    assert result.returncode == 0, result.stderr
    first, second = records(result)
    assert first["protocol"] == "mcbp" and first["opcode"] == "NOOP" and first["opaque"] == 1
    assert second["opcode"] == "SET" and second["key"] == "k" and second["value"] == "hex:fffe"


def test_malformed_packet_prints_what_came_before_and_exits_2() -> None:
    good = TAP[504].packet
    bad = bytearray(TAP[713].packet)
    bad[35] = 9  # VBUCKET_SET with state 9
    result = decode(good + bytes(bad))
    assert result.returncode == 2
    assert [r["opcode"] for r in records(result)] == ["MUTATION"]
    error = result.stderr.decode()
    assert error.count("\n") == 1
    assert f"offset {len(good) + 32}" in error and "state" in error and "0x45" in error


def test_truncated_stream_and_bad_hex() -> None:
    result = decode(TAP[504].packet[:-3])
    assert result.returncode == 2 and "offset 0" in result.stderr.decode()
    assert "truncated" in result.stderr.decode()
    result = decode(b"80 4z", "--hex")
    assert result.returncode == 2 and "not hex" in result.stderr.decode()
    assert b"Traceback" not in result.stderr


def test_help_explains_the_command() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "decode", "--help"],
        capture_output=True,
        timeout=60,
        check=True,
    )
    assert b"--dialect" in result.stdout and b"exit status 2" in result.stdout
