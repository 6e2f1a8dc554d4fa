"""A tiny GPT and the PyTorch-native ways to parallelize it: dp, FSDP2, tp (DTensor), pp (pipelining).

May import: torch, torch.distributed, ``tenplex.gpt`` and ``tenplex.ptc`` (the
partition rules it agrees with), ``tenplex.models.config``, ``tenplex.errors``
and the standard library.

Used by ``examples/01-gpt-train``, ``tenplex demo``, ``tenplex bench restore``
and the tests. Its state-dict names and shapes are those of the built-in GPT
rules (:func:`tenplex.gpt.gpt` with ``max_seq=seq``, biases, untied head;
:func:`rules` builds them), so a layout made from the rules names this model's
tensors.

The ranks that train (every rank, or the group a :class:`tenplex.elastic.Job` gives them when its policy
leaves ranks idle) form a (pp, dp, tp) mesh, tp varying fastest (so tp groups share a host).
Every rank builds the whole model from the same seed first, so that every
configuration starts from identical weights, then:

* **tp**: ``parallelize_module`` shards the attention output projection
  (row-wise), the MLP and the LM head (column-wise over the vocabulary, which
  is odd on purpose: uneven shards) as DTensors. The fused ``attn.qkv`` keeps
  the rules' global order (q | k | v blocks) as a row-wise DTensor shard; a
  contiguous shard of it does not hold whole heads, so each forward gathers the
  weight (as FSDP does) and computes this rank's heads;
* **pp**: each stage keeps only its layers (``layers`` is a ModuleDict keyed
  by the global layer index, so parameter names stay global) and runs under
  ``torch.distributed.pipelining`` (GPipe);
* **dp**: gradients are averaged over the dp group after backward, or, with
  ``fsdp=True``, every block and the root are ``fully_shard``-ed over dp
  (FSDP2; dims that dp does not divide give uneven shards).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..errors import ConfigError
from ..gpt import gpt
from ..ptc import PTC
from .config import GPTConfig, Parallel


def rules(cfg: GPTConfig, optimizer: str | None = "adam") -> PTC:
    """The partition rules of this model (with AdamW's moments): the same names and shapes as its state."""
    return gpt(cfg.layers, cfg.hidden, cfg.heads, cfg.vocab, cfg.ffn, optimizer=optimizer, max_seq=cfg.seq)


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; backward sums the input's gradient over the tp group (each rank saw only its heads)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.hidden, self.head_dim = cfg.hidden, cfg.hidden // cfg.heads
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)  # rows: q | k | v blocks, as the rules fuse them
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)

    def _qkv_weights(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input, weight, bias) for this rank's heads: all of them unless qkv is a tp-sharded DTensor."""
        from torch.distributed.tensor import DTensor, Partial, Replicate

        weight, bias = self.qkv.weight, self.qkv.bias
        if not (isinstance(weight, DTensor) and isinstance(bias, DTensor)):
            return x, weight, bias
        mesh = weight.device_mesh
        tp, rank = mesh.size(), mesh.get_local_rank()
        width = self.hidden // tp  # this rank's heads * head_dim, in each of the q, k and v blocks
        rows = torch.cat([torch.arange(b * self.hidden + rank * width, b * self.hidden + (rank + 1) * width)
                          for b in range(3)])
        # Gathered with a Partial gradient: each rank's gradient covers its heads' rows, the reduce-scatter sums them.
        full_weight, full_bias = (p.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])
                                  for p in (weight, bias))
        return _CopyToTensorParallel.apply(x, mesh.get_group()), full_weight[rows], full_bias[rows]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        x, weight, bias = self._qkv_weights(x)
        # (b, t, 3 * local heads * head_dim) -> 3 x (b, local heads, t, head_dim); under tp a rank has heads/tp heads.
        q, k, v = F.linear(x, weight, bias).view(b, t, 3, -1, self.head_dim).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden, cfg.ffn)
        self.fc2 = nn.Linear(cfg.ffn, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token + position embeddings, ``layers`` blocks, final norm, LM head. Stages set missing parts to None."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        # Pipeline stages set the parts they do not hold to None.
        self.embed: nn.Embedding | None = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos_embed: nn.Embedding | None = nn.Embedding(cfg.seq, cfg.hidden)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.layers)})
        self.norm: nn.LayerNorm | None = nn.LayerNorm(cfg.hidden)
        self.head: nn.Linear | None = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def blocks(self) -> list[Block]:
        """The transformer blocks this stage holds, in layer order."""
        return [block for block in self.layers.values() if isinstance(block, Block)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None and self.pos_embed is not None:  # first stage: ids (b, t) -> hidden (b, t, h)
            x = self.embed(x) + self.pos_embed(torch.arange(x.shape[1], device=x.device))
        for block in self.layers.values():
            x = block(x)
        if self.head is not None and self.norm is not None:  # last stage: hidden -> logits (b, t, vocab)
            x = self.head(self.norm(x))
        return x


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batch(cfg: GPTConfig, step: int, global_batch: int, seed: int = 1234) -> torch.Tensor:
    """The global batch of ``step``: (global_batch, seq + 1) token ids, the same under every configuration."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, cfg.vocab, (global_batch, cfg.seq + 1), generator=gen)


def stage_layers(cfg: GPTConfig, pp: int, stage: int) -> range:
    base, extra = divmod(cfg.layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


class Trainer:
    """One rank of the parallel job: its model part, optimizer, scheduler and the training step."""

    def __init__(self, cfg: GPTConfig, par: Parallel, global_batch: int, lr: float = 1e-2, seed: int = 0,
                 device: str = "cpu", group=None):
        """``group``: the process group of the ranks that train (``tenplex.elastic.Job.group`` when the policy
        leaves ranks idle); None, the default group: every rank trains. Only its ranks build a Trainer."""
        from torch.distributed.device_mesh import DeviceMesh

        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        if len(ranks) != par.world:
            raise ConfigError(f"{par} needs {par.world} ranks, the job has {len(ranks)} that train")
        if global_batch % (par.dp * par.microbatches):
            raise ConfigError(f"global batch {global_batch} must divide by dp*microbatches = "
                              f"{par.dp}*{par.microbatches}")
        if cfg.heads % par.tp:
            raise ConfigError(f"tp={par.tp} must divide the {cfg.heads} attention heads (each rank computes whole "
                              f"heads)")
        self.cfg, self.par, self.global_batch, self.device = cfg, par, global_batch, torch.device(device)
        self.group = group
        # The mesh over the training ranks only (init_device_mesh would take every rank of the default group): its
        # subgroups are made by these ranks alone (torch names them by a per-process count, which stays the same
        # on every rank that makes the same groups; an idle rank makes none).
        grid = torch.tensor(ranks, dtype=torch.int).view(par.pp, par.dp, par.tp)  # (pp, dp, tp) global ranks
        self.mesh = DeviceMesh(self.device.type, grid, mesh_dim_names=("pp", "dp", "tp"))
        self.coords = {name: self.mesh.get_local_rank(name) for name in ("pp", "dp", "tp")}
        torch.manual_seed(seed)
        model = GPT(cfg).to(self.device)
        if par.pp > 1:
            keep = stage_layers(cfg, par.pp, self.coords["pp"])
            for i in range(cfg.layers):
                if i not in keep:
                    del model.layers[str(i)]
            if self.coords["pp"] > 0:
                model.embed = model.pos_embed = None
            if self.coords["pp"] < par.pp - 1:
                model.norm = model.head = None
        if par.tp > 1:
            self._tensor_parallel(model)
        if par.fsdp:
            from torch.distributed.fsdp import fully_shard
            for block in model.blocks():
                fully_shard(block, mesh=self.mesh["dp"])
            fully_shard(model, mesh=self.mesh["dp"])
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
        self.scheduler = torch.optim.lr_scheduler.LinearLR(self.optimizer, start_factor=0.5, total_iters=10)
        self.schedule = self._pipeline() if par.pp > 1 else None

    def _tensor_parallel(self, model: GPT) -> None:
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {}
        for i in model.layers:
            plan.update({f"layers.{i}.attn.proj": RowwiseParallel(),
                         f"layers.{i}.mlp.fc1": ColwiseParallel(), f"layers.{i}.mlp.fc2": RowwiseParallel()})
        if model.head is not None:
            plan["head"] = ColwiseParallel(output_layouts=Replicate())
        parallelize_module(model, self.mesh["tp"], plan)
        for block in model.blocks():  # see Attention._qkv_weights: stored sharded, used per head
            qkv = block.attn.qkv
            qkv.weight, qkv.bias = (nn.Parameter(distribute_tensor(p.detach(), self.mesh["tp"], [Shard(0)]))
                                    for p in (qkv.weight, qkv.bias))

    def _pipeline(self):
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        stage = self.coords["pp"]
        micro = self.global_batch // self.par.dp // self.par.microbatches
        # Activations between stages need requires_grad, or no gradient would be sent back.
        hidden = torch.zeros(micro, self.cfg.seq, self.cfg.hidden, device=self.device, requires_grad=True)
        # Static shapes: nothing about the activations needs to be exchanged (or pickled) at run time.
        first, last = stage == 0, stage == self.par.pp - 1
        inputs = torch.zeros(micro, self.cfg.seq, dtype=torch.long, device=self.device) if first else hidden
        outputs = torch.zeros(micro, self.cfg.seq, self.cfg.vocab, device=self.device) if last else hidden
        pipe = PipelineStage(self.model, stage, self.par.pp, self.device, input_args=inputs, output_args=outputs,
                             group=self._pipeline_group())
        return ScheduleGPipe(pipe, n_microbatches=self.par.microbatches, loss_fn=loss_fn)

    def _pipeline_group(self):
        """This rank's pipeline group, a plain ``new_group`` (every rank creates each one, in the same order): a
        ``PipelineStage`` given the DeviceMesh's pp group keeps references to it after the stage is freed (torch
        2.13, measured), so its connections stay open after the world ends, and a peer of a world in place that
        waits in a pipeline receive from this rank would wait forever."""
        grid, mine = self.mesh.mesh, None  # (pp, dp, tp) global ranks
        for d in range(self.par.dp):
            for t in range(self.par.tp):
                ranks = grid[:, d, t].tolist()
                group = dist.new_group(ranks)
                mine = group if dist.get_rank() in ranks else mine
        return mine

    def local_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = batch(self.cfg, step, self.global_batch)
        per = self.global_batch // self.par.dp
        mine = tokens[self.coords["dp"] * per:(self.coords["dp"] + 1) * per].to(self.device)
        return mine[:, :-1], mine[:, 1:]

    def train_step(self, step: int, batch: tuple[torch.Tensor, torch.Tensor] | None = None) -> float:
        """One optimizer step; returns the global mean loss on every rank.

        ``batch`` is this rank's (inputs, targets); by default its share of the
        synthetic global batch of ``step`` (:meth:`local_batch`).
        """
        x, y = batch if batch is not None else self.local_batch(step)
        self.optimizer.zero_grad(set_to_none=True)
        loss = torch.zeros((), device=self.device)
        if self.schedule is None:
            loss = loss_fn(self.model(x), y)
            loss.backward()
            loss = loss.detach()
        else:
            losses: list[torch.Tensor] = []
            first, last = self.coords["pp"] == 0, self.coords["pp"] == self.par.pp - 1
            self.schedule.step(*((x,) if first else ()), target=y if last else None, losses=losses if last else None)
            if last:
                loss = torch.stack(losses).mean().detach()
        if not self.par.fsdp and self.par.dp > 1:
            group = self.mesh.get_group("dp")
            for p in self.model.parameters():
                if p.grad is not None:
                    g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                    dist.all_reduce(g, group=group)
                    g.div_(self.par.dp)
        self.optimizer.step()
        self.scheduler.step()
        # Every rank reports the same number: the mean over dp of the last stage's loss.
        total = loss.reshape(1).clone()
        if self.coords["pp"] != self.par.pp - 1 or self.coords["tp"] != 0:
            total.zero_()
        dist.all_reduce(total, group=self.group)
        return total.item() / self.par.dp

    def full_state(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and Adam moments as full (unsharded) tensors. Collective over the mesh."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        state = {}
        for name, value in self.model.state_dict().items():
            state[name] = _full(value)
        for p, s in self.optimizer.state.items():
            for key in ("exp_avg", "exp_avg_sq"):
                state[f"optim.{key}.{names[id(p)]}"] = _full(s[key])
        return state


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()


__all__ = ["GPTConfig", "Parallel", "GPT", "Trainer", "batch", "loss_fn", "rules", "stage_layers"]
