"""A GPU is the unit of failure in the elastic demo (``gpufail:HOST/DEVICE@STEP``): one worker of a two-worker
node dies with an injected device fault (TENPLEX_INJECT_DEVICE_FAULT, raised as torch raises a CUDA error).
In place (the demo's default: ``tenplex run --in-place``) that worker's process ends, its agent drops the device
without stopping the node's other worker, and the survivors (that worker and the other node's) form a world of 3
ranks (2+1) in their own processes; then the node holding data-parallel rank 0 is SIGKILLed and the last worker
goes on alone, again in its own process. Real torchrun agents on loopback; the demo's checks (losses, exactly-once
samples, bit-exact state) must hold. (The restart-mode path, where the agent re-joins with one worker fewer, is
tests/test_elastic_restarts.py's; the demo's restart mode is tests/test_elastic_torchrun.py's.)"""

from __future__ import annotations

import json

import pytest

from tenplex.elastic import demo
from tenplex.elastic.timeline import World, _event_row, read_worlds
from tenplex.errors import ConfigError

SCHEDULE = "gpufail:h1/1@2,fail:h0@4"
STEPS = 6


def test_gpufail_schedules_are_checked():
    events = demo.parse_schedule("gpufail:h1/1@4,fail:h0@8,join:h2@12", ("h0", "h1"), 16)
    assert [(e.kind, e.host, e.at) for e in events] == [("gpufail", "h1/1", 4), ("fail", "h0", 8),
                                                        ("join", "h2", 12)]
    assert demo.expected_hosts(("h0", "h1"), events) == [["h0", "h1"], ["h1"], ["h1", "h2"]]
    for text, words in [("gpufail:h1@4", "gpufail:HOST/DEVICE@STEP"), ("fail:h1/1@4", "KIND:HOST@STEP"),
                        ("gpufail:h1/2@4", "devices 0..1"), ("gpufail:h5/0@4", "not running"),
                        ("gpufail:h1/1@2,gpufail:h1/1@4", "of which 1 failed before"),
                        ("gpufail:h1/1@2,gpufail:h1/0@4", "last device; use fail:h1@4")]:
        with pytest.raises(ConfigError, match=words):
            demo.parse_schedule(text, ("h0", "h1"), 16)


def test_a_failed_gpu_leaves_its_node_in_the_job_and_the_survivors_keep_their_processes(tmp_path):
    lines: list[str] = []
    summary, _ = demo.run(tmp_path, SCHEDULE, STEPS, save_every=1, say=lines.append)  # a snapshot every step
    assert summary["ok"], "\n".join(lines[-30:])
    assert summary["mode"] == "in_place"
    c = summary["checks"]
    assert (c["samples_read_twice"], c["samples_skipped"], c["state_bit_exact"], c["position_restored"]) == \
        (0, 0, True, True) and c["loss_max_rel_diff"] <= 1e-4
    gpufail, fail = summary["events"]
    assert (gpufail["kind"], gpufail["host"], gpufail["at_step"]) == ("gpufail", "h1/1", 2)
    # In place the hosts come in rank order, and which node holds rank 0 is the one that registered first.
    assert _sorted_hosts(gpufail["from"]) == {"world": 4, "hosts": ["h0", "h1"], "parallel": "dp=2,tp=2,pp=1"}
    # 2+1 ranks: the demo pins world 3 to dp=3 (DEFAULT_PINS), so that every remaining device trains.
    assert _sorted_hosts(gpufail["to"]) == {"world": 3, "hosts": ["h0", "h1"], "parallel": "dp=3,tp=1,pp=1"}
    # The fault hit at the boundary of step 3, before its snapshot: the next world resumed from step 2's.
    assert (gpufail["resumed_from_step"], gpufail["lost_steps"]) == (2, 1)
    # h0 is SIGKILLed (the node holding data-parallel rank 0 when it registered first): h1's last worker trains
    # alone, at most a step lost.
    assert fail["to"] == {"world": 1, "hosts": ["h1"], "parallel": "dp=1,tp=1,pp=1"} and fail["lost_steps"] <= 1
    # Every survivor kept its process: h0's two workers and h1's healthy one through the GPU fault, h1's through
    # the loss of h0.
    assert sorted(gpufail["pids"]) == ["h0/0", "h0/1", "h1/0"] and sorted(fail["pids"]) == ["h1/0"]
    for e in (gpufail, fail):
        assert all(p["before"] == p["after"] for p in e["pids"].values()), e["pids"]
        assert e["pause_s"] > 0 and sum(e["pause"].values()) == pytest.approx(e["pause_s"], abs=0.01)
    json.dumps(summary)
    # Device 1 was excluded, not retried: every later world ran one worker on h1, and h1's agent said why.
    worlds = read_worlds(tmp_path / "elastic" / "record")
    later = [w for w in worlds if w.size == 3]
    assert later and all(sorted(w.file_hosts.values()) == ["h0", "h0", "h1"] for w in later)
    log = (tmp_path / "elastic" / "agent-h1.log").read_text()
    assert log.count("device 1 (local rank 1) had a device fault; excluded, the node's other workers go on") == 1
    assert "a worker crashed" not in log + (tmp_path / "elastic" / "agent-h0.log").read_text()
    assert any("event 1: gpufail h1/1 at step 2" in line for line in lines)


def _world(wid: str, start: float, restored, position: int, saves=()) -> World:
    return World(wid, ["h0", "h1"], 4, "dp=2,tp=2,pp=1", restored, None, False, {}, position, start, start + 1, 0.1,
                 steps={1: {"loss": 1.0, "ids": [], "time": start + 0.5}}, saves=list(saves))


def test_a_failure_before_the_first_save_is_right_to_start_afresh(tmp_path):
    """A fault before any save (gpufail:h1/1@4 with saves every 5 steps): the next world starts at step 0 and
    position 0, which is right; a world that claims a restore of nothing is not."""
    event, fired = demo.Event("gpufail", "h1/1", 4), {"time": 10.0, "step": 4}
    fresh = [_world("a", 1.0, None, 0), _world("b", 20.0, None, 0)]
    row, exact, resumed_right = _event_row(event, fired, ["h0", "h1"], fresh, tmp_path, [])
    assert (row["resumed_from_step"], exact, resumed_right) == (0, True, True)
    wrong = [_world("a", 1.0, None, 0), _world("b", 20.0, None, 24)]
    assert _event_row(event, fired, ["h0", "h1"], wrong, tmp_path, [])[2] is False


class _Proc:
    def __init__(self, code):
        self.code = code

    def poll(self):
        return self.code


class _Handler:
    def __init__(self, code):
        self.proc = _Proc(code)


class _Context:  # the two attributes of torchrun's SubprocessContext that drop_device_faults reads
    def __init__(self, *codes):
        self.subprocess_handlers = {rank: _Handler(code) for rank, code in enumerate(codes)}
        self._running_local_ranks = set(range(len(codes)))


def test_in_place_a_device_fault_is_taken_off_torchruns_watch_only_while_others_run():
    from tenplex.elastic.faults import EXIT_DEVICE_FAULT, EXIT_PEER_LOST
    from tenplex.elastic.restarts import drop_device_faults

    ctx = _Context(None, EXIT_DEVICE_FAULT, None)
    assert drop_device_faults(ctx) == [1] and ctx._running_local_ranks == {0, 2}
    assert drop_device_faults(ctx) == []  # dropped once
    for codes in [(EXIT_DEVICE_FAULT, EXIT_PEER_LOST), (EXIT_DEVICE_FAULT,), (None, 1), (None, None)]:
        ctx = _Context(*codes)  # nobody left running, or no device fault: torchrun's restart path decides
        assert drop_device_faults(ctx) == [] and ctx._running_local_ranks == set(range(len(codes)))
    assert drop_device_faults(object()) == []


def _sorted_hosts(world: dict) -> dict:
    return {**world, "hosts": sorted(world["hosts"])}
