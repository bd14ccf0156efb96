"""The verification report: a JSON document and a short summary for the terminal."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from gateway.tools.verify.checks import Check
from gateway.tools.verify.latency import Histogram

if TYPE_CHECKING:
    from gateway.tools.verify.job import VerifyConfig

_WRAP = 1 << 64


def _unsigned(value: int | None) -> int | None:
    return None if value is None else value + _WRAP if value < 0 else value


def _key_text(key: bytes | None) -> str:
    if key is None:
        return ""
    try:
        text = key.decode("utf-8")
    except UnicodeDecodeError:
        return "hex:" + key.hex()
    return text if text.isprintable() else "hex:" + key.hex()


def _state(row: dict[str, Any], side: str) -> dict[str, Any] | None:
    if row.get(f"{side}_kind") is None:
        return None
    digest = row.get(f"{side}_digest")
    return {
        "kind": row[f"{side}_kind"],
        "by_seqno": _unsigned(row.get(f"{side}_by_seqno")),
        "rev_seqno": _unsigned(row.get(f"{side}_rev_seqno")),
        "cas": _unsigned(row.get(f"{side}_cas")),
        "flags": row.get(f"{side}_flags"),
        "expiration": row.get(f"{side}_expiration"),
        "digest": digest.hex() if digest else None,
    }


def _sample(s: dict[str, Any]) -> dict[str, Any]:
    return {
        "check": s["check"],
        "vbucket": s["vbucket"],
        "key": _key_text(s["key"]),
        "side": s["side"],
        "detail": s["detail"],
        "left": _state(s, "left"),
        "right": _state(s, "right"),
    }


def _latency(hist: Histogram) -> dict[str, Any]:
    """The summary figures and the non-empty buckets: the distribution, in fixed size."""
    out: dict[str, Any] = dict(hist.summary())
    if hist.count:
        out["histogram"] = [
            {"low_s": low, "high_s": high, "count": n} for low, high, n in hist.buckets()
        ]
    return out


def build_report(
    config: VerifyConfig,
    *,
    stats: list[dict[str, Any]],
    diagnostics: list[dict[str, Any]],
    counts: list[dict[str, Any]],
    samples: list[dict[str, Any]],
    segments: dict[str, int],
    in_flight: list[dict[str, Any]] | None = None,
    timing: dict[str, float],
    memory: dict[str, int],
    master: str,
    partitions: int,
) -> dict[str, Any]:
    from gateway.tools.verify.job import merge_histograms

    by_check: dict[str, int] = {str(c): 0 for c in Check}
    by_side: dict[str, dict[str, int]] = {}
    by_vbucket: dict[int, int] = {}
    # Rows are counts per check and side, and per vbucket when the job grouped by it.
    for row in counts:
        n = row["count"]
        by_check[row["check"]] = by_check.get(row["check"], 0) + n
        sides = by_side.setdefault(row["check"], {})
        sides[row["side"]] = sides.get(row["side"], 0) + n
        if row.get("vbucket") is not None:
            by_vbucket[row["vbucket"]] = by_vbucket.get(row["vbucket"], 0) + n
    total = sum(by_check.values())
    records = {s: sum(r[f"{s}_records"] or 0 for r in stats) for s in ("left", "right")}
    items = {s: sum(r[f"{s}_items"] or 0 for r in stats) for s in ("left", "right")}
    damaged = [d for d in diagnostics if d["check"] == "damaged"]
    report: dict[str, Any] = {
        "left": config.left,
        "right": config.right,
        "agree": total == 0 and not damaged,
        "master": master,
        "shuffle_partitions": partitions,
        "segments": segments,
        "records": records,
        "items": items,
        "keys": sum(r["keys"] or 0 for r in stats),
        "vbuckets": len(stats),
        "mismatches": {
            "total": total,
            "by_check": by_check,
            "by_check_and_side": by_side,
            "by_vbucket": {str(vb): by_vbucket[vb] for vb in sorted(by_vbucket)},
            "samples": [
                _sample(s)
                for s in sorted(samples, key=lambda s: (s["check"], s["vbucket"], s["key"] or b""))
            ],
        },
        "in_flight": {
            "total": sum(r.get("in_flight") or 0 for r in stats),
            "by_vbucket": {
                str(r["vbucket"]): r["in_flight"]
                for r in sorted(stats, key=lambda r: r["vbucket"])
                if r.get("in_flight")
            },
            "samples": [_sample(s) for s in in_flight or []],
        },
        "latency": _latency(merge_histograms(stats)),
        "diagnostics": [
            {
                "kind": d["check"],
                "side": d["side"],
                "file": _key_text(d["key"]),
                "detail": d["detail"],
            }
            for d in diagnostics
        ],
        "timing": timing,
        "memory": memory,
    }
    if config.mismatches:
        report["mismatches"]["parquet"] = config.mismatches
    return report


def dumps(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2, sort_keys=False)


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if abs(value) < 1e-3:
        return f"{value * 1e6:.0f}us"
    if abs(value) < 1:
        return f"{value * 1e3:.1f}ms"
    return f"{value:.2f}s"


def summary(report: dict[str, Any]) -> str:
    """A few readable lines: verdict, sizes, faults by check with samples, latency, time."""
    lines = []
    verdict = "AGREE" if report["agree"] else "DISAGREE"
    mism = report["mismatches"]
    lines.append(
        f"{verdict}: {report['left']} vs {report['right']}: {mism['total']} mismatches over "
        f"{report['keys']} keys in {report['vbuckets']} vbuckets"
    )
    lines.append(
        f"  records left {report['records']['left']:,} (items {report['items']['left']:,}, "
        f"{report['segments']['left']} segments), right {report['records']['right']:,} "
        f"(items {report['items']['right']:,}, {report['segments']['right']} segments)"
    )
    for check, count in mism["by_check"].items():
        if not count:
            continue
        sides = ", ".join(f"{s} {n}" for s, n in sorted(mism["by_check_and_side"][check].items()))
        lines.append(f"  {check}: {count} ({sides})")
        for sample in [s for s in mism["samples"] if s["check"] == check][:3]:
            lines.append(
                f"    vb {sample['vbucket']} key {sample['key']!r}: [{sample['side']}] "
                f"{sample['detail']}"
            )
    flight = report["in_flight"]
    if flight["total"]:
        lines.append(
            f"  in flight (changes past the cut, not a failure): {flight['total']} keys in "
            f"{len(flight['by_vbucket'])} vbuckets"
        )
        for sample in flight["samples"][:3]:
            lines.append(
                f"    vb {sample['vbucket']} key {sample['key']!r}: {sample['check']}: "
                f"{sample['detail']}"
            )
    for diag in report["diagnostics"]:
        lines.append(f"  {diag['kind']} segment ({diag['side']}): {diag['detail']}")
    lat = report["latency"]
    if lat.get("count"):
        lines.append(
            f"  latency right-left over {lat['count']:,} versions: p50 {_seconds(lat['p50_s'])} "
            f"p90 {_seconds(lat['p90_s'])} p99 {_seconds(lat['p99_s'])} "
            f"max {_seconds(lat['max_s'])}"
        )
    timing = report["timing"]
    split = ""
    if "read_s" in timing:
        split = f" (read {_seconds(timing['read_s'])}, reconcile {_seconds(timing['reconcile_s'])})"
    lines.append(f"  time {_seconds(timing['total_s'])}{split} on {report['master']}")
    return "\n".join(lines)
