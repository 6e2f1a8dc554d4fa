"""Which pieces a snapshot counts as unchanged: the in-place version counters of FSDP2 (DTensor) shards.

A DTensor's in-place ops (the optimizer's step) bump the wrapper's counter, not its local tensor's; a copy
into the local tensor (what a restore does) bumps only the local one. :attr:`Piece.version` holds both, so
either change is seen and a frozen parameter is the only thing left unchanged. One process, a gloo group
of one (FSDP2 on CPU).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from tenplex.integration.layouts import state_pieces


def versions(model, optimizer) -> dict[str, tuple[int, ...] | None]:
    return {p.name: p.version for p in state_pieces(model, optimizer, None)}


def test_an_optimizer_step_and_a_copy_into_a_local_shard_change_the_version_a_frozen_shard_keeps_it(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        model[0].requires_grad_(False)
        fully_shard(model)
        optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.1)

        def step() -> None:
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        step()
        before = versions(model, optimizer)
        assert all(v is not None for v in before.values())
        step()
        after = versions(model, optimizer)
        changed = sorted(name for name in before if before[name] != after[name])
        assert changed == ["1.bias", "1.weight", "optim.exp_avg.1.bias", "optim.exp_avg.1.weight",
                           "optim.exp_avg_sq.1.bias", "optim.exp_avg_sq.1.weight"]
        frozen = next(p for p in state_pieces(model, optimizer, None) if p.name == "0.weight")
        with torch.no_grad():
            frozen.local.copy_(frozen.local)  # as a restore copies into the local shard
        assert versions(model, optimizer)["0.weight"] != after["0.weight"]
    finally:
        dist.destroy_process_group()
