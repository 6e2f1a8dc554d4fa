"""``tenplex demo --elastic --schedule evict:all@3``: the whole job is lost (every agent, worker and store killed,
every store root deleted) once step 3's snapshot is in the bucket (moto's S3 server on loopback, started by the
demo); a new job on three new nodes, under another configuration, restores it from the bucket and finishes with
the reference's losses, every sample once, the state bit for bit and the data position. One demo run (the CLI,
as a user runs it); the refusals need none."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tenplex.elastic import demo
from tenplex.elastic.timeline import summarize
from tenplex.errors import ConfigError
from tenplex.store import Store

pytest.importorskip("moto")
STEPS = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("evict") / "work"
    proc = subprocess.run([sys.executable, "-m", "tenplex.cli", "demo", "--elastic", "--schedule", "evict:all@3",
                           "--steps", str(STEPS), "--workdir", str(workdir), "--json"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir, json.loads(proc.stdout), proc.stderr


def test_the_new_job_restores_the_newest_durable_save_bit_for_bit(run):
    _, summary, progress = run
    assert summary["ok"], progress[-3000:]
    c = summary["checks"]
    assert c["loss_max_rel_diff"] <= 1e-4
    assert (c["samples_read_twice"], c["samples_skipped"], c["state_bit_exact"], c["position_restored"]) == \
        (0, 0, True, True)
    [evict] = summary["events"]
    assert (evict["kind"], evict["host"], evict["at_step"]) == ("evict", "all", 3)
    assert evict["from"] == {"world": 4, "hosts": ["h0", "h1"], "parallel": "dp=2,tp=2,pp=1"}
    assert evict["to"] == {"world": 6, "hosts": ["h2", "h3", "h4"], "parallel": "dp=1,tp=2,pp=3"}  # pinned
    # The demo evicts once step 3's snapshot (version 3: one per step) is durable: nothing is lost.
    assert evict["durable"] == {"version": 3, "step": 3}
    assert evict["resumed_from_step"] == 3 and evict["lost_steps"] == 0
    assert "every node and store lost; the new job restored durable version 3 (step 3) from the bucket" in progress


def test_no_local_copy_survived_the_eviction(run):
    workdir, _, _ = run
    base = workdir / "elastic"
    for host in ("h0", "h1"):  # deleted with everything in it; only the bucket held version 3
        assert not base.joinpath(host).exists()
    agents = json.loads((base / "agents.json").read_text())["exit_codes"]
    assert agents == {"h0": -9, "h1": -9, "h2": 0, "h3": 0, "h4": 0}
    # Each new store got version 3 from the bucket (the same number) and saved step 4 after it.
    for host in ("h2", "h3", "h4"):
        assert Store(base / host, host).versions()[:2] == [3, 4]


def test_the_check_fails_when_the_new_job_did_not_resume_from_the_durable_save(run):
    workdir, _, _ = run
    events = demo.parse_schedule("evict:all@3", ("h0", "h1"), STEPS)
    fired = json.loads((workdir / "elastic" / "fired.json").read_text())
    fired[0]["durable"]["step"] = 2  # the bucket's newest would have been step 2: resuming at 3 is wrong
    roots = [workdir / "elastic" / h for h in demo.every_host(("h0", "h1"), events)]
    summary, _ = summarize(workdir / "reference" / "record", workdir / "elastic" / "record", events, fired, roots,
                           demo.expected_hosts(("h0", "h1"), events))
    assert summary["checks"]["position_restored"] is False and not summary["ok"]


def test_the_new_job_runs_on_new_nodes_and_later_events_can_name_them():
    events = demo.parse_schedule("join:h2@2,evict:all@3,fail:h3@5,join:h7@6", ("h0", "h1"), 8)
    assert demo.expected_hosts(("h0", "h1"), events) == [["h0", "h1", "h2"], ["h3", "h4", "h5"], ["h4", "h5"],
                                                         ["h4", "h5", "h7"]]
    assert demo.every_host(("h0", "h1"), events) == ["h0", "h1", "h2", "h3", "h4", "h5", "h7"]


@pytest.mark.parametrize("text,links,words", [("evict:h0@3", False, "evict:all@STEP"),
                                              ("evict:all@3", True, "without --link-mbit"),
                                              ("evict:all@3,fail:h0@5", False, "h0 is not running")])
def test_bad_evictions_are_refused(text, links, words):
    with pytest.raises(ConfigError, match=words):
        demo.parse_schedule(text, ("h0", "h1"), 8, links=links)


def test_without_moto_evict_is_refused_in_one_line_before_anything_starts(monkeypatch, capsys, tmp_path):
    from tenplex.cli import main

    monkeypatch.setitem(sys.modules, "moto", None)  # import moto raises ImportError, as where it is not installed
    assert main(["demo", "--elastic", "--schedule", "evict:all@3", "--workdir", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("tenplex demo: error: evict:all needs moto's S3 server for the job's bucket: "
                   "pip install 'moto[server]' (or 'tenplex[test]')")
    assert not (tmp_path / "w").exists()
