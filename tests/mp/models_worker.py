"""One rank of the model-feature test: BatchNorm replicas that differ, frozen and unused parameters,
optimizer state not shaped like its parameter (gloo; see ``tests/test_integration_models.py``).

Usage: ``python models_worker.py SPEC.json`` under ``tenplex.runtime.launch.run_job``. Each case of
``spec["cases"]`` names an optimizer (adamw, sgd, adafactor, precond) and a wrapper (ddp, fsdp, bare). Phase
``save``: train 3 steps, take the ground truth (DCP's full model and optimizer state dicts, and the eval
loss, on rank 0), save, then train 2 more steps (the uninterrupted run). Phase ``restore``: build the
model from another seed, restore ``version``, compare DCP's full state dicts with the ground truth bit
for bit, then (``continue``) train the same 2 steps. Every rank writes ``r{rank}.json`` (and rank 0 of
``save`` the truth as safetensors) under ``spec["out"]``. Nothing is pickled.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import tenplex
from tenplex.integration.process_group import init_process_group, leave_process_group


class Net(torch.nn.Module):
    """BatchNorm whose statistics each replica updates alone; a frozen layer; a parameter that gets no gradient."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(6, 16)
        self.b1 = torch.nn.BatchNorm1d(16)
        self.hidden = torch.nn.Linear(16, 16).requires_grad_(False)  # frozen: fine-tuning the others
        self.b2 = torch.nn.BatchNorm1d(16)
        self.out = torch.nn.Linear(16, 3)
        self.unused = torch.nn.Linear(4, 4)  # never called

    def forward(self, x):
        return self.out(torch.relu(self.b2(self.hidden(torch.relu(self.b1(self.inp(x)))))))


class Preconditioned(torch.optim.Optimizer):
    """A state of its own shape ([C, C] for a [R, C] weight, like Shampoo's): saved whole by replicas."""

    def __init__(self, params, lr: float = 0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    g = p.grad.reshape(-1, p.shape[-1])
                    state.setdefault("precond", torch.zeros(p.shape[-1], p.shape[-1])).add_(g.T @ g)
                    p.sub_(group["lr"] * p.grad)


def build(case: dict, seed: int):
    torch.manual_seed(seed)
    net = Net()
    if case["wrap"] == "ddp":
        model = DistributedDataParallel(net, find_unused_parameters=True)
    elif case["wrap"] == "fsdp":
        fully_shard(net)
        model = net
    else:
        model = net
    optimizer = {"adamw": lambda p: torch.optim.AdamW(p, lr=0.01),
                 "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
                 "adafactor": lambda p: torch.optim.Adafactor(p, lr=0.01),
                 "precond": lambda p: Preconditioned(p, lr=0.01)}[case["optim"]](model.parameters())
    return model, optimizer


def batch(seed: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 6, generator=g) * 3 + 1, torch.randint(0, 3, (rows,), generator=g)


def train(model, optimizer, steps: range, rank: int) -> list[float]:
    losses = []
    for step in steps:
        x, y = batch(1000 * step + rank)  # each rank its own batches: its own BatchNorm statistics
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def eval_loss(model) -> float:
    model = getattr(model, "module", model)  # not through DDP: its forward would overwrite rank 1's statistics
    model.eval()
    with torch.no_grad():
        x, y = batch(7, rows=32)
        loss = torch.nn.functional.cross_entropy(model(x), y).item()
    model.train()
    return loss


def full_state(model, optimizer) -> dict[str, torch.Tensor]:
    """DCP's full model and optimizer state dicts, flat: ``model.NAME`` and ``optim.NAME.KEY``."""
    options = StateDictOptions(full_state_dict=True)
    flat = {f"model.{k}": v.detach().clone() for k, v in get_model_state_dict(model, options=options).items()}
    for name, state in get_optimizer_state_dict(model, optimizer, options=options)["state"].items():
        for key, value in state.items():
            value = value.detach().clone() if isinstance(value, torch.Tensor) else torch.tensor(value)
            flat[f"optim.{name}.{key}"] = value
    return flat


def without_state(model, optimizer) -> list[str]:
    """Parameters the optimizer holds no state for (before an eval forward: FSDP2 leaves the root unsharded)."""
    return sorted(n.removeprefix("module.") for n, p in model.named_parameters() if p not in optimizer.state)


def differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    keys = sorted(set(a) | set(b))
    return [k for k in keys if k not in a or k not in b or a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
            or not torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))]


def run_case(case: dict, spec: dict, rank: int, out: Path) -> dict:
    ckpt = tenplex.Checkpointer(replicas=0, keep=50)
    if spec["phase"] == "save":
        model, optimizer = build(case, seed=1)
        train(model, optimizer, range(3), rank)
        no_state = without_state(model, optimizer)
        truth = full_state(model, optimizer)
        loss = eval_loss(model)
        if rank == 0:
            save_file(truth, str(out / f"truth_{case['name']}.safetensors"))
        try:
            version = tenplex.save(model, optimizer, step=3, checkpointer=ckpt)
        except Exception as e:  # noqa: BLE001 - the test reports the error; the other cases go on
            return {"error": f"{type(e).__name__}: {e}"}
        after = train(model, optimizer, range(3, 5), rank)
        return {"version": version, "eval": loss, "losses": after, "eval_after": eval_loss(model),
                "no_state": no_state}
    model, optimizer = build(case, seed=2)
    try:
        step = tenplex.restore(model, optimizer, checkpointer=ckpt, version=case["version"])
    except Exception as e:  # noqa: BLE001 - the test reports the error
        return {"error": f"{type(e).__name__}: {e}"}
    truth = load_file(str(Path(spec["truth"]) / f"truth_{case['name']}.safetensors"))
    result = {"step": step, "no_state": without_state(model, optimizer)}
    result.update(different=differences(truth, full_state(model, optimizer)), eval=eval_loss(model))
    if spec.get("continue"):
        result.update(losses=train(model, optimizer, range(3, 5), rank), eval_after=eval_loss(model))
    return result


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    init_process_group("gloo")
    rank = dist.get_rank()
    os.environ["TENPLEX_STORE_ADDRESS"] = spec["stores"][os.environ["TENPLEX_HOST"]]
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    results = {case["name"]: run_case(case, spec, rank, out) for case in spec["cases"]}
    (out / f"r{rank}.json").write_text(json.dumps(results))
    leave_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
