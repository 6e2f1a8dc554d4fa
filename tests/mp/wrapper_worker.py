"""One rank of the wrapper-name test: save through one wrapping, restore through another (gloo, 2 ranks).

Usage: ``python wrapper_worker.py SPEC.json`` (tenplex.runtime.launch sets the torch.distributed environment).
For each case of the spec (``save``/``restore`` in bare, ddp, compile, ckpt, compile+ddp, container),
every rank trains a small model wrapped as ``save`` for two steps, saves it with
tenplex into the case's store, builds the same model from another seed wrapped
as ``restore``, restores, and compares every parameter and Adam moment, by bare
name, with what it saved: bit for bit. The result per case (or the
StateMismatchError's message) goes to ``RESULT_DIR/r{rank}.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.nn.parallel import DistributedDataParallel

import tenplex
from tenplex.integration.process_group import init_process_group, leave_process_group


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(6, 8)
        self.block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
        self.norm = torch.nn.LayerNorm(4)

    def forward(self, x):
        return self.norm(self.block(self.embed(x)))


class Container(torch.nn.Module):
    """A user's own module with an attribute called ``module``: not a wrapper, its prefix is a real name."""

    def __init__(self, inner):
        super().__init__()
        self.module = inner

    def forward(self, x):
        return self.module(x)


def build(kind: str, seed: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the module to call and optimize, the bare Net inside it)."""
    torch.manual_seed(seed)
    bare = Net()
    if kind == "bare":
        return bare, bare
    if kind == "ddp":
        return DistributedDataParallel(bare), bare
    if kind == "compile":
        return torch.compile(bare, backend="eager"), bare
    if kind == "ckpt":
        bare.block = checkpoint_wrapper(bare.block)
        return bare, bare
    if kind == "compile+ddp":
        bare.block = checkpoint_wrapper(bare.block)
        return torch.compile(DistributedDataParallel(bare), backend="eager"), bare
    if kind == "container":
        return Container(bare), bare
    raise ValueError(kind)


def bare_state(bare: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    state = {}
    for name, param in bare.named_parameters():
        name = name.replace("_checkpoint_wrapped_module.", "")
        state[name] = param.detach().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            state[f"{key}.{name}"] = optimizer.state[param][key].clone()
    return state


def run_case(case: dict, rank: int) -> dict:
    root = Path(case["root"])
    ckpt = tenplex.Checkpointer(store_root=root / "h0", host="h0", device=f"h0/{rank}", stores={})
    model, bare = build(case["save"], seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    torch.manual_seed(100 + rank)
    for _ in range(2):
        loss = model(torch.randn(5, 6)).square().mean()
        loss.backward()
        if case["save"] in ("bare", "ckpt", "compile", "container"):  # no DDP: average the gradients by hand
            for p in model.parameters():
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        optimizer.step()
        optimizer.zero_grad()
    tenplex.save(model, optimizer, step=2, checkpointer=ckpt)
    saved = bare_state(bare, optimizer)
    names = sorted(n for n in tenplex.Store(root / "h0", "h0").open(1).get_json("layout")["tensors"])

    model2, bare2 = build(case["restore"], seed=2)
    optimizer2 = torch.optim.AdamW(model2.parameters(), lr=0.01)
    try:
        step = tenplex.restore(model2, optimizer2, checkpointer=ckpt)
    except tenplex.StateMismatchError as e:
        return {"error": str(e), "saved_names": names}
    restored = bare_state(bare2, optimizer2)
    different = sorted(k for k in saved if not torch.equal(saved[k], restored[k]))
    return {"step": step, "saved_names": names, "compared": len(saved), "different": different}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    init_process_group("gloo")
    rank = dist.get_rank()
    results = {f"{c['save']}->{c['restore']}": run_case(c, rank) for c in spec["cases"]}
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"r{rank}.json").write_text(json.dumps(results))
    leave_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
