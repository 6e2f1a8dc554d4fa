"""`tenplex bench goodput`: the trace, the accounting (on records with known answers), and the fixed short trace run
by tenplex, torchrun + DCP and torchft (when it is installed), checked against what the workers recorded.

The run checks the accounting (steps, events, pauses, steps lost, restored steps), never a timing.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from tenplex.bench.goodput_account import account, read_records
from tenplex.bench.goodput_trace import DEFAULT_RATES, SHORT, generate, parse, parse_rates
from tenplex.errors import ConfigError

B = 4  # the synthetic records' global batch


def test_trace_items_are_checked_against_the_nodes_running_then():
    assert [e.describe() for e in parse(SHORT, ["h0", "h1"])] == ["fail:h1@1", "gpufail:h0/1@2"]
    events = parse("gpufail:h0/1@3,leave:h1@4.5,join:h2@9", ["h0", "h1"])
    assert [(e.kind, e.host, e.device, e.at) for e in events] == [
        ("gpufail", "h0", "1", 3.0), ("leave", "h1", None, 4.5), ("join", "h2", None, 9.0)]
    for bad, words in [("fail:h2@1", "not running"), ("join:h1@1", "new node name"),
                       ("gpufail:h0/0@1,gpufail:h0/1@2", "another left"), ("fail:h1@2,fail:h0@1", "increase"),
                       ("boom:h1@1", "KIND:HOST@SECONDS"), ("fail:h1@1,fail:h0@2", "at least 1")]:
        with pytest.raises(ConfigError, match=words):
            parse(bad, ["h0", "h1"])
    with pytest.raises(ConfigError, match="KIND=PER_MINUTE"):
        parse_rates("fail=often")


def test_a_random_trace_is_seeded_and_keeps_two_to_four_nodes():
    rates = parse_rates(DEFAULT_RATES)
    assert sum(rates.values()) == pytest.approx(1.0)  # about one event per minute
    trace = generate(rates, 240, 3, ["h0", "h1"])
    assert trace == generate(rates, 240, 3, ["h0", "h1"])
    # Golden: random.Random(3)'s exponential gaps at 1/min and kinds drawn by the rates (the documented default run).
    assert [e.describe() for e in trace] == ["join:h2@16.3", "fail:h2@44", "gpufail:h1/1@96.2", "join:h3@144.2",
                                             "leave:h3@220"]
    for seed in range(20):
        running = {"h0", "h1"}
        for e in generate(rates, 600, seed, ["h0", "h1"]):
            running = running | {e.host} if e.kind == "join" else running - {e.host} if e.kind != "gpufail" \
                else running
            assert 2 <= len(running) <= 4


def _step(world: str, step: int, t: float, dp: int = 2, loss: float = 1.0) -> list[dict]:
    return [{"event": "step", "world": world, "step": step, "time": t, "dp": dp, "n": B // dp, "loss": loss}
            for _ in range(dp)]


def test_accounting_of_a_rollback_a_cut_step_and_the_goodput():
    # World A trains steps 1-5 (one per second from t=1); a node dies at t=5.5 while step 6 runs (only one of
    # the two ranks records it); world B restores step 3 and records steps 4-8 from t=10.
    docs = [d for s in range(1, 6) for d in _step("A", s, float(s))] + _step("A", 6, 6.0)[:1]
    docs += [d for i, s in enumerate(range(4, 9)) for d in _step("B", s, 10.0 + i)]
    docs.append({"event": "start", "bytes_read": 100})
    # world A's two ranks: their start-up phases (medians) before the first step at t=1
    docs += [{"event": "start", "world": "A", "time": 0.7, "host": f"h{r}", "pid": r,
              "phases": {"process": 0.1 + r / 5, "imported": 0.3 + r / 5, "started": 0.7}} for r in (0, 1)]
    reference = {s: 1.0 for s in range(1, 9)}
    report = account(docs, [{"kind": "fail", "host": "h1", "time": 5.5}], reference, steps=8, step_s=1.0,
                     launched=0.0, global_batch=B)
    assert report["finished"] and report["steps"] == 8
    assert report["cut_short"] == 1 and report["replayed_steps"] == 2 and report["attempts"] == 10
    assert report["wall_s"] == 14.0 and report["ideal_s"] == 8.0 and report["goodput"] == round(8 / 14, 4)
    assert report["worlds"] == 2 and report["bytes_read"] == 100 and report["losses"]["equal"]
    assert report["startup"] == {"process": 0.2, "imported": 0.4, "started": 0.7, "first_step": 1.0}
    (event,) = report["events"]
    assert (event["before"], event["resumed"], event["steps_lost"]) == (5, 3, 2)
    assert event["pause_s"] == 4.5 and event["regain_s"] == 6.5  # to step 4 at t=10, to step 6 at t=12
    reference[7] = 1.5
    assert not account(docs, [], reference, 8, 1.0, 0.0, B)["losses"]["equal"]


def _run(tmp_path, modes: list[str], trace: str = "short") -> dict:
    cli = "import sys; from tenplex.cli import main; sys.exit(main())"
    proc = subprocess.run([sys.executable, "-c", cli, "bench", "goodput", "--json", "--steps", "60", "--step-ms",
                           "50", "--trace", trace, "--grace", "10", "--modes", ",".join(modes), "--timeout", "240",
                           "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def _check_against_records(mode: dict, folder) -> None:
    docs = read_records(folder / mode["mode"] / "record")
    steps = [d for d in docs if d["event"] == "step"]
    starts = {}
    for d in docs:
        if d["event"] == "start":
            starts.setdefault(d["world"], []).append(d)
    assert mode["status"] == "ok", mode["error"]
    assert mode["steps"] == 60 and mode["finished"] and mode["losses"]["equal"]
    assert [e["kind"] for e in mode["events"]] == ["fail", "gpufail"] and all(e["reached"] for e in mode["events"])
    for e in mode["events"]:
        world_steps = [d for d in steps if d["world"] == e["new_world"]]
        assert world_steps and min(d["time"] for d in world_steps) > e["time"]  # a world formed after the event
        first = min(world_steps, key=lambda d: (d["step"], d["time"]))
        assert e["resumed"] == first["step"] - 1
        assert e["steps_lost"] == max(0, e["before"] - e["resumed"])
        assert e["pause_s"] > 0
        if e["new_world"] in starts and mode["mode"] != "torchft":  # the new world restored what it resumed from
            assert {d["restored_step"] or 0 for d in starts[e["new_world"]]} == {e["resumed"]}
    # The final history: every step once, and each from the last world that trained it.
    assert sorted({d["step"] for d in steps}) == list(range(1, 61))


def test_the_in_place_mode_runs_tenplex_run_in_place_with_the_same_worker(tmp_path, monkeypatch):
    # The in-place mode differs from the restart mode in tenplex run's --in-place only: the worker, its job, seed,
    # data and global batch are the same (the worker's loop form serves both), and so is the accounting.
    from tenplex.bench import goodput_modes
    from tenplex.elastic.nodes import Nodes

    started: list[list[str]] = []
    monkeypatch.setattr(Nodes, "start_rendezvous", lambda self: "127.0.0.1:1")
    monkeypatch.setattr(Nodes, "_popen", lambda self, host, argv, **kw: started.append(argv))
    for name, flags in [("tenplex", []), ("tenplex-inplace", ["--in-place"])]:
        cls, worker_mode, _ = goodput_modes.MODES[name]  # type: ignore[misc]
        assert worker_mode == name
        mode = cls(tmp_path, ["WORKER", worker_mode], {}, 4)
        mode.start("h0")
        argv = started.pop()
        assert argv[argv.index("run") + 1: argv.index("--host")] == flags
        assert argv[-2:] == ["WORKER", worker_mode]
    worker = subprocess.run([sys.executable, "-m", "tenplex.bench.goodput_worker", "--help"], capture_output=True,
                            text=True, check=True).stdout
    assert "tenplex-inplace" in worker


@pytest.mark.timeout(960)  # the run's own limit (900 s) reports first: three modes' restarts on a busy machine
def test_short_trace_tenplex_torchrun_dcp_and_torchft(tmp_path):
    # tenplex in place is left out: its gpufail is not in place yet (issue 36) and it would add a minute or more.
    modes = ["tenplex", "torchrun-dcp"]
    if importlib.util.find_spec("torchft") is not None:
        modes.append("torchft")
    result = _run(tmp_path, modes)
    assert [m["mode"] for m in result["modes"]] == modes
    assert [e["kind"] for e in result["trace"]] == ["fail", "gpufail"]
    by_mode = {m["mode"]: m for m in result["modes"]}
    for name in modes:
        _check_against_records(by_mode[name], tmp_path)
    dcp = by_mode["torchrun-dcp"]
    saved = {d["step"] for d in read_records(tmp_path / "torchrun-dcp" / "record") if d["event"] == "saved"}
    assert all(e["resumed"] in saved | {0} for e in dcp["events"])  # it resumed from a checkpoint it wrote
    if "torchft" in by_mode:
        # torchft drops the step in flight and heals a new replica from a live peer: no step is trained twice.
        assert all(e["steps_lost"] == 0 for e in by_mode["torchft"]["events"])
    assert set(result["cannot"]["tp/pp job"]) == {"tenplex", "tenplex-inplace", "torchrun-dcp", "torchft"}


@pytest.mark.timeout(600)
def test_the_tp_job_changes_tp_in_place_and_matches_its_own_reference(tmp_path):
    # The job the DDP-only peers cannot run: four workers train tp=2 (dp=2), the SIGKILL of h1 leaves two (tp=2,
    # dp=1), h0's GPU fault one (tp=1); the survivor on h0/0 lives through every world in one process, and the
    # losses equal its own uninterrupted run's (tp=1, one process).
    result = _run(tmp_path, ["tenplex-inplace-tp"], trace="fail:h1@2,gpufail:h0/1@4")
    (mode,) = result["modes"]
    _check_against_records(mode, tmp_path)
    assert (tmp_path / "reference-tp" / "record").is_dir() and not (tmp_path / "reference").exists()
    starts = [d for d in read_records(tmp_path / "tenplex-inplace-tp" / "record") if d["event"] == "start"]
    assert all(d["tp"] == (2 if d["size"] % 2 == 0 else 1) and d["dp"] * d["tp"] == d["size"] for d in starts)
    survivor = {(d["size"], d["tp"]) for d in starts if d["host"] == "h0" and d["device"] == "0"}
    assert {(2, 2), (1, 1)} <= survivor  # (4, 2) too, unless h1 started late on a busy machine and died first
    assert len({d["pid"] for d in starts if d["host"] == "h0" and d["device"] == "0"}) == 1  # one process


def test_a_committed_step_counts_when_a_participant_died_before_its_record():
    # torchft: the quorum committed step 2, then one of its two replicas died before writing its record.
    docs = _step("q1", 1, 1.0) + [dict(d, committed=True) for d in _step("q1", 2, 2.0)[:1]]
    report = account(docs, [], {1: 1.0, 2: 1.0}, steps=2, step_s=1.0, launched=0.0, global_batch=B)
    assert report["finished"] and report["cut_short"] == 0
    assert report["losses"] == {"max_abs_diff": 0.0, "tolerance": 1e-4, "compared": 1, "unknown": 1, "equal": True}
