"""The demo's pause accounting (tenplex.elastic.timeline._pause): the demo's own state dumps are told apart from a
change's pause, taken off the part they fell in, and the parts still add up to the pause. No processes."""

from __future__ import annotations

import pytest

from tenplex.elastic.timeline import World, _pause


def _world(start: float, ready: float, restore_s: float, steps: dict[int, float], files: int) -> World:
    w = World("w", ["h0"], files, "dp=1,tp=1,pp=1", None, None, False, {}, 0, start, ready, restore_s)
    w.files = {f"rank-{i}": {"dp": 0, "tp": i, "pp": 0} for i in range(files)}
    w.steps = {s: {"loss": 0.0, "ids": [], "time": t} for s, t in steps.items()}
    return w


def test_the_demos_dumps_come_off_the_parts_they_fell_in_and_the_pause():
    old = _world(0.0, 1.0, 0.1, {4: 10.0}, files=2)
    old.ends = [{"time": 11.0}]  # the stopping save (10.0-10.6), then its dump (10.6-11.0)
    old.dumps = {"saved-4": [(10.6, 11.0), (10.65, 11.0)]}          # shortest: 0.35 s, from the later entry
    new = _world(11.1, 12.5, 0.8, {5: 14.0}, files=3)               # re-form 11.0-11.7, restore 11.7-12.5
    new.dumps = {"restored-4": [(12.5, 12.9), (12.6, 12.9), (12.55, 13.0)],  # shortest 0.3 s from 12.6
                 "saved-5": [(14.5, 14.8)] * 3,                      # after the first step: outside the pause
                 "restored-9": [(12.5, 12.6)] * 2}                   # not every rank made it: not counted
    row = _pause("join", 9.0, [old], new)
    assert row["checks_s"] == pytest.approx(0.35 + 0.3)
    assert row["pause_s"] == pytest.approx(4.0 - 0.65)
    assert row["pause"] == pytest.approx({"detect_s": 0.0, "agree_s": 1.0 - 0.35, "re_form_s": 0.7,
                                          "restore_s": 0.8, "first_step_s": 1.5 - 0.3})
    assert sum(row["pause"].values()) == pytest.approx(row["pause_s"], abs=0.01)


def test_without_dump_records_the_pause_is_the_whole_window():
    old = _world(0.0, 1.0, 0.1, {4: 10.0}, files=1)
    new = _world(11.1, 12.5, 0.8, {5: 14.0}, files=1)
    row = _pause("fail", 10.5, [old], new)  # a failure after the last step: the pause starts at the event
    assert row["checks_s"] == 0.0 and row["pause_s"] == pytest.approx(3.5)
    assert row["pause"]["detect_s"] == pytest.approx(0.6) and row["pause"]["agree_s"] == 0.0


def test_the_demos_temporary_work_directory_goes_to_memory_where_there_is_some(tmp_path):
    from tenplex.cli.demo import memory_dir

    assert memory_dir(str(tmp_path)) == str(tmp_path)     # a writable folder (/dev/shm on Linux)
    assert memory_dir(str(tmp_path / "missing")) is None  # none: the system's temporary folder


def test_a_failed_demo_keeps_its_temporary_work_directory_and_says_where(tmp_path):
    # The error of a failed run names the agents' logs in the work directory: it must still be there.
    import argparse

    from tenplex.cli.demo import _clean_up

    said: list[str] = []
    for finished, keep, stays in [(True, False, False), (False, False, True), (True, True, True)]:
        work = tmp_path / f"w-{finished}-{keep}"
        work.mkdir()
        _clean_up(argparse.Namespace(workdir=None, keep=keep), work, finished, said.append, tell=True)
        assert work.exists() == stays
    assert said == [f"kept {tmp_path / 'w-False-False'} (the run failed: its logs are there; remove it when done)",
                    f"kept {tmp_path / 'w-True-True'}"]
    given = tmp_path / "given"
    given.mkdir()
    _clean_up(argparse.Namespace(workdir=given, keep=False), given, True, said.append)
    assert given.exists() and len(said) == 2  # a --workdir of the user's is never removed
