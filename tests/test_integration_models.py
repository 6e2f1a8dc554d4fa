"""Models and optimizers that commonly break checkpointing, saved and restored through real stores (gloo).

Issue 32. One save job (2 ranks on hosts h0, h1) saves five cases: DDP with AdamW, SGD (Nesterov),
Adafactor and an optimizer with a [C, C] state, and FSDP2 with AdamW. The model has BatchNorm without
SyncBatchNorm (each replica's running statistics differ), a frozen layer and a parameter that gets no
gradient. The ground truth is DCP's full state (``get_model_state_dict``/``get_optimizer_state_dict``)
on data-parallel rank 0 before the save:

* DDP, restored on the same two hosts with the ranks swapped (rank 0 now on h1): bit for bit, and the next
  losses and the eval loss after them equal the uninterrupted run's;
* DDP, restored into one bare model on h1: bit for bit;
* FSDP2 dp=2 -> dp=3 on a new host h2: every rank bit for bit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from mp.models_worker import Preconditioned
from store_helpers import StoreProcess
from tenplex.box import Box
from tenplex.errors import LayoutError
from tenplex.integration.annotate import Annotation
from tenplex.integration.pieces import optimizer_pieces, optimizer_scalars
from tenplex.runtime.launch import run_spec_job

WORKER = Path(__file__).parent / "mp" / "models_worker.py"
DDP_CASES = [{"name": f"ddp-{o}", "optim": o, "wrap": "ddp"} for o in ("adamw", "sgd", "adafactor", "precond")]
FSDP_CASE = {"name": "fsdp-adamw", "optim": "adamw", "wrap": "fsdp"}
WITHOUT_STATE = {"hidden.bias", "hidden.weight", "unused.bias", "unused.weight"}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    base = tmp_path_factory.mktemp("models")
    stores = {h: StoreProcess(base / "stores" / h, h) for h in ("h0", "h1", "h2")}
    roots = {h: p.root for h, p in stores.items()}
    addresses = {h: p.address for h, p in stores.items()}

    def job(name: str, devices: list[str], spec: dict) -> list[dict]:
        out = base / name
        run_spec_job([sys.executable, str(WORKER)], {**spec, "out": str(out), "stores": addresses},
                     base / f"{name}.json", devices, roots, {}, base / "logs" / name, timeout=300)
        return [json.loads((out / f"r{r}.json").read_text()) for r in range(len(devices))]

    try:
        saved = job("save", ["h0/0", "h1/0"], {"phase": "save", "cases": DDP_CASES + [FSDP_CASE]})
        truth = str(base / "save")

        def at(cases):  # the cases that could be saved, with their versions
            return [{**c, "version": saved[0][c["name"]]["version"]} for c in cases
                    if "error" not in saved[0][c["name"]]]
        swapped = job("swapped", ["h1/0", "h0/0"], {"phase": "restore", "cases": at(DDP_CASES), "truth": truth,
                                                     "continue": True})
        alone = job("alone", ["h1/0"], {"phase": "restore", "cases": at([{**c, "wrap": "bare"} for c in DDP_CASES]),
                                         "truth": truth})
        wider = job("wider", ["h0/0", "h1/0", "h2/0"], {"phase": "restore", "cases": at([FSDP_CASE]),
                                                          "truth": truth})
        yield {"saved": saved, "swapped": swapped, "alone": alone, "wider": wider}
    finally:
        for p in stores.values():
            p.stop()


def _restored(result: dict | None) -> dict:
    assert result is not None, "the case was not saved"
    assert "error" not in result, result["error"]
    assert result["step"] == 3
    return result


def test_the_saving_job_has_replicas_that_differ_and_parameters_without_state(jobs):
    for case in DDP_CASES + [FSDP_CASE]:
        r0, r1 = (ranks[case["name"]] for ranks in jobs["saved"])
        assert "error" not in r0, r0["error"]
        assert r0["eval"] != r1["eval"]  # each replica's BatchNorm statistics are its own
        assert set(r0["no_state"]) == WITHOUT_STATE


@pytest.mark.parametrize("case", [c["name"] for c in DDP_CASES])
def test_ddp_on_swapped_hosts_restores_rank_0s_state_and_continues_as_if_uninterrupted(jobs, case):
    saved = [ranks[case] for ranks in jobs["saved"]]
    for rank, ranks in enumerate(jobs["swapped"]):
        result = _restored(ranks.get(case))
        assert result["different"] == []  # model (BatchNorm statistics included) and optimizer, bit for bit
        assert result["eval"] == saved[0]["eval"]
        assert result["losses"] == saved[rank]["losses"]
        assert set(result["no_state"]) == WITHOUT_STATE
    assert jobs["swapped"][0][case]["eval_after"] == saved[0]["eval_after"]  # the statistics that count


@pytest.mark.parametrize("case", [c["name"] for c in DDP_CASES])
def test_ddp_into_one_replica_on_the_other_host_restores_rank_0s_state(jobs, case):
    result = _restored(jobs["alone"][0].get(case))
    assert result["different"] == []
    assert result["eval"] == jobs["saved"][0][case]["eval"]
    assert set(result["no_state"]) == WITHOUT_STATE


def test_fsdp2_onto_a_new_host_gives_every_rank_rank_0s_state(jobs):
    for ranks in jobs["wider"]:
        result = _restored(ranks.get(FSDP_CASE["name"]))
        assert result["different"] == []
        assert result["eval"] == jobs["saved"][0][FSDP_CASE["name"]]["eval"]


# ----------------------------------------------------------------- single process: where each state goes
def _stepped(optimizer_class, local_shape=(4, 6)):
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.randn(local_shape))
    optimizer = optimizer_class(model.parameters())
    model.w.grad = torch.randn(local_shape)
    optimizer.step()
    return model, optimizer


def test_a_factored_moment_is_split_like_its_parameter_along_the_dimensions_it_keeps():
    model, optimizer = _stepped(torch.optim.Adafactor)
    whole = {p.name: (p.spec.shape, p.box) for p in optimizer_pieces(model, optimizer)}
    assert whole == {"optim.row_var.w": ((4, 1), Box((0, 0), (4, 1))),
                     "optim.col_var.w": ((1, 6), Box((0, 0), (1, 6)))}
    assert optimizer_scalars(model, optimizer) == {"w": {"step": 1.0}}
    by_rows = {"w": Annotation((12, 6), (4, 0))}  # rows 4..8 of 12: each row's moment is whole here
    model.w.grad = torch.randn(4, 6)
    with pytest.raises(LayoutError, match=r"^Adafactor's state 'col_var' of 'w' \(shape \[1, 6\]\) is averaged "
                                          r"over dimension 0 of the parameter, which this rank holds only in part"):
        optimizer_pieces(model, optimizer, by_rows)
    by_columns = {"w": Annotation((4, 18), (0, 6))}
    with pytest.raises(LayoutError, match="'row_var' of 'w'.* averaged over dimension 1"):
        optimizer_pieces(model, optimizer, by_columns)
    del optimizer.state[model.w]["col_var"]  # the row moment alone is placed along the rows
    assert [(p.spec.shape, p.box) for p in optimizer_pieces(model, optimizer, by_rows)] == [
        ((12, 1), Box((4, 0), (4, 1)))]


def test_a_state_of_its_own_shape_is_saved_whole_and_refused_on_a_part_of_its_parameter():
    model, optimizer = _stepped(Preconditioned)
    assert [(p.name, p.spec.shape, p.box) for p in optimizer_pieces(model, optimizer)] == [
        ("optim.precond.w", (6, 6), Box((0, 0), (6, 6)))]
    with pytest.raises(LayoutError) as e:
        optimizer_pieces(model, optimizer, {"w": Annotation((8, 6), (4, 0))})
    assert str(e.value) == ("Preconditioned's state 'precond' of 'w' (shape [6, 6]) is neither shaped like its "
                            "parameter [4, 6] nor a factored moment of it, so tenplex saves and restores it only "
                            "whole, on ranks that hold the whole parameter; this rank holds [4:8, 0:6] of [8, 6]")


def test_buffers_come_from_the_lowest_holding_rank_to_writers_on_other_hosts_only():
    from tenplex.integration.canonical import canonical_sends
    from tenplex.integration.layouts import first_holder_per_host

    whole, half = [[0], [16]], [[0], [8]]
    docs = [{"host": h, "buffers": ["bn.running_mean"],
             "boxes": [["bn.running_mean", *whole], ["w", *whole], ["stage1.bn.running_mean", *half]][:2 + (r > 0)]}
            for r, h in enumerate(["h0", "h0", "h1", "h2"])]
    docs[2]["buffers"] = docs[3]["buffers"] = ["bn.running_mean", "stage1.bn.running_mean"]
    sends = canonical_sends(docs, first_holder_per_host(docs))
    # bn.running_mean: rank 0's values for h1 and h2 (h0 writes rank 0's own). A parameter (w) is never sent;
    # stage1's buffer goes from rank 1 (its lowest holder) to h1 and h2.
    assert sends == [(0, "bn.running_mean", Box((0,), (16,))), (1, "stage1.bn.running_mean", Box((0,), (8,)))]
    assert canonical_sends(docs[:2], first_holder_per_host(docs[:2])) == []  # one host: one copy, rank 0's


@pytest.mark.parametrize("optimizer_class", [torch.optim.AdamW, torch.optim.SGD])
def test_restore_creates_state_only_for_the_parameters_saved_with_state(optimizer_class):
    from tenplex.integration.pieces import init_optimizer_state

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    model[0].requires_grad_(False)
    optimizer = optimizer_class(model.parameters(), lr=0.1, **({"momentum": 0.9} if optimizer_class is torch.optim.SGD
                                                               else {}))
    optimizer.state[model[0].weight]["stale"] = torch.ones(1)  # state the saved optimizer did not have goes
    grad = torch.full((2,), 3.0)
    model[1].bias.grad = grad
    before = [p.detach().clone() for p in model.parameters()]
    init_optimizer_state(optimizer, {"1.weight", "1.bias"}, model)
    assert set(optimizer.state) == {model[1].weight, model[1].bias}
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing was updated
    assert model[1].bias.grad is grad and model[1].weight.grad is None and model[0].weight.grad is None
