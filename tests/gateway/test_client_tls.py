"""``--tls``/``--ca`` on the client commands: stats, vbucket, load, capture, and move.

Couchbase 3.0 served the same memcached binary protocol inside TLS on its own
port (11207); cbstats and cbepctl reached it with their ``-s`` option. Here
the reference node serves TLS with ``--tls-cert`` and every client command
reaches it with ``--tls --ca FILE``; a certificate the client does not trust,
or a plain client on a TLS port, ends in one line naming the server. ``move``
dials two nodes, so it also takes ``--source-tls``/``--destination-tls``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.gateway.test_admin_cli import node, run
from tests.gateway.test_tls import make_certificate

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_certificate(tmp_path_factory.mktemp("client-tls"))


def test_stats_vbucket_load_and_capture_reach_a_tls_node(
    tmp_path: Path, certificate: tuple[Path, Path]
) -> None:
    cert, key = certificate
    trust = ["--tls", "--ca", str(cert)]
    with node("--vbucket-count", "4", "--tls-cert", str(cert), "--tls-key", str(key)) as port:
        target = f"127.0.0.1:{port}"
        loaded = run("load", "--target", target, "--items", "40", *trust)
        assert loaded.returncode == 0, loaded.stderr
        assert "(sets 40," in loaded.stdout
        shown = run("stats", target, "vbucket", *trust)
        assert shown.returncode == 0, shown.stderr
        assert "vb_3: active" in shown.stdout
        changed = run("vbucket", target, "3", "replica", *trust)
        assert changed.returncode == 0, changed.stderr
        captured = run(
            "capture", "--upr", target, "--out", str(tmp_path / "upr"), "--until-caught-up",
            "--vbuckets", "0-2", *trust,
        )  # fmt: skip
        assert captured.returncode == 0, captured.stderr
        assert any((tmp_path / "upr").iterdir())


def test_untrusted_or_plain_is_one_line(tmp_path: Path, certificate: tuple[Path, Path]) -> None:
    cert, key = certificate
    other_ca, _ = make_certificate(tmp_path)  # a CA that did not sign the node's certificate
    with node("--vbucket-count", "4", "--tls-cert", str(cert), "--tls-key", str(key)) as port:
        target = f"127.0.0.1:{port}"
        untrusted = run("stats", target, "--tls", "--ca", str(other_ca))
        assert untrusted.returncode == 1
        assert untrusted.stderr.count("\n") == 1
        assert untrusted.stderr.startswith(f"stats: {target}: TLS handshake with {target} failed")
        plain = run("stats", target)
        assert plain.returncode == 1
        assert plain.stderr.count("\n") == 1
        assert plain.stderr.startswith(f"stats: {target}: ")
        assert "Traceback" not in untrusted.stderr + plain.stderr


def test_tls_options_are_checked_before_dialling(tmp_path: Path) -> None:
    missing = tmp_path / "missing.pem"
    for command in (["stats", "127.0.0.1:1"], ["load", "--target", "127.0.0.1:1", "--items", "1"]):
        alone = run(*command, "--ca", str(missing))
        assert alone.returncode == 2
        assert alone.stderr == f"{command[0]}: --ca {missing}: needs --tls\n"
        absent = run(*command, "--tls", "--ca", str(missing))
        assert absent.returncode == 2
        assert absent.stderr == f"{command[0]}: --ca {missing}: no such file\n"
    captured = run(
        "capture", "--upr", "127.0.0.1:1", "--out", str(tmp_path / "c"), "--tls", "--ca",
        str(missing),
    )  # fmt: skip
    assert captured.returncode == 2
    assert captured.stderr == f"capture: --ca {missing}: no such file\n"
    unreadable = run("stats", "127.0.0.1:1", "--user", "a", "--password-file", str(missing))
    assert unreadable.returncode == 2
    assert unreadable.stderr == (
        f"stats: --password-file {missing}: cannot read it: No such file or directory\n"
    )


def _vbucket_state(target: str, vb: int, *trust: str) -> str:
    shown = run("stats", target, "vbucket", "--json", *trust)
    assert shown.returncode == 0, shown.stderr
    return str(json.loads(shown.stdout)[f"vb_{vb}"])


def test_move_reaches_tls_nodes(certificate: tuple[Path, Path]) -> None:
    """A TAP to UPR move with takeover: both nodes behind TLS (``--tls --ca``), then a
    plain source and a TLS destination (``--destination-tls --destination-ca``)."""
    cert, key = certificate
    served = ("--tls-cert", str(cert), "--tls-key", str(key))
    trust = ("--tls", "--ca", str(cert))
    with (
        node("--vbucket-count", "4", "--sample-items", "200", *served) as secured,
        node("--vbucket-count", "4", "--sample-items", "200") as plain,
        node("--vbucket-count", "4", "--replica-vbuckets", "0-3", *served) as destination,
    ):
        to = f"127.0.0.1:{destination}"
        both = run(
            "move", "--from-tap", f"127.0.0.1:{secured}", "--to-upr", to, "--vbuckets", "1",
            "--takeover", *trust,
        )  # fmt: skip
        assert both.returncode == 0, both.stderr
        assert _vbucket_state(f"127.0.0.1:{secured}", 1, *trust) == "dead"
        assert _vbucket_state(to, 1, *trust) == "active"
        one = run(
            "move", "--from-tap", f"127.0.0.1:{plain}", "--to-upr", to, "--vbuckets", "2",
            "--takeover", "--destination-tls", "--destination-ca", str(cert),
        )  # fmt: skip
        assert one.returncode == 0, one.stderr
        assert _vbucket_state(f"127.0.0.1:{plain}", 2) == "dead"
        assert _vbucket_state(to, 2, *trust) == "active"
        unsecured = run(
            "move", "--from-tap", f"127.0.0.1:{plain}", "--to-upr", to, "--vbuckets", "3"
        )
        assert unsecured.returncode == 1
        assert unsecured.stderr.count("\n") == 1
        assert unsecured.stderr.startswith(f"move: the destination {to} closed the connection")


def test_move_tls_options_are_checked_before_dialling(tmp_path: Path) -> None:
    missing = tmp_path / "missing.pem"
    move = ("move", "--from-tap", "127.0.0.1:1", "--to-upr", "127.0.0.1:2", "--vbuckets", "1")
    for args, expected in (
        (["--ca", str(missing)], f"--ca {missing}: needs --tls, --source-tls or --destination-tls"),
        (["--source-ca", str(missing)], f"--source-ca {missing}: needs --source-tls or --tls"),
        (["--tls", "--ca", str(missing)], f"--ca {missing}: no such file"),
        (
            ["--destination-tls", "--destination-ca", str(missing)],
            f"--destination-ca {missing}: no such file",
        ),
    ):
        refused = run(*move, *args)
        assert refused.returncode == 2, args
        assert refused.stderr == f"move: {expected}\n"


def test_move_from_upr_reaches_tls_nodes(certificate: tuple[Path, Path]) -> None:
    """A UPR to TAP move with takeover, both nodes behind TLS (``--tls --ca``): the
    source's vbucket states, its STAT and UPR streams and the destination's TAP
    receiver all go through TLS; then a plain destination (``--source-tls`` only)."""
    cert, key = certificate
    served = ("--tls-cert", str(cert), "--tls-key", str(key))
    trust = ("--tls", "--ca", str(cert))
    with (
        node("--vbucket-count", "4", "--sample-items", "200", *served) as source,
        node("--vbucket-count", "4", "--replica-vbuckets", "0-3", *served) as secured,
        node("--vbucket-count", "4", "--replica-vbuckets", "0-3") as plain,
    ):
        frm = f"127.0.0.1:{source}"
        both = run(
            "move", "--from-upr", frm, "--to-tap", f"127.0.0.1:{secured}", "--vbuckets", "1",
            "--takeover", *trust,
        )  # fmt: skip
        assert both.returncode == 0, both.stderr
        assert _vbucket_state(frm, 1, *trust) == "dead"
        assert _vbucket_state(f"127.0.0.1:{secured}", 1, *trust) == "active"
        one = run(
            "move", "--from-upr", frm, "--to-tap", f"127.0.0.1:{plain}", "--vbuckets", "2",
            "--takeover", "--source-tls", "--source-ca", str(cert),
        )  # fmt: skip
        assert one.returncode == 0, one.stderr
        assert _vbucket_state(frm, 2, *trust) == "dead"
        assert _vbucket_state(f"127.0.0.1:{plain}", 2) == "active"
