"""``--tls``/``--ca`` on the commands that dial one server: stats, vbucket, load, capture.

Couchbase 3.0 served the same memcached binary protocol inside TLS on its own
port (11207); cbstats and cbepctl reached it with their ``-s`` option. Here
the reference node serves TLS with ``--tls-cert`` and every client command
reaches it with ``--tls --ca FILE``; a certificate the client does not trust,
or a plain client on a TLS port, ends in one line naming the server.
"""

from __future__ import annotations

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
    with node("--vbuckets", "4", "--tls-cert", str(cert), "--tls-key", str(key)) as port:
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
    with node("--vbuckets", "4", "--tls-cert", str(cert), "--tls-key", str(key)) as port:
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
