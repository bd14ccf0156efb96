"""STAT tap / STAT upr of the gateway: figures, and names as the reference node spells them."""

from __future__ import annotations

from collections.abc import Callable

import trio

from adapters.tap import ConnectFlags
from gateway.metrics import tap_stat_pairs, upr_stat_pairs
from gateway.metrics.figures import TAP_FRONT, UPR_FRONT, GatewayStats, StreamStats
from gateway.metrics.stat_groups import DATA_KINDS
from tests.gateway.metrics.conftest import NOW
from tests.support import tap_client, upr_client

OpenStream = Callable[..., StreamStats]

# Figures the nodes never had, documented in gateway/metrics/stat_groups.py.
GATEWAY_EXTRAS = {"upstream", "backfill_remaining"}


def test_tap_group(stats: GatewayStats, open_stream: OpenStream) -> None:
    with stats.stream(StreamStats(TAP_FRONT, "gone", "n")) as gone:
        gone.items_sent["mutation"] += 10
        gone.items_sent["expiration"] += 1
    a = open_stream(TAP_FRONT, "replica-a", "node-1:11210")
    a.items_sent.update(mutation=5, deletion=2, expiration=1, marker=6)
    a.vbucket(0).upstream_high_seqno, a.vbucket(0).sent_seqno = 40, 30
    a.vbucket(1).backfilling, a.vbucket(1).backfill_end_seqno = True, 25
    a.ack_window, a.acks_pending, a.nacks_total, a.retransmits_total = 4, 4, 2, 3
    b = open_stream(TAP_FRONT, "replica-b")
    open_stream(UPR_FRONT, "not-tap")
    pairs = tap_stat_pairs(stats, now=NOW)
    got = dict(pairs)
    assert len(got) == len(pairs)
    assert got["ep_tap_count"] == "2"
    assert got["ep_tap_total_fetched"] == str(11 + 8)
    assert got["ep_tap_deletes"] == str(1 + 3)
    assert got["ep_tap_total_backlog_size"] == "10"
    assert got["ep_tap_queue_backfillremaining"] == "25"
    p = "eq_tapq:replica-a:"
    assert got[p + "upstream"] == "node-1:11210"
    assert got[p + "created"] == str(int(NOW - 60))
    assert got[p + "qlen"] == got[p + "total_backlog_size"] == "10"
    assert got[p + "rec_fetched"] == "8"
    assert got[p + "num_deletes"] == "3"
    assert got[p + "vb_filters"] == "2"
    assert got[p + "pending_backfill"] == "true"
    assert got[p + "backfill_completed"] == "false"
    assert got[p + "backfill_remaining"] == "25"
    assert got[p + "supports_ack"] == "true"
    assert got[p + "ack_log_size"] == got[p + "num_unacked"] == "4"
    assert got[p + "ack_window_full"] == "true"
    assert got[p + "num_tap_nack"] == "2"
    assert got[p + "num_tap_tmpfail_survivors"] == "3"
    assert got[p + "idle"] == "false"
    assert got["eq_tapq:replica-b:idle"] == "true"
    assert got["eq_tapq:replica-b:supports_ack"] == "false"
    assert not any("not-tap" in name for name in got)
    b.acks_pending = 1
    assert dict(tap_stat_pairs(stats))["eq_tapq:replica-b:ack_window_full"] == "false"


def test_upr_group(stats: GatewayStats, open_stream: OpenStream) -> None:
    c = open_stream(UPR_FRONT, "xdcr", "tap-node:11210")
    c.items_sent.update(mutation=7, deletion=1, marker=3)
    c.bytes_sent = 999
    c.buffer_size, c.unacked_bytes = 1000, 1000
    c.vbucket(3).upstream_high_seqno, c.vbucket(3).sent_seqno = 20, 12
    c.vbucket(3).backfilling, c.vbucket(3).backfill_end_seqno = True, 15
    open_stream(TAP_FRONT, "not-upr")
    got = dict(upr_stat_pairs(stats, now=NOW))
    for prefix in ("ep_dcp_", "ep_upr_"):
        assert got[prefix + "count"] == got[prefix + "producer_count"] == "1"
        assert got[prefix + "items_sent"] == "8"
        assert got[prefix + "items_remaining"] == "8"
        assert got[prefix + "total_bytes"] == "999"
    for prefix in ("eq_dcpq:xdcr:", "eq_uprq:xdcr:"):
        assert got[prefix + "type"] == "producer"
        assert got[prefix + "upstream"] == "tap-node:11210"
        assert got[prefix + "total_bytes_sent"] == "999"
        assert got[prefix + "unacked_bytes"] == got[prefix + "max_buffer_bytes"] == "1000"
        assert got[prefix + "flow_control"] == "enabled"
        assert got[prefix + "paused"] == "true"
        assert got[prefix + "num_streams"] == "1"
        assert got[prefix + "stream_3_state"] == "backfilling"
        assert got[prefix + "stream_3_last_sent_seqno"] == "12"
        assert got[prefix + "stream_3_items_remaining"] == "8"
        assert got[prefix + "stream_3_backfill_remaining"] == "3"
    assert not any("not-upr" in name for name in got)
    c.buffer_size = 0
    assert dict(upr_stat_pairs(stats))["eq_uprq:xdcr:flow_control"] == "disabled"


def _names(pairs: list[tuple[str, str]], per_connection: str) -> tuple[set[str], set[str]]:
    """(process-wide names, per-connection stat names with ``stream_<vb>_`` folded)."""
    totals, per_conn = set(), set()
    for name, _ in pairs:
        if name.startswith(per_connection):
            stat = name.split(":", 2)[2]
            if stat.startswith("stream_"):
                stat = "stream_N_" + stat.split("_", 2)[2]
            per_conn.add(stat)
        else:
            totals.add(name)
    return totals, per_conn


async def test_names_match_the_reference_node(
    nursery: trio.Nursery, stats: GatewayStats, open_stream: OpenStream
) -> None:
    """What the gateway reports is a subset of what a 2.x/3.0 node reports."""
    node, port = await tap_client.start_node(nursery)
    flags = ConnectFlags.SUPPORT_ACK | ConnectFlags.BACKFILL
    tap = await tap_client.TapClient.open(port, tap_client.connect_event(b"replica", flags))
    upr = await upr_client.UprClient.connect(port)
    await upr.open(b"xdcr")
    await upr.stream_request(0)
    with trio.fail_after(5):
        await tap_client.until(lambda: any(n.endswith(":qlen") for n, _ in node.tap.stats()))
    node_tap = _names(node.tap.stats(), "eq_tapq:")
    node_upr = _names(node.upr.stats(), "eq_dcpq:")
    await tap.aclose()
    await upr.aclose()

    t = open_stream(TAP_FRONT, "replica")
    t.vbucket(0)
    u = open_stream(UPR_FRONT, "xdcr")
    u.vbucket(0)
    ours_tap = _names(tap_stat_pairs(stats), "eq_tapq:")
    ours_upr = _names(upr_stat_pairs(stats), "eq_dcpq:")
    assert ours_tap[0] - node_tap[0] == {"ep_tap_queue_backfillremaining"}  # a 2.x total
    assert ours_tap[1] - node_tap[1] == GATEWAY_EXTRAS
    ours_upr_totals = {n for n in ours_upr[0] if not n.startswith("eq_uprq:")}
    assert ours_upr_totals <= node_upr[0]
    # ``created``: 3.0 reports it per DCP connection, the reference node does not.
    assert ours_upr[1] - node_upr[1] == {*GATEWAY_EXTRAS, "created"}


def test_data_kinds_are_item_kinds() -> None:
    from gateway.metrics.figures import ITEM_KINDS

    assert set(DATA_KINDS) <= set(ITEM_KINDS)
