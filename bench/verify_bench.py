"""verify throughput in local mode: N records per side (default 1M; --ten-million for 10M).

Two synthetic captures of the same history (UPR streams with snapshots,
rewrites, deletions and expirations; the right side arrives 2 ms later) are
written to a scratch directory, then reconciled with the verify job on
``local[*]``. Baseline, measured in the same run on the same captures and
the same SparkSession: a plain ``count()`` of both captures through the data
source (reading and decoding only). Reported: wall time, records/s, the
split between reading captures (the scan stage, up to the shuffle) and the
reconciliation, the CPU time of the driver, the JVM and the Python workers
(steadier than wall time on a shared host), and the driver's peak memory
(JVM resident size, which in local mode holds the executors too, and the
Python driver's).

    python bench/verify_bench.py [--records N | --ten-million] [--vbuckets 64]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import tempfile
import time
from pathlib import Path

from gateway.tools.verify.job import VerifyConfig, run_verify, spark_session
from gateway.tools.verify.report import summary
from gateway.tools.verify.source import NAME
from gateway.tools.verify.synthetic import history, write_capture

ITEMS_PER_KEY = 1.35
"""Average item records per key in the synthetic history (rewrites, deletes, expiries)."""


def tree_cpu_seconds() -> float:
    """CPU time of this process and its descendants (the JVM, the Python workers),
    counting the children they already reaped; steadier than wall time on a shared host."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        times[int(entry)] = sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    tree, frontier = {os.getpid()}, [os.getpid()]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent]
        tree.update(children)
        frontier += children
    return sum(times.get(pid, 0.0) for pid in tree)


def _write(args: tuple[str, int, int, float]) -> tuple[int, float]:
    directory, vbuckets, keys, delay = args
    started = time.perf_counter()
    count = write_capture(Path(directory), history(vbuckets, keys, delay=delay))
    return count, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000, help="records per side")
    parser.add_argument("--ten-million", action="store_true", help="10M records per side")
    parser.add_argument("--vbuckets", type=int, default=64)
    parser.add_argument("--master", default="local[*]")
    parser.add_argument("--driver-memory", default="6g")
    parser.add_argument("--partitions", type=int, default=None)
    parser.add_argument("--workdir", help="scratch directory (default: a temporary one)")
    args = parser.parse_args()
    records = 10_000_000 if args.ten_million else args.records
    keys = max(1, round(records / args.vbuckets / (ITEMS_PER_KEY + ITEMS_PER_KEY / 64)))
    scratch = Path(args.workdir or tempfile.mkdtemp(prefix="verify-bench-"))
    left, right = scratch / "left", scratch / "right"
    for d in (left, right):
        shutil.rmtree(d, ignore_errors=True)
    try:
        started = time.perf_counter()
        with multiprocessing.get_context("spawn").Pool(2) as pool:
            written = pool.map(
                _write,
                [(str(left), args.vbuckets, keys, 0.0), (str(right), args.vbuckets, keys, 0.002)],
            )
        size = sum(p.stat().st_size for p in scratch.rglob("*.tucap"))
        print(
            f"generated {written[0][0]:,} + {written[1][0]:,} records, {size / 2**20:.0f} MiB, "
            f"{args.vbuckets} vbuckets, in {time.perf_counter() - started:.1f}s"
        )

        spark = spark_session(
            args.master, driver_memory=args.driver_memory, shuffle_partitions=args.partitions
        )
        spark.read.format(NAME).load(str(left)).limit(1).collect()  # warm up JVM and workers

        cpu = tree_cpu_seconds()
        started = time.perf_counter()
        sides = [spark.read.format(NAME).load(str(d)) for d in (left, right)]
        counted = sides[0].unionByName(sides[1]).count()
        baseline = time.perf_counter() - started
        baseline_cpu = tree_cpu_seconds() - cpu

        config = VerifyConfig(str(left), str(right), partitions=args.partitions, progress=True)
        cpu = tree_cpu_seconds()
        result = run_verify(config, spark)
        verify_cpu = tree_cpu_seconds() - cpu
        report = result.report
        timing, memory = report["timing"], report["memory"]
        total_records = report["records"]["left"] + report["records"]["right"]
        assert counted == total_records, (counted, total_records)
        assert report["agree"], report["mismatches"]["by_check"]
        print(summary(report))
        print()
        print(f"{'':32}{'seconds':>10}{'records/s':>14}{'CPU s':>10}{'CPU us/rec':>12}")
        print(
            f"{'baseline: count() of both':32}{baseline:10.1f}{counted / baseline:14,.0f}"
            f"{baseline_cpu:10.1f}{baseline_cpu / counted * 1e6:12.2f}"
        )
        rate = total_records / timing["total_s"]
        print(
            f"{'verify, total':32}{timing['total_s']:10.1f}{rate:14,.0f}"
            f"{verify_cpu:10.1f}{verify_cpu / total_records * 1e6:12.2f}"
        )
        if "read_s" in timing:
            print(
                f"{'  read captures (scan stage)':32}{timing['read_s']:10.1f}"
                f"{total_records / timing['read_s']:14,.0f}"
            )
            print(
                f"{'  reconcile (after shuffle)':32}{timing['reconcile_s']:10.1f}"
                f"{total_records / timing['reconcile_s']:14,.0f}"
            )
        print(f"{'  report, samples':32}{timing['report_s']:10.1f}")
        print(
            f"verify / baseline: {timing['total_s'] / baseline:.2f}x wall, "
            f"{verify_cpu / baseline_cpu:.2f}x CPU"
        )
        print(
            f"driver peak memory: JVM RSS {memory['jvm_driver_peak_rss_bytes'] / 2**20:,.0f} MiB "
            f"(heap {memory['jvm_heap_peak_bytes'] / 2**20:,.0f} MiB), Python "
            f"{memory['python_driver_peak_rss_bytes'] / 2**20:,.0f} MiB"
        )
        spark.stop()
    finally:
        if not args.workdir:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
