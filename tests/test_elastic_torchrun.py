"""An elastic job on real torchrun agents (`tenplex run`) on loopback: a node joins, a node is SIGKILLed with its
process group and store, a node leaves by SIGTERM. The example GPT trains through tenplex.elastic.Job, reading
its data through each node's FUSE view (`tenplex demo --elastic --fuse`; in process where FUSE is unavailable:
test_elastic_partition covers that path too); the demo's checks (losses vs an uninterrupted run, exactly-once
data, bit-exact restores, step and position) must hold, and must fail on doctored records.

The module's run is in place (the demo's default, `tenplex run --in-place`): every survivor keeps its process
through the three changes, and the model is rebuilt with another tp and pp in the same process. The restart mode
(`--restart-mode`: torchrun restarts every worker) runs a shorter schedule against the same reference."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

import fuse_vfs
from tenplex.elastic import demo
from tenplex.elastic.launcher import alive
from tenplex.elastic.timeline import FORMAT, final_history, read_worlds, summarize

SCHEDULE = "join:h2@2,fail:h1@4,leave:h2@6"
STEPS = 8
FUSE = fuse_vfs.fuse_unavailable_reason() is None


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("elastic")
    lines: list[str] = []
    summary, history = demo.run(workdir, SCHEDULE, STEPS, say=lines.append, fuse=FUSE)  # a snapshot every step
    # Nothing may outlive the demo: every agent, worker, store and the rendezvous were stopped.
    for host in ("h0", "h1", "h2"):
        pid = int((workdir / "elastic" / host / ".tenplex-store.pid").read_text())
        assert not alive(pid), f"store of {host} still runs"
    return workdir, summary, history, lines


def test_summary_format_and_checks(run):
    _, summary, _, lines = run
    assert list(summary) == ["format", "ok", "mode", "events", "checks", "saves"] + (["view"] if FUSE else [])
    assert summary["mode"] == "in_place"
    assert summary["format"] == FORMAT
    assert summary["ok"], "\n".join(lines[-30:])
    c = summary["checks"]
    assert set(c) == {"loss_max_rel_diff", "samples_read_twice", "samples_skipped", "state_bit_exact",
                      "position_restored"} | ({"read_through_view"} if FUSE else set())
    assert c["loss_max_rel_diff"] <= 1e-4
    assert (c["samples_read_twice"], c["samples_skipped"], c["state_bit_exact"], c["position_restored"]) == \
        (0, 0, True, True)
    json.dumps(summary)  # plain JSON


@pytest.mark.skipif(not FUSE, reason="FUSE unavailable: the workers read in process")
def test_every_worker_read_through_its_nodes_view_switched_by_every_world(run):
    workdir, summary, _, _ = run
    # h0 is in all four worlds, h2 in the two between its join and its leave; h1's view died with it.
    assert summary["view"] == {"read": True, "worlds": 4, "switches": {"h0": 4, "h1": None, "h2": 2}}
    assert summary["checks"]["read_through_view"] is True
    assert not any((workdir / "elastic" / f"view-{h}").is_mount() for h in ("h0", "h1", "h2"))


def test_each_event_changes_the_world_and_the_configuration(run):
    _, summary, _, _ = run
    join, fail, leave = summary["events"]
    assert [e["kind"] for e in summary["events"]] == ["join", "fail", "leave"]
    # In place a world's nodes are in the order their workers registered (tenplex.elastic.protocol.node_order)
    assert _sorted(join["from"]) == {"world": 4, "hosts": ["h0", "h1"], "parallel": "dp=2,tp=2,pp=1"}
    assert _sorted(join["to"]) == {"world": 6, "hosts": ["h0", "h1", "h2"], "parallel": "dp=1,tp=2,pp=3"}  # pinned
    assert _sorted(fail["to"]) == {"world": 4, "hosts": ["h0", "h2"], "parallel": "dp=2,tp=2,pp=1"}
    assert leave["to"] == {"world": 2, "hosts": ["h0"], "parallel": "dp=1,tp=2,pp=1"}
    for e in summary["events"]:
        _check_row_shape(e)
        # In place: every survivor (a device in the worlds before and after) kept its process.
        assert e["pids"] and all(p["before"] == p["after"] for p in e["pids"].values()), e["pids"]
    assert sorted(join["pids"]) == ["h0/0", "h0/1", "h1/0", "h1/1"] and sorted(leave["pids"]) == ["h0/0", "h0/1"]
    # A join and a leave save at the step boundary after the signal: nothing is lost.
    assert join["lost_steps"] == 0 and join["resumed_from_step"] == join["at_step"] + 1
    assert leave["lost_steps"] == 0 and leave["resumed_from_step"] in (leave["at_step"], leave["at_step"] + 1)
    # The failure saves nothing: the survivors resume from the newest snapshot, the one of the step the node was
    # killed after (the demo kills once that snapshot's copies exist): nothing is lost.
    assert fail["lost_steps"] == 0 and fail["resumed_from_step"] == fail["at_step"]
    saves = summary["saves"]
    assert saves["kinds"]["snapshot"] >= 3 and saves["max_replication_lag"] >= 0
    # The joining node's store starts empty: its stage crosses hosts. After the failure, h1's pipeline stage had
    # no data-parallel copy: it came back from the replicated copies, then moved to the new configuration.
    assert join["bytes"]["inter_host"] > 0 and fail["bytes"]["inter_host"] > 0


def _sorted(world: dict) -> dict:
    return dict(world, hosts=sorted(world["hosts"]))


def _check_row_shape(e: dict) -> None:
    """An event's row: the same keys in both modes; the pause's parts add up to it."""
    assert set(e) == {"kind", "host", "at_step", "resumed_from_step", "lost_steps", "from", "to", "detect_s",
                      "restart_s", "restore_s", "bytes", "pause_s", "pause", "checks_s", "pids"}
    assert set(e["bytes"]) == {"kept", "intra_host", "inter_host", "inter_host_lower_bound"}
    assert e["bytes"]["inter_host"] == e["bytes"]["inter_host_lower_bound"]
    assert set(e["pause"]) == {"detect_s", "agree_s", "re_form_s", "restore_s", "first_step_s"}
    assert e["pause_s"] > 0 and sum(e["pause"].values()) == pytest.approx(e["pause_s"], abs=0.01)
    assert e["checks_s"] > 0  # the demo's dumps (the restored state's, at least) were told apart from the pause


def test_the_restart_mode_restarts_every_worker_and_passes_the_same_checks(run, tmp_path):
    """``--restart-mode`` (torchrun restarts every worker at a change) on a shorter schedule: the node that holds
    data-parallel rank 0 is SIGKILLed. The same checks against the module run's reference, the same row shape,
    and new pids for the survivors."""
    workdir, _, _, _ = run
    events = demo.parse_schedule("fail:h0@2", ("h0", "h1"), STEPS)
    lines: list[str] = []
    record, fired = demo.run_elastic(tmp_path, workdir / "data" / "dataset", STEPS, events, ("h0", "h1"), 1,
                                     demo.DEFAULT_PINS, lines.append, in_place=False)
    summary, _ = summarize(workdir / "reference" / "record", record, events, fired,
                           [tmp_path / "elastic" / h for h in ("h0", "h1")], [["h1"]])
    assert summary["ok"], "\n".join(lines[-30:])
    assert any("elastic run (restart mode)" in line for line in lines)
    (fail,) = summary["events"]
    _check_row_shape(fail)
    # h0 held data-parallel rank 0 (torchrun numbers the nodes as they arrive: the world's first host)
    assert fail["from"]["hosts"][0] == "h0" and fail["to"] == {"world": 2, "hosts": ["h1"],
                                                                 "parallel": "dp=1,tp=2,pp=1"}
    assert fail["lost_steps"] <= 1
    assert sorted(fail["pids"]) == ["h1/0", "h1/1"]
    assert all(p["before"] != p["after"] for p in fail["pids"].values())  # restarted


def test_the_checks_fail_on_doctored_records(run, tmp_path):
    workdir, _, _, _ = run
    events = demo.parse_schedule(SCHEDULE, ("h0", "h1"), STEPS)
    after = demo.expected_hosts(("h0", "h1"), events)
    roots = [workdir / "elastic" / h for h in ("h0", "h1", "h2")]
    fired = json.loads((workdir / "elastic" / "fired.json").read_text())

    def doctored(edit) -> dict:
        copy = tmp_path / f"record-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(workdir / "elastic" / "record", copy)
        edit(copy)
        return summarize(workdir / "reference" / "record", copy, events, fired, roots, after)[0]["checks"]

    first = final_history(read_worlds(workdir / "reference" / "record"))[1]["ids"][0]

    def read_twice(folder: Path) -> None:  # the last step reads step 1's first sample instead of one of its own
        for path in folder.glob("rank-*.jsonl"):
            docs = [json.loads(line) for line in path.read_text().splitlines()]
            for d in docs:
                if d["event"] == "step" and d["step"] == STEPS and d["ids"]:
                    d["ids"][0] = first
            path.write_text("".join(json.dumps(d) + "\n" for d in docs))

    def one_ulp_off(folder: Path) -> None:
        from safetensors.numpy import load_file, save_file

        path = sorted((folder / "dumps").glob("restored-*.safetensors"))[0]
        state = load_file(str(path))
        name = sorted(state)[0]
        state[name] = state[name].copy()
        state[name].reshape(-1)[:1] = np.nextafter(state[name].reshape(-1)[:1], np.inf)
        save_file(state, str(path))

    checks = doctored(read_twice)
    assert checks["samples_read_twice"] == 1 and checks["samples_skipped"] == 1
    assert doctored(one_ulp_off)["state_bit_exact"] is False
    assert doctored(lambda folder: None)["state_bit_exact"] is True  # the untouched copy passes


def test_live_progress_names_worlds_and_steps(run):
    _, _, _, lines = run
    text = "\n".join(lines)
    assert re.search(r"world 6 on h[01],h[01],h2: dp=1,tp=2,pp=3", text)  # h0 and h1 in the order they registered
    assert "event 2: fail h1 at step 4" in text
    assert f"step {STEPS:3d}" in text


def test_plot_writes_a_png(run, tmp_path):
    pytest.importorskip("matplotlib")
    from tenplex.elastic.timeline import plot

    _, summary, history, _ = run
    plot(summary, history, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_schedules_are_refused_before_anything_starts():
    from tenplex.errors import ConfigError

    for text, words in [("join:h1@2", "already running"), ("fail:h5@2", "not running"),
                        ("leave:h1@3,leave:h0@5", "last node"), ("join:h2@4,fail:h1@4", "steps must increase"),
                        ("jump:h2@2", "KIND:HOST@STEP"), ("join:h2@9", "within 1..7")]:
        with pytest.raises(ConfigError, match=words):
            demo.parse_schedule(text, ("h0", "h1"), STEPS)


def test_status_of_the_stores_after_the_demo_matches_its_timeline(run, tmp_path):
    from store_helpers import StoreProcess

    from tenplex.cli.status import gather

    workdir, summary, _, _ = run
    last = summary["events"][-1]["to"]  # the world after the leave: h0 alone
    shutil.copytree(workdir / "elastic" / "h0", tmp_path / "h0")
    store = StoreProcess(tmp_path / "h0", "h0")  # a new server on the store h0 kept (another port)
    try:
        report = gather([store.address], timeout=60)  # one store, which answers: no wait unless the machine is slow
    finally:
        store.stop()
    assert [(h["host"], h["reachable"]) for h in report["hosts"]] == [("h0", True)]  # the record's h0 is not asked
    newest = report["versions"][0]
    assert newest["saved_hosts"] == last["hosts"] and newest["missing"] == []
    assert report["configuration"] == {"h0": last["world"]}
    assert report["last_committed_step"] == STEPS  # the final save, after the last step
    assert report["restorable"] == {"version": newest["version"], "step": STEPS}
