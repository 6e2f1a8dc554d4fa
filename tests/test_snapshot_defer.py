"""Between exchanges a snapshot's copies of what only ``optimizer.step()`` changes are the writer thread's.

The rule (:mod:`tenplex.integration.snapshot_defer`): which pieces are left to the writer thread (the optimizer's
parameters and states on the CPU, never model buffers), when (only with an optimizer whose step runs hooks), and
what guards them (the step pre-hook waits for the copies; a counter that moved makes the snapshot fail and the
snapshotter copy at the boundary from then on). The job (``mp/snapshot_defer_worker.py``): two ranks on two hosts,
real stores and the job's real key-value store, a BatchNorm model and Adam, the writer thread's work held until
the next ``optimizer.step()`` waits for it; every committed version restores bit for bit to its boundary's state.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tenplex.integration.snapshot_defer import DeferredStaging, hooks_steps
from tenplex.integration.snapshot_buffers import SnapshotBuffers
from tenplex.integration.snapshot_pieces import PiecesCache
from tenplex.runtime import launch

WORKER = Path(__file__).parent / "mp" / "snapshot_defer_worker.py"
STEPS, TORN_AT = 7, 4


def bn_model():
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_the_writer_thread_copies_the_optimizers_tensors_and_never_model_buffers():
    model, optimizer = bn_model()
    cache = PiecesCache()
    pieces = cache.pieces(model, optimizer, None)
    now, later = DeferredStaging({}, SnapshotBuffers()).split(pieces, optimizer, cache.generation, pieces)
    assert sorted(p.name for p in now) == ["1.num_batches_tracked", "1.running_mean", "1.running_var"]
    # The 6 parameters and their 2 Adam moments each
    assert len(later) == 18
    assert {p.name for p in later} >= {"0.weight", "optim.exp_avg.0.weight", "optim.exp_avg_sq.2.bias"}
    # A canonical buffer's key stays at the boundary; nothing is left to the thread without a cached structure
    keep = {(later[0].name, later[0].box)}
    staging = DeferredStaging({}, SnapshotBuffers())
    assert later[0] in staging.split(pieces, optimizer, cache.generation, pieces, keep)[0]
    assert staging.split(pieces, optimizer, None, pieces) == (pieces, [])


def test_only_an_optimizer_whose_step_runs_hooks_lets_the_thread_copy():
    model, optimizer = bn_model()

    class OwnStep:  # an optimizer of its own (Megatron's wrappers are such): no step hooks
        param_groups = optimizer.param_groups
        state = optimizer.state

        def step(self):
            optimizer.step()
    assert hooks_steps(optimizer) and not hooks_steps(OwnStep()) and not hooks_steps(None)
    cache = PiecesCache()
    pieces = cache.pieces(model, optimizer, None)
    assert DeferredStaging({}, SnapshotBuffers()).split(pieces, OwnStep(), cache.generation, pieces) == (pieces, [])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("defer")
    out = base / "out"
    out.mkdir()
    (out / "spec.json").write_text(json.dumps({"out": str(out), "steps": STEPS, "torn_at": TORN_AT}))
    roots = {h: base / "stores" / h for h in ("h0", "h1")}
    launch.run_job([sys.executable, str(WORKER), str(out / "spec.json")], ["h0/0", "h1/0"], roots, {}, out / "logs",
                   timeout=240)
    return [json.loads((out / f"result_r{r}.json").read_text()) for r in range(2)]


def test_every_committed_snapshot_restores_its_boundarys_state_bit_for_bit(run):
    for result in run:
        outcomes = result["outcomes"]
        committed = [step for step, o in enumerate(outcomes, start=1) if isinstance(o, int)]
        assert committed == [s for s in range(1, STEPS + 1) if s != TORN_AT], outcomes
        assert [r["step"] for r in result["restored"]] == committed
        # parameters, Adam moments and steps, BatchNorm statistics (changed by the next forward before the copies)
        assert all(r["mismatches"] == [] for r in result["restored"]), result["restored"]
        # The next optimizer.step() came before the held copies: it waited for them
        assert result["stats"]["step_waited_s"] > 0


def test_a_tensor_changed_outside_the_step_fails_that_snapshot_and_ends_the_deferral(run):
    for result in run:
        torn = result["outcomes"][TORN_AT - 1]
        assert isinstance(torn, str) and "changed in place" in torn and "0.weight" in torn, torn
        # From then on everything is copied at the boundary: no buffers of the writer thread's
        assert result["stats"]["deferred_bytes"] == 0 and result["stats"]["failed"] == 1
        # Exchanges: the first snapshot and the one after the failed one
        assert [b["exchanges"] for b in result["boundaries"]] == [1, 1, 1, 1, 2, 2, 2]


def test_close_removes_the_step_hook(run):
    for result in run:
        assert result["hooks_before_close"] == 1 and result["hooks_after_close"] == 0
