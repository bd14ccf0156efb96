"""The common case of a vbucket on its Arrow columns, without a Python object per record.

Theory of operation. ``split`` looks at one vbucket's records (CUT and
diagnostic rows removed, sorted by side, stream, segment and index) with
vectorised operations and sets aside only what might hold a fault:

- streams that are not plain UPR streams (one SNAPSHOT marker first, only
  SNAPSHOT markers and a last STREAM_END, items inside their marker's range
  and recorded with it, seqnos strictly growing, each snapshot ended at its
  end seqno before the next marker, no key twice in a snapshot);
- keys that each side did not see on one stream as the same versions in the
  same order (rev_seqno strictly growing, by_seqno never going back, no
  delete of unknown cause, nothing past the cut).

Those go to the exact checks (``streams.check_stream``, ``checks.reconcile_key``);
everything else provably has no fault, and each of its versions is one
latency. The conditions only ever send more to the exact checks than needed:
``tests/gateway/tools/verify/test_columnar.py`` checks that on generated vbuckets.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.compute as pc  # type: ignore[import-untyped]

from gateway.tools.verify.latency import MIN_EXP, PER_DECADE, SIZE, SPAN, ZERO, bucket

_SNAPSHOT, _STREAM_END, _DELETE = 10, 17, 4
_LOG_MIN = MIN_EXP * PER_DECADE


@dataclass
class Split:
    slow_streams: list[tuple[int, int]]
    """Row ranges (start, stop) of whole streams for ``check_stream``."""
    slow_key_rows: Any
    """Row numbers (ascending) of the item records of keys for ``reconcile_key``."""
    latencies: Any
    """float64 latencies of the versions of the keys that need no check."""
    keys: int


def _u64(table: pa.Table, name: str) -> tuple[Any, Any]:
    """A column's values as uint64 (nulls as 0) and its null mask."""
    array = table.column(name).combine_chunks()
    if not array.null_count:  # no copies
        return array.to_numpy().view(np.uint64), np.zeros(len(array), dtype=bool)
    nulls = array.is_null().to_numpy(zero_copy_only=False)
    values = array.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64).view(np.uint64)
    return values, nulls


def _changed(array: Any) -> Any:
    """True where a value differs from the one before (the first row included)."""
    n = len(array)
    out = np.ones(n, dtype=bool)
    if n > 1:
        out[1:] = pc.not_equal(array.slice(1), array.slice(0, n - 1)).to_numpy(zero_copy_only=False)
    return out


def _last_index(mask: Any) -> Any:
    """For each row, the last row at or before it where ``mask`` holds (-1 if none)."""
    return np.maximum.accumulate(np.where(mask, np.arange(len(mask)), -1))


def runs(vbuckets: pa.Array) -> list[tuple[int, int, int]]:
    """(start, stop, vbucket) of each run of one vbucket in a batch."""
    values = vbuckets.to_numpy()
    bounds = [0, *(np.flatnonzero(np.diff(values)) + 1).tolist(), len(values)]
    return [(a, b, int(values[a])) for a, b in itertools.pairwise(bounds) if a < b]


def split(table: pa.Table, cut: int | None) -> Split:
    n = table.num_rows
    if not n:
        return Split([], np.zeros(0, dtype=np.int64), np.zeros(0), 0)
    side = table.column("side").combine_chunks()
    stream_starts = _changed(side) | _changed(table.column("stream").combine_chunks())
    stream_id = np.cumsum(stream_starts) - 1
    starts = np.flatnonzero(stream_starts)
    stops = np.append(starts[1:], n)
    kind = table.column("kind").to_numpy()
    seq, seq_null = _u64(table, "by_seqno")
    snap_start, start_null = _u64(table, "snap_start")
    snap_end, end_null = _u64(table, "snap_end")
    item = kind < 10
    snap = kind == _SNAPSHOT
    end = kind == _STREAM_END
    upr = pc.equal(table.column("protocol"), "upr").to_numpy(zero_copy_only=False)
    bad = ~(item | snap | end) | ~upr
    last_row = np.zeros(n, dtype=bool)
    last_row[stops - 1] = True
    bad |= stream_starts & ~snap
    bad |= end & ~last_row
    marker = np.maximum(_last_index(snap), 0)
    # Marker ranges: present, ordered, after the previous marker's end.
    bad |= snap & (start_null | end_null | (snap_start > snap_end))
    previous = np.maximum(np.arange(n) - 1, 0)
    later_marker = snap & ~stream_starts
    bad |= later_marker & (snap_start <= snap_end[marker[previous]])
    # A marker or STREAM_END closes the snapshot before it: its last item is its end.
    closing = later_marker | end
    bad |= closing & (~item[previous] | (seq[previous] != snap_end[marker[previous]]))
    # Items: a seqno, strictly growing, inside the open marker's range and recorded with it.
    prior_item = _last_index(item)[previous]
    has_prior = (prior_item >= 0) & (stream_id[np.maximum(prior_item, 0)] == stream_id)
    has_prior[0] = False
    bad |= item & seq_null
    bad |= item & has_prior & (seq <= seq[np.maximum(prior_item, 0)])
    bad |= item & ((seq < snap_start[marker]) | (seq > snap_end[marker]))
    bad |= item & (start_null | end_null)
    bad |= item & ((snap_start != snap_start[marker]) | (snap_end != snap_end[marker]))
    snapshot_group = np.cumsum(snap)
    stream_bad = np.add.reduceat(bad.astype(np.int64), starts) > 0 if n else np.zeros(0, bool)

    rows = np.flatnonzero(item)
    keys, slow_rows, latencies, duplicate_streams = _keys(
        table, rows, stream_id, snapshot_group, side, cut
    )
    stream_bad[duplicate_streams] = True
    slow = [(int(starts[s]), int(stops[s])) for s in np.flatnonzero(stream_bad)]
    return Split(slow, slow_rows, latencies, keys)


def _keys(
    table: pa.Table, rows: Any, stream_id: Any, group: Any, side: Any, cut: int | None
) -> tuple[int, Any, Any, Any]:
    """Keys count, slow key rows, fast latencies, streams with a key twice in a snapshot."""
    if not len(rows):
        empty = np.zeros(0, dtype=np.int64)
        return 0, empty, np.zeros(0), empty
    indices = pa.array(rows)
    right = pc.equal(side.take(indices), "right")
    keys = table.column("key").combine_chunks().take(indices)
    order = pc.sort_indices(
        pa.table({"k": keys, "r": right}), sort_keys=[("k", "ascending"), ("r", "ascending")]
    ).to_numpy()
    at = rows[order]
    sorted_keys = keys.take(pa.array(order))
    new_key = _changed(sorted_keys)
    gid = np.cumsum(new_key) - 1
    count = int(gid[-1]) + 1
    left = ~right.to_numpy(zero_copy_only=False)[order]
    size = np.bincount(gid, minlength=count)
    lefts = np.bincount(gid, weights=left, minlength=count).astype(np.int64)
    bad_key = lefts * 2 != size

    def column(name: str) -> tuple[Any, Any]:
        values, nulls = _u64(table, name)
        return values[at], nulls[at]

    kind = table.column("kind").to_numpy()[at]
    rev, rev_null = column("rev_seqno")
    cas, _ = column("cas")
    seq, seq_null = column("by_seqno")
    flags, _ = column("flags")
    expiration, _ = column("expiration")
    bad = (kind == _DELETE) | rev_null
    if cut is not None:
        bad |= cas > np.uint64(cut)
    m = len(at)
    before = np.maximum(np.arange(m) - 1, 0)
    same = ~new_key & (left == left[before])
    sid = stream_id[at]
    bad |= same & (sid != sid[before])
    bad |= same & (rev <= rev[before])
    bad |= same & (seq_null != seq_null[before])
    bad |= same & ~seq_null & (seq < seq[before])
    # The same versions pairwise: left's i-th and right's i-th of each key.
    partner = np.minimum(np.arange(m) + lefts[gid], m - 1)
    pairs = left & ~bad_key[gid]
    digests = table.column("digest").combine_chunks().take(pa.array(at))
    digest_equal = pc.fill_null(pc.equal(digests, digests.take(pa.array(partner))), False).to_numpy(
        zero_copy_only=False
    ) | (
        digests.is_null().to_numpy(zero_copy_only=False)
        & digests.take(pa.array(partner)).is_null().to_numpy(zero_copy_only=False)
    )
    differ = (
        (kind != kind[partner])
        | (rev != rev[partner])
        | (cas != cas[partner])
        | (flags != flags[partner])
        | (expiration != expiration[partner])
        | ~digest_equal
    )
    bad |= pairs & differ
    bad_key |= np.bincount(gid, weights=bad, minlength=count) > 0
    slow_rows = np.sort(at[bad_key[gid]])
    fast = pairs & ~bad_key[gid]
    arrival = table.column("arrival").to_numpy()[at]
    latencies = arrival[partner[fast]] - arrival[fast]
    duplicate = same & (group[at] == group[at][before])
    return count, slow_rows, latencies, np.unique(sid[duplicate])


def histogram(values: Any) -> tuple[list[int], int, float, float, float]:
    """``latency.Histogram`` fields of ``values``, bucketed exactly as ``latency.bucket``."""
    if not len(values):
        return [0] * SIZE, 0, 0.0, math.inf, -math.inf
    magnitude = np.abs(values)
    small = magnitude < 10.0**MIN_EXP
    with np.errstate(divide="ignore"):
        scaled = np.log10(np.where(small, 1.0, magnitude)) * PER_DECADE - _LOG_MIN
    step = np.minimum(SPAN - 1, scaled.astype(np.int64))
    index = np.where(small, ZERO, np.where(values > 0, ZERO + 1 + step, ZERO - 1 - step))
    # numpy's log10 may round apart from math.log10 right at a bucket edge: ask bucket().
    edge = np.flatnonzero(~small & (np.abs(scaled - np.rint(scaled)) < 1e-9))
    for i in edge:
        index[i] = bucket(float(values[i]))
    counts = np.bincount(index, minlength=SIZE)
    return (
        [int(c) for c in counts],
        len(values),
        float(np.sum(values)),
        float(np.min(values)),
        float(np.max(values)),
    )
