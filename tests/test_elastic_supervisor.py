"""``tenplex run --in-place``'s local supervisor (tenplex.elastic.supervisor), with real worker processes
(tests/mp/supervised_worker.py): a crash restarts the crashed worker alone, counted against --max-restarts; a lost
peer's exit is restarted without counting; a device fault drops its worker and device; SIGTERM is a planned leave
that reaches every worker; the command line needs no torch, and other torchrun options keep torchrun."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from tenplex.cli._operations import add_arguments
from tenplex.cli._run_operations import NAMES
from tenplex.elastic.light_launch import parse_light
from tenplex.elastic.launcher import stop_store
from tenplex.elastic.supervisor import Supervisor

WORKER = Path(__file__).resolve().parent / "mp" / "supervised_worker.py"


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def supervise(tmp_path: Path, nproc: int, max_restarts: int, plan: dict) -> tuple[int, Supervisor]:
    sup = Supervisor("h0", nproc, max_restarts, [sys.executable, str(WORKER), str(tmp_path), json.dumps(plan)],
                     grace=60.0)
    return sup.run(), sup


def test_a_crash_restarts_that_worker_alone_and_counts_a_lost_peer_does_not(tmp_path):
    code, sup = supervise(tmp_path, 2, 1, {"0": ["wait"], "1": [1, 75, "release"]})
    assert code == 0
    survivor, restarted = lines(tmp_path / "slot-0.jsonl"), lines(tmp_path / "slot-1.jsonl")
    assert len(survivor) == 1                                                 # never restarted
    assert len({d["pid"] for d in restarted}) == 3                            # a new process each time
    assert [d["TORCHELASTIC_RESTART_COUNT"] for d in restarted] == ["0", "1", "2"]
    assert sup.crashes == 1                                                   # the lost peer's exit did not count
    assert {d["LOCAL_WORLD_SIZE"] for d in survivor + restarted} == {"2"}
    assert {d["TENPLEX_DEVICES"] for d in survivor + restarted} == {"0,1"}
    assert {(d["LOCAL_RANK"], d["RANK"]) for d in restarted} == {("1", "1")}


def test_more_crashes_than_max_restarts_stop_the_node(tmp_path):
    code, sup = supervise(tmp_path, 2, 1, {"0": ["wait"], "1": [1, 1]})
    assert code == 1 and sup.crashes == 2
    assert len(lines(tmp_path / "slot-1.jsonl")) == 2
    assert [d for d in lines(tmp_path / "slot-0.jsonl") if "term" in d]       # its sibling was stopped (SIGTERM)


def test_a_device_fault_drops_its_worker_and_device_and_the_last_device_ends_the_node(tmp_path):
    code, sup = supervise(tmp_path, 2, 0, {"0": ["after-1"], "1": [76]})
    assert code == 0                                                          # the other worker finished
    assert len(lines(tmp_path / "slot-1.jsonl")) == 1 and sup.crashes == 0    # not restarted, not a crash
    assert list(sup.devices.excluded) == ["1"] and sup.devices.healthy == ["0"]
    alone = tmp_path / "alone"
    alone.mkdir()
    code, sup = supervise(alone, 1, 3, {"0": [76]})
    assert code == 1 and sup.devices.healthy == [] and len(lines(alone / "slot-0.jsonl")) == 1


def test_tenplex_run_in_place_supervises_without_torch_and_sigterm_is_a_planned_leave(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    run = subprocess.Popen([sys.executable, "-m", "tenplex.cli", "run", "--in-place", "--host", "h0", "--store-root",
                            str(tmp_path / "h0"), "--nnodes", "2:3", "--nproc-per-node", "2", "--rdzv-endpoint",
                            "127.0.0.1:1", "--rdzv-id", "sup", str(WORKER), str(out), "{}"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(lines(out / "slot-0.jsonl") + lines(out / "slot-1.jsonl")) < 2:
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()[0]
            time.sleep(0.05)
        maps = Path(f"/proc/{run.pid}/maps").read_text()
        assert "libtorch" not in maps and "torch/lib" not in maps                 # the launcher never loaded torch
        run.send_signal(signal.SIGTERM)
        assert run.wait(timeout=120) == 0, run.communicate()[0]
    finally:
        run.kill()
        stop_store(tmp_path / "h0")
    workers = lines(out / "slot-0.jsonl") + lines(out / "slot-1.jsonl")
    assert len([d for d in workers if "term" in d]) == 2                          # both left, each once
    started = [d for d in workers if "pid" in d]
    assert {d["TENPLEX_AGENT_PID"] for d in started} == {str(run.pid)}
    assert {(d["TENPLEX_IN_PLACE"], d["TENPLEX_RDZV_ENDPOINT"], d["TENPLEX_RDZV_ID"], d["TENPLEX_MIN_WORKERS"],
             d["TENPLEX_HOST"]) for d in started} == {("1", "127.0.0.1:1", "sup", "4", "h0")}
    assert all(d["TENPLEX_STORE_ADDRESS"] and d["MASTER_PORT"] for d in started)
    assert "supervised here (no torchrun)" in run.communicate()[0]


def test_other_torchrun_options_keep_torchrun():
    base = ["--in-place", "--host", "h0", "--store-root", "/s", "--rdzv-endpoint", "127.0.0.1:5"]
    spec, ns, nproc, restarts = parse_light([*base, "--nproc-per-node", "3", "--max-restarts", "2",
                                             "--log-format", "json", "-m", "pkg.train", "--lr", "1"],
                                            add_arguments, NAMES)
    assert (spec.mode, spec.target, spec.args, nproc, restarts, ns.log_format) == (
        "module", "pkg.train", ["--lr", "1"], 3, 2, "json")
    assert spec.torchrun == ["--rdzv-endpoint", "127.0.0.1:5", "--nproc-per-node", "3", "--max-restarts", "2"]
    for other in (["--log-dir", "/l"], ["--nproc-per-node", "gpu"], ["--max-restarts", "x"]):
        assert parse_light([*base, *other, "t.py"], add_arguments, NAMES) is None
    assert parse_light(base[1:] + ["t.py"], add_arguments, NAMES) is None     # not in place: torchrun
    assert parse_light(base[:3] + ["t.py"], add_arguments, NAMES) is None     # malformed: the full parser says why
