"""Issue 12, defect 10: user errors on the command line give one line naming the problem, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest


def _tenplex(*args: str, cwd=None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "import sys; from tenplex.cli import main; sys.exit(main())", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd)


def _one_line_error(result: subprocess.CompletedProcess, *words: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr and "[rank" not in result.stderr, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(lines) == 1, result.stderr[-2000:]
    for word in words:
        assert word in lines[0], lines[0]


def test_data_pack_with_an_unknown_dtype(tmp_path):
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "tokens.bin")
    result = _tenplex("data", "pack", str(tmp_path / "tokens.bin"), str(tmp_path / "ds"), "--seq-len", "4",
                      "--dtype", "nope")
    _one_line_error(result, "--dtype", "'nope'")
    assert not (tmp_path / "ds").exists()


def test_store_serve_with_files_that_are_not_certificates(tmp_path):
    (tmp_path / "x").write_text("not a certificate\n")
    result = _tenplex("store", "serve", "--root", str(tmp_path / "s"), "--host", "h0", "--tls-cert",
                      str(tmp_path / "x"), "--tls-key", str(tmp_path / "x"))
    _one_line_error(result, "--tls-cert", "PEM")
    assert "Failed to bind" not in result.stderr


@pytest.mark.parametrize("flag", ["--from", "--to"])
def test_demo_with_a_parallelism_the_example_model_cannot_take(tmp_path, flag):
    result = _tenplex("demo", flag, "tp=3,dp=2", "--workdir", str(tmp_path / "w"), timeout=300)
    _one_line_error(result, flag, "tp=3", "4 attention heads")
    assert "logs" not in result.stderr


@pytest.mark.parametrize("args, words", [
    (["--port", "99999"], ["--port", "'99999'", "0-65535"]),
    (["--port", "-5"], ["--port", "'-5'", "0-65535"]),
    (["--bind", "192.0.2.1"], ["192.0.2.1", "--allow-unauthenticated"]),
    (["--bind", "192.0.2.1", "--allow-unauthenticated"], ["192.0.2.1:29400", "not an address of this machine"]),
])
def test_rendezvous_serve_with_a_bad_port_or_address(args, words):
    result = _tenplex("rendezvous", "serve", *args)
    assert result.returncode == 2
    _one_line_error(result, *words)


def test_rendezvous_serve_on_a_port_in_use():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _tenplex("rendezvous", "serve", "--port", str(port))
    assert result.returncode == 2
    _one_line_error(result, f"127.0.0.1:{port}", "in use")
