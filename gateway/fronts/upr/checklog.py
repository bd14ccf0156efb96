"""``tap-upr-gateway check-log``: prove the UPR front's logs without serving.

Runs the start-up proof (``proof.prove_vbucket``) on every vbucket of a
state directory, read-only, and prints one line per vbucket: proven (with
a torn tail start-up would cut, if any) or not proven and why, which is
what ``serve`` would set aside and re-fetch from the TAP node. Logs set
aside earlier are listed too, and vbuckets handed over to a UPR consumer
(``takeover``: dead here) say so.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TextIO

from gateway.fronts.upr.logset import manifest_state, vbucket_dirs
from gateway.fronts.upr.manifest import MANIFEST_NAME
from gateway.fronts.upr.proof import SET_ASIDE_DIR, VbProof, prove_vbucket, set_aside_root
from gateway.fronts.upr.takeover import HANDED_OVER, read_handed_over

EXIT_PROVEN = 0
EXIT_NOT_PROVEN = 1
EXIT_USAGE = 2

EXIT_CODES = f"""exit status:
  {EXIT_PROVEN}  every vbucket's log is proven (torn tails included: start-up cuts them,
     nothing acknowledged is in them)
  {EXIT_NOT_PROVEN}  a vbucket's log is not proven (serve sets it aside, starts a new
     history and re-fetches it from the TAP node), or the manifest is missing
     or damaged while logs exist
  {EXIT_USAGE}  no such state directory, or bad arguments

example:
  tap-upr-gateway check-log --state-dir /var/lib/tap-upr-gateway"""


def describe(proof: VbProof) -> str:
    """One line about one vbucket's log."""
    head = f"vb {proof.vbucket}:"
    if not proof.proven:
        problems = "; ".join(p.text for p in proof.problems)
        return f"{head} NOT PROVEN: {problems} (serve sets it aside and re-fetches it)"
    if proof.fresh:
        return f"{head} proven: no log yet"
    meta = proof.meta
    assert meta is not None
    high = max((s.last for s in proof.segments), default=0)
    parts = [
        f"{len(proof.segments)} segment{'s' if len(proof.segments) != 1 else ''}",
        f"last seqno {high}",
        f"uuid {meta.failover[0][0]}",
        "closed cleanly" if meta.clean else "not closed cleanly",
    ]
    for path, good, size in proof.torn:
        parts.append(
            f"torn tail of {size - good} bytes in {path.parent.name}/{path.name} "
            "(an interrupted append; serve cuts it)"
        )
    if meta.refetch:
        parts.append("re-fetch from the TAP node still pending")
    return f"{head} proven: " + ", ".join(parts)


def check_state_dir(root: Path, out: TextIO) -> int:
    """Print the report for ``root``; the exit status."""
    if not root.is_dir():
        print(f"check-log: no state directory {root}", file=sys.stderr)
        return EXIT_USAGE
    dirs = vbucket_dirs(root)
    known, lost = manifest_state(root, dirs)
    status = EXIT_PROVEN
    if lost is not None:
        print(f"manifest: {lost} (serve rebuilds it; vbuckets without a directory count as lost)",
              file=out)  # fmt: skip
        status = EXIT_NOT_PROVEN
    elif known:
        print(f"manifest: {MANIFEST_NAME} lists {len(known)} vbuckets", file=out)
    proven = 0
    dead = read_handed_over(root)
    vbuckets = sorted(set(dirs) | set(known))
    for vb in vbuckets:
        expected = f"{MANIFEST_NAME} lists vbucket {vb}" if vb in known else lost
        proof = prove_vbucket(root / f"vb-{vb:04d}", vb, expected=expected)
        line = describe(proof)
        if vb in dead:
            line += (
                f"; handed over, dead here ({dead[vb]}; "
                f"delete vb-{vb:04d}/{HANDED_OVER} to serve it again)"
            )
        print(line, file=out)
        if proof.proven:
            proven += 1
        else:
            status = EXIT_NOT_PROVEN
    base = set_aside_root(root)
    earlier = sorted(base.iterdir()) if base.is_dir() else []
    for path in earlier:
        why = path / "why.txt"
        reason = why.read_text().strip().replace("\n", "; ") if why.is_file() else "damaged"
        print(f"set aside earlier: {SET_ASIDE_DIR}/{path.name}: {reason}", file=out)
    print(
        f"{len(vbuckets)} vbuckets: {proven} proven, {len(vbuckets) - proven} not proven",
        file=out,
    )
    return status


def add_check_log_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "check-log",
        help="prove the UPR front's durable log in a state directory, without serving",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Check, read-only, what `serve` checks at start-up: for every vbucket of the\n"
            "UPR front's log in --state-dir, whether its log is proven (meta.msgpack whole,\n"
            "every segment it lists present, every record whole but for a torn tail) or\n"
            "not, and why. A vbucket that is not proven is what serve sets aside (into\n"
            f"{SET_ASIDE_DIR}/), starts a new history for and re-fetches from the TAP node."
        ),
        epilog=EXIT_CODES,
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        required=True,
        metavar="DIR",
        help="the state directory `serve` uses",
    )
    parser.set_defaults(handler=run_check_log)


def run_check_log(args: argparse.Namespace) -> int:
    return check_state_dir(args.state_dir, sys.stdout)
