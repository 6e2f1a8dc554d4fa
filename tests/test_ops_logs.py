"""``--log-format json`` (one object per line: time, level, logger, message and the context known) on the
long-running commands, and how ``tenplex run`` takes its operations options out of torchrun's command line."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tenplex.cli import build_parser
from tenplex.cli._run_operations import take
from tenplex.ops import logs

from store_helpers import StoreProcess


def _json_lines(text: str) -> list[dict]:
    """Every line of a command's output, each of which must be a JSON object."""
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            raise AssertionError(f"not a JSON line: {line!r}") from None
        assert isinstance(record, dict) and {"time", "level", "logger", "message"} <= set(record), line
        records.append(record)
    return records


def test_store_serve_logs_json_lines(tmp_path):
    store = StoreProcess(tmp_path / "h0", "h0", extra_args=("--log-format", "json"), full_cli=True)
    store.stop()
    records = _json_lines((tmp_path / ".h0.log").read_text())  # every line, the start-up line too
    serving = [r for r in records if r["logger"] == "tenplex.store.server"]
    assert serving and set(serving[0]) == {"time", "level", "logger", "message", "host"}
    assert serving[0]["level"] == "INFO" and serving[0]["host"] == "h0" and serving[0]["time"].endswith("Z")
    assert serving[0]["message"].startswith(f"store {tmp_path / 'h0'} (host h0) serving on 127.0.0.1:")
    [started] = [r for r in records if r["logger"] == "tenplex.cli.store"]
    assert started["message"] == f"tenplex store h0 serving {tmp_path / 'h0'} on 127.0.0.1:{store.port}"
    assert (started["port"], started["host"]) == (store.port, "h0")


def test_store_serve_keeps_its_human_start_up_line_in_text(tmp_path):
    store = StoreProcess(tmp_path / "h0", "h0", full_cli=True)
    store.stop()
    assert f"tenplex store h0 serving {tmp_path / 'h0'} on 127.0.0.1:{store.port}\n" in \
        (tmp_path / ".h0.log").read_text()


def _tenplex(*args: str) -> list[str]:
    return [str(Path(sys.executable).with_name("tenplex")), *args]


def test_rendezvous_serve_and_run_print_only_json_lines_with_the_job(tmp_path):
    """A rendezvous server and a one-node ``tenplex run`` of a script that prints nothing: every line either
    prints is JSON, and run's lines name the job (its rendezvous id)."""
    (tmp_path / "quiet.py").write_text("")
    rendezvous = subprocess.Popen(_tenplex("rendezvous", "serve", "--port", "0", "--port-file", str(tmp_path / "p"),
                                           "--log-format", "json"), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ((tmp_path / "p").exists() and (tmp_path / "p").read_text().strip()):
            assert rendezvous.poll() is None and time.monotonic() < deadline, "the rendezvous server did not start"
            time.sleep(0.05)
        port = int((tmp_path / "p").read_text())
        run = subprocess.run(_tenplex("run", "--log-format", "json", "--host", "h0", "--store-root",
                                      str(tmp_path / "s"), "--nnodes", "1", "--nproc-per-node", "1",
                                      "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "job-7",
                                      str(tmp_path / "quiet.py")),
                             capture_output=True, text=True, timeout=300, cwd=tmp_path)
    finally:
        rendezvous.terminate()
        served, _ = rendezvous.communicate(timeout=60)
        subprocess.run(_tenplex("store", "stop", "--store-root", str(tmp_path / "s")), capture_output=True,
                       timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = _json_lines(run.stdout + run.stderr)
    assert lines and all(r["job"] == "job-7" and r["host"] == "h0" for r in lines)
    assert any(r["message"].startswith("tenplex run: host h0, store 127.0.0.1:") for r in lines)
    [ready] = _json_lines(served)
    assert ready["message"] == f"tenplex rendezvous serving on 127.0.0.1:{port}" and ready["port"] == port


def test_operator_run_prints_json_lines_even_when_it_cannot_start(tmp_path):
    pytest.importorskip("kopf")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env["KUBECONFIG"] = str(tmp_path / "missing")
    done = subprocess.run(_tenplex("operator", "run", "-A", "--log-format", "json"), capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 2
    [error] = _json_lines(done.stdout + done.stderr)
    assert error["level"] == "ERROR" and error["message"].startswith("tenplex operator: error: no Kubernetes")


def test_operator_lines_about_a_job_name_it():
    """Within a reconciliation's scope, and in kopf's lines about a TenplexJob (its k8s_ref)."""
    record = logging.LogRecord("kopf.objects", logging.INFO, "", 0, "rescaled", None, None)
    record.k8s_ref = {"kind": "TenplexJob", "namespace": "team", "name": "gpt"}
    logs._WithContext().filter(record)
    assert record.job == "team/gpt"
    with logs.scope(job="team/llama"):
        inside = logging.LogRecord("tenplex.operator", logging.INFO, "", 0, "decided", None, None)
        logs._WithContext().filter(inside)
    outside = logging.LogRecord("tenplex.operator", logging.INFO, "", 0, "idle", None, None)
    logs._WithContext().filter(outside)
    assert inside.job == "team/llama" and not hasattr(outside, "job")


def test_a_workers_job_is_its_name_or_its_rendezvous_id(monkeypatch):
    monkeypatch.delenv(logs.JOB_ENV, raising=False)
    monkeypatch.setenv(logs.RUN_ID_ENV, "none")
    assert logs.job_name() is None and logs.job_name("uid-1") == "uid-1"
    monkeypatch.setenv(logs.RUN_ID_ENV, "uid-2")
    assert logs.job_name() == "uid-2"
    monkeypatch.setenv(logs.JOB_ENV, "team/gpt")
    assert logs.job_name() == "team/gpt"


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
