"""``--log-format json`` (one object per line: time, level, logger, message and the context known) on the
long-running commands, and how ``tenplex run`` takes its operations options out of torchrun's command line."""

from __future__ import annotations

import json
import logging

import pytest

from tenplex.cli import build_parser
from tenplex.cli._run_operations import take
from tenplex.ops import logs

from store_helpers import StoreProcess


def test_store_serve_logs_json_lines(tmp_path):
    store = StoreProcess(tmp_path / "h0", "h0", extra_args=("--log-format", "json"), full_cli=True)
    store.stop()
    lines = [line for line in (tmp_path / ".h0.log").read_text().splitlines() if line.startswith("{")]
    records = [json.loads(line) for line in lines]
    serving = [r for r in records if r["logger"] == "tenplex.store.server"]
    assert serving and set(serving[0]) == {"time", "level", "logger", "message", "host"}
    assert serving[0]["level"] == "INFO" and serving[0]["host"] == "h0" and serving[0]["time"].endswith("Z")
    assert serving[0]["message"].startswith(f"store {tmp_path / 'h0'} (host h0) serving on 127.0.0.1:")


def test_json_lines_carry_the_context_known(capsys, monkeypatch):
    monkeypatch.setattr(logs, "_context", {})
    monkeypatch.setenv(logs.FORMAT_ENV, "text")  # setup() sets it for child processes; restored after the test
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        logs.setup("json", host="h1")
        logs.set_context(version=3, step=40, world=None)  # None: not known, left out
        logging.getLogger("tenplex.test").warning("saved %d bytes", 12)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    record = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert {k: v for k, v in record.items() if k != "time"} == {
        "level": "WARNING", "logger": "tenplex.test", "message": "saved 12 bytes", "host": "h1", "version": 3,
        "step": 40}
    with pytest.raises(ValueError, match="unknown log context"):
        logs.set_context(rank=1)


def test_run_takes_its_operations_options_before_the_script_only():
    argv = ["--log-format", "json", "--host", "h0", "--store-root", "/tmp/s", "--metrics-port=9400",
            "--nproc-per-node", "2", "train.py", "--log-format", "text", "--metrics-port", "1"]
    rest, options = take(argv)
    assert rest == ["--host", "h0", "--store-root", "/tmp/s", "--nproc-per-node", "2", "train.py", "--log-format",
                    "text", "--metrics-port", "1"]
    assert (options.log_format, options.metrics_port, options.metrics_bind, options.host) == \
        ("json", 9400, "127.0.0.1", "h0")


@pytest.mark.parametrize("argv", [["rendezvous", "serve", "--log-format", "json"],
                                  ["operator", "run", "-A", "--log-format", "json", "--metrics-port", "9500"],
                                  ["store", "serve", "--root", "r", "--host", "h0", "--log-format", "json",
                                   "--metrics-port", "9501", "--metrics-bind", "0.0.0.0"]])
def test_long_running_commands_take_the_options(argv):
    args = build_parser().parse_args(argv)
    assert args.log_format == "json" and getattr(args, "metrics_port", None) in (None, 9500, 9501)


def test_a_bad_log_format_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["store", "serve", "--root", "r", "--host", "h0", "--log-format", "xml"])
    assert exit_.value.code == 2 and "invalid choice: 'xml'" in capsys.readouterr().err


def test_a_taken_metrics_port_is_one_line_and_exit_2(tmp_path):
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([str(Path(sys.executable).with_name("tenplex")), "store", "serve", "--root",
                               str(tmp_path / "h0"), "--host", "h0", "--metrics-port", str(port)],
                              capture_output=True, text=True, timeout=120)
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert done.returncode == 2 and errors == [
        f"tenplex store: error: --metrics-port {port}: cannot serve metrics on 127.0.0.1 (Address already in use); "
        f"choose another port"]
