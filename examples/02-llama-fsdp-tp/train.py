"""Train a Hugging Face Llama under FSDP2 or tensor parallelism, and carry its state across a change between them.

The model is built from a config (no download). Run it with ``tenplex run``, which starts the node's store and
tells tenplex where it is (see README.md in this folder)::

    tenplex run --host h0 --store-root /tmp/llama/h0 --standalone --nproc-per-node 2 \\
        train.py --parallel fsdp --steps 3
    tenplex run --host h0 --store-root /tmp/llama/h0 --standalone --nproc-per-node 2 \\
        train.py --parallel tp --steps 6          # restores step 3 under tp=2 and goes on

Every run first restores the newest saved state (``tenplex.restore``; a fresh store: nothing to restore) and saves
at its last step (``tenplex.save``). The batches are a pure function of the step, so a run that stops and resumes
under the other parallelism trains on the same data as one that never stopped.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from transformers import LlamaConfig, LlamaForCausalLM

import tenplex

CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
GLOBAL_BATCH, SEQ = 4, 16

# Megatron-style tensor parallelism of each decoder layer: q/k/v and gate/up split by output features (heads),
# o and down by input features; embeddings, norms and the LM head stay replicated.
LAYER_PLAN = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
              "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
              "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}


def build(parallel: str, mesh: DeviceMesh, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    if parallel == "fsdp":
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        for layer in model.model.layers:
            parallelize_module(layer, mesh, LAYER_PLAN)
    return model


def batch(step: int, parallel: str) -> torch.Tensor:
    """This rank's tokens at ``step``: the whole global batch under tp, its data-parallel share under FSDP."""
    tokens = torch.randint(0, CONFIG["vocab_size"], (GLOBAL_BATCH, SEQ + 1),
                           generator=torch.Generator().manual_seed(step))
    if parallel == "tp":
        return tokens
    share = GLOBAL_BATCH // dist.get_world_size()
    return tokens[dist.get_rank() * share:(dist.get_rank() + 1) * share]


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = build(args.parallel, mesh, args.init_seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = tenplex.restore(model, optimizer) or 0
    if dist.get_rank() == 0:
        print(f"{args.parallel} on {dist.get_world_size()} ranks: "
              f"{'fresh start' if step == 0 else f'restored step {step}'}", flush=True)
    if args.dump:
        dump(model, optimizer, args.dump / f"restored_step{step}.safetensors")
    losses = []
    while step < args.steps:
        tokens = batch(step, args.parallel)
        loss = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if args.parallel == "fsdp":  # each rank's loss is over its share: the global batch's is their mean
            dist.all_reduce(loss := loss.detach(), op=dist.ReduceOp.AVG)
        step += 1
        losses.append(loss.item())
        if dist.get_rank() == 0:
            print(f"step {step:3d}  loss {loss.item():.6f}", flush=True)
    tenplex.save(model, optimizer, step=step)
    if args.dump:
        dump(model, optimizer, args.dump / f"saved_step{step}.safetensors")
        if dist.get_rank() == 0:
            (args.dump / f"losses_{args.parallel}_to{step}.json").write_text(json.dumps(losses))


def dump(model, optimizer, path: Path) -> None:
    """The full (unsharded) model and optimizer state, gathered by PyTorch Distributed Checkpoint, as the ground
    truth the test compares across the change (rank 0 writes it)."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True)
    state = {f"model.{k}": v for k, v in get_model_state_dict(model, options=options).items()}
    for name, moments in get_optimizer_state_dict(model, optimizer, options=options)["state"].items():
        state.update({f"optim.{key}.{name}": value for key, value in moments.items() if value.dim() > 0})
    if dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in state.items()}, str(path))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parallel", choices=["fsdp", "tp"], required=True, help="FSDP2 over all ranks, or tp over all")
    p.add_argument("--steps", type=int, default=6, help="train until this step, then save")
    p.add_argument("--init-seed", type=int, default=0, help="seed of the initial weights of a fresh start")
    p.add_argument("--dump", type=Path, help="directory for the full state after restore and at the save (tests)")
    return p.parse_args()


if __name__ == "__main__":
    main()
