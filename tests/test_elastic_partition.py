"""The elastic demo on an emulated cluster (`tenplex demo --elastic --link-mbit N`): every node (its `tenplex run`
agent, store and workers) in a network namespace of its own, and a partition: h1's link is cut at a step while its
processes keep running. The survivor carries on from the replicated state (h1 held the only copy of its pipeline
stage), with the demo's checks (losses, exactly-once data, bit-exact state, step and position); the cut-off node
ends by itself and nothing it committed after the cut is restored; nothing is left behind. Without namespaces the
demo refuses in one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tenplex.cluster import emulated
from tenplex.elastic import demo
from tenplex.elastic.launcher import alive
from tenplex.elastic.timeline import print_timeline, read_worlds, summarize
from tenplex.errors import ConfigError
from tenplex.replication.copier import REPLICAS_DIR, held_versions

REASON = emulated.unavailable()
linked = pytest.mark.skipif(REASON is not None, reason=f"emulated cluster unavailable: {REASON}")

SCHEDULE = "partition:h1@3"
STEPS = 5
PINS = {4: "tp=2,pp=2"}  # one pipeline stage per node: h1 holds the only copy of its stage, apart from the replicas


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("partition")
    lines: list[str] = []
    summary, _ = demo.run(workdir, SCHEDULE, STEPS, save_every=2, pins=PINS, say=lines.append, link_mbit=1000)
    # Nothing may outlive the demo: no namespace of this process, no store, no process of the job.
    assert [n for n in emulated._namespaces() if n.startswith(f"{emulated.PREFIX}-{os.getpid()}-")] == []
    for host in ("h0", "h1"):
        pid = int((workdir / "elastic" / host / ".tenplex-store.pid").read_text())
        assert not alive(pid), f"store of {host} still runs"
    return workdir, summary, lines


@linked
def test_the_survivor_carries_on_with_the_demos_checks(run):
    _, summary, lines = run
    assert summary["ok"], "\n".join(lines[-30:])
    c = summary["checks"]
    assert c["loss_max_rel_diff"] <= 1e-4
    assert (c["samples_read_twice"], c["samples_skipped"], c["state_bit_exact"], c["position_restored"],
            c["cut_off_saves_restored"]) == (0, 0, True, True, 0)
    (e,) = summary["events"]
    assert (e["kind"], e["host"], e["at_step"]) == ("partition", "h1", 3)
    assert e["from"] == {"world": 4, "hosts": ["h0", "h1"], "parallel": "dp=1,tp=2,pp=2"}
    assert e["to"] == {"world": 2, "hosts": ["h0"], "parallel": "dp=1,tp=2,pp=1"}
    # The periodic save at step 2 is the newest; step 3 was trained when the link went down, and is replayed.
    assert (e["resumed_from_step"], e["lost_steps"]) == (2, 1)
    assert "event 1: partition h1 at step 3" in "\n".join(lines)


@linked
def test_the_state_of_the_cut_off_stage_came_from_its_copies(run):
    workdir, summary, _ = run
    h0 = workdir / "elastic" / "h0"
    (e,) = summary["events"]
    (restored,) = e["cut_off"]["restored_after_cut"]
    # h0 holds committed copies of h1's regions of the restored version: the only source of h1's stage once h1 was
    # cut off (the restored full state equals the saved one bit for bit: state_bit_exact above).
    assert restored in held_versions(h0, "h0")["h1"]
    copied = sum(shard["nbytes"] for m in (h0 / REPLICAS_DIR / "h1").glob("versions/*/manifest.json")
                 for shard in json.loads(m.read_text())["shards"])
    # What crossed the links, from the kernel's counters: at least the copies' bytes that h1 sent to h0.
    hosts = summary["links"]["hosts"]
    assert set(hosts) == {"ctl", "h0", "h1"} and summary["links"]["mbit"] == 1000
    assert 0 < copied <= min(hosts["h1"]["out"], hosts["h0"]["in"])


@linked
def test_the_cut_off_node_ends_by_itself_and_commits_nothing_restored(run):
    workdir, summary, _ = run
    (e,) = summary["events"]
    assert e["cut_off"]["commits_after_cut"] == [] and e["cut_off"]["restored_from_cut_off"] == []
    cut = json.loads((workdir / "elastic" / "fired.json").read_text())[0]["time"]
    agents = json.loads((workdir / "elastic" / "agents.json").read_text())
    # The demo waited for every agent to exit by itself: h1's gave up its rendezvous (it cannot reach the store).
    assert agents["partitioned"] == ["h1"] and agents["exit_codes"]["h0"] == 0
    assert agents["exit_codes"]["h1"] not in (None, 0, -9)
    # Every rank of the old world, on either side of the cut, gave up on its peers across it (no reset arrives: the
    # connections time out) and exited with an error, h1's own ranks included.
    (old,) = [w for w in read_worlds(workdir / "elastic" / "record") if w.start < cut]
    exits = [(old.file_hosts[x["file"]], x["code"]) for x in old.exits if x["time"] > cut]
    assert sorted(h for h, _ in exits) == ["h0", "h0", "h1", "h1"] and all(code != 0 for _, code in exits)

    printed: list[str] = []
    print_timeline(summary, printed.append)
    text = "\n".join(printed)
    assert "h1 committed nothing after it" in text and "of them from h1 after the cut: none" in text
    assert "links (1000 Mbit/s each way; kernel counters): ctl out" in text


@linked
def test_the_check_catches_a_restored_save_of_the_cut_off_node(run, tmp_path):
    """Doctored: h1's store says it committed the restored version after the cut; the check must fail."""
    workdir, summary, _ = run
    events = demo.parse_schedule(SCHEDULE, ("h0", "h1"), STEPS, links=True)
    fired = json.loads((workdir / "elastic" / "fired.json").read_text())
    (restored,) = summary["events"][0]["cut_off"]["restored_after_cut"]
    h1 = tmp_path / "h1"
    shutil.copytree(workdir / "elastic" / "h1" / "versions", h1 / "versions")
    late = fired[0]["time"] + 1
    os.utime(h1 / "versions" / str(restored) / "manifest.json", (late, late))
    doctored = summarize(workdir / "reference" / "record", workdir / "elastic" / "record", events, fired,
                         [workdir / "elastic" / "h0", h1], demo.expected_hosts(("h0", "h1"), events))[0]
    assert doctored["checks"]["cut_off_saves_restored"] == 1 and doctored["ok"] is False
    assert doctored["events"][0]["cut_off"]["restored_from_cut_off"] == [restored]


def test_partitions_need_links_and_a_cut_off_host_does_not_rejoin():
    with pytest.raises(ConfigError, match="--link-mbit"):
        demo.parse_schedule(SCHEDULE, ("h0", "h1"), STEPS)
    with pytest.raises(ConfigError, match="cut off"):
        demo.parse_schedule("partition:h1@2,join:h1@3", ("h0", "h1"), STEPS, links=True)
    assert demo.expected_hosts(("h0", "h1"), demo.parse_schedule(SCHEDULE, ("h0", "h1"), STEPS, links=True)) \
        == [["h0"]]


def test_without_namespaces_the_demo_refuses_in_one_line(tmp_path):
    """No `ip` on PATH: one line naming the cause, exit 2, nothing started (no loopback fallback)."""
    proc = subprocess.run([sys.executable, "-m", "tenplex.cli", "demo", "--elastic", "--link-mbit", "100",
                           "--workdir", str(tmp_path / "w")], capture_output=True, text=True,
                          env={**os.environ, "PATH": "/nonexistent"}, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "--link-mbit" in proc.stderr and ("iproute2" in proc.stderr or "root" in proc.stderr)
    assert not (tmp_path / "w").exists()
