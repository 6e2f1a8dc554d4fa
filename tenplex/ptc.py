"""The parallelizable tensor collection (PTC): named global tensors and the rules that partition them.

May import: ``tenplex.box``, ``tenplex.partition``, ``tenplex.parallel``,
``tenplex.layout``, ``tenplex.dtypes``, ``tenplex.errors``, ``tenplex._gc`` and
the standard library. Pure.

A :class:`TensorRule` says how any :class:`~tenplex.parallel.ParallelConfig`
partitions one tensor:

* **pipeline**: a tensor belongs to transformer layer ``layer`` (and so to
  the stage holding that layer), or to the ``"first"`` and/or ``"last"``
  stage (embeddings, final norm, head; a tied embedding is on both);
* **tensor parallelism**: split along ``tp_dim`` (see
  :mod:`tenplex.partition` for even, ``torch.chunk`` and padded splits,
  split units such as heads, and fused blocks), or replicated when ``tp_dim``
  is None;
* **data parallelism**: replicated over dp, or, in the sharded modes, the
  rank's local tensor is split into ``torch.chunk`` pieces along its dim 0
  over the dp group (``"optimizer"`` shards the rules marked
  ``optimizer_state``; ``"full"`` shards every rule). Because the dp split
  cuts the *local* tensor along an axis, each dp rank's part is always a set
  of boxes, even for a fused or padded tensor.

A rank's part of a tensor is a :class:`LocalShard`: the shape of its local
tensor, padding included, and the :class:`LocalRegion` s that map regions of that
local tensor to boxes of the global tensor. The global shape is always the
real, unpadded shape. A layout (:func:`layout`) keeps only the global boxes.

Pipeline stages: by default as even as possible; when ``pp`` does not divide
the layer count, the first ``layers % pp`` stages hold one layer more.
``ParallelConfig.stage_layers`` gives explicit per-stage counts instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable, Iterator

from ._gc import paused_gc
from .box import Box
from .dtypes import ITEMSIZE
from .errors import ConfigError
from .layout import Layout, Shard, TensorSpec
from .parallel import ParallelConfig
from .partition import SPLIT_KINDS, chunk_range, split_dim

ANCHORS = ("first", "last")


@dataclass(frozen=True)
class TensorRule:
    """A named global tensor and how configurations partition it."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    tp_dim: int | None = None
    split: str = "even"
    unit: int = 1
    pad_multiple: int = 1
    blocks: tuple[int, ...] | None = None
    layer: int | None = None
    anchors: tuple[str, ...] = ()
    optimizer_state: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        if self.blocks is not None:
            object.__setattr__(self, "blocks", tuple(int(b) for b in self.blocks))
        where = f"tensor {self.name!r} (shape {list(self.shape)})"
        if self.dtype not in ITEMSIZE:
            raise ConfigError(f"{where}: unknown dtype {self.dtype!r}; known: {', '.join(sorted(ITEMSIZE))}")
        if any(n < 1 for n in self.shape):
            raise ConfigError(f"{where}: every dimension must be at least 1")
        if self.tp_dim is not None and not 0 <= self.tp_dim < len(self.shape):
            raise ConfigError(f"{where}: tp_dim {self.tp_dim} is not a dimension of a {len(self.shape)}-d tensor")
        if self.split not in SPLIT_KINDS:
            raise ConfigError(f"{where}: split {self.split!r} is not one of {', '.join(SPLIT_KINDS)}")
        if self.unit < 1 or self.pad_multiple < 1:
            raise ConfigError(f"{where}: unit and pad_multiple must be positive")
        if self.blocks is not None and (self.tp_dim is None or sum(self.blocks) != self.shape[self.tp_dim]):
            raise ConfigError(f"{where}: fused blocks {list(self.blocks)} must sum to the size of tp_dim")
        if (self.layer is None) == (not self.anchors):
            raise ConfigError(f"{where}: give either a layer index or anchors ('first'/'last'), not both or neither")
        if self.layer is not None and self.layer < 0:
            raise ConfigError(f"{where}: layer {self.layer} is negative; layers count from 0")
        if any(a not in ANCHORS for a in self.anchors):
            raise ConfigError(f"{where}: anchors {self.anchors} must be among {ANCHORS}")

    @property
    def spec(self) -> TensorSpec:
        return TensorSpec(self.shape, self.dtype)

    def split_key(self) -> tuple:
        """Everything the tensor-parallel split depends on (rules with equal keys split alike)."""
        return self.shape, self.tp_dim, self.split, self.unit, self.pad_multiple, self.blocks


@dataclass(frozen=True)
class LocalRegion:
    """A region of a rank's local tensor (``local``) and the global box it holds (same lengths)."""

    local: Box
    box: Box


@dataclass(frozen=True)
class LocalShard:
    """A rank's local tensor of one global tensor: its shape (padding included) and where real data lies."""

    tensor: str
    shape: tuple[int, ...]
    regions: tuple[LocalRegion, ...]

    @property
    def boxes(self) -> tuple[Box, ...]:
        return tuple(r.box for r in self.regions)


def _anchor_stages(rule: TensorRule, pp: int) -> list[int]:
    """Stages of a rule placed by anchors: 'first' is stage 0, 'last' is stage pp - 1."""
    return sorted({0 if anchor == "first" else pp - 1 for anchor in rule.anchors})


def stage_layer_counts(layers: int, config: ParallelConfig) -> tuple[int, ...]:
    """How many transformer layers each pipeline stage holds."""
    if config.stage_layers is not None:
        if sum(config.stage_layers) != layers:
            raise ConfigError(f"stage_layers {list(config.stage_layers)} sum to {sum(config.stage_layers)}, but the "
                              f"model has {layers} layers; give {config.pp} counts that sum to {layers}")
        return config.stage_layers
    if layers and config.pp > layers:
        raise ConfigError(f"pp={config.pp} pipeline stages but the model has only {layers} layers; use pp <= {layers}")
    base, extra = divmod(layers, config.pp)
    return tuple(base + (1 if s < extra else 0) for s in range(config.pp))


class PTC:
    """A collection of :class:`TensorRule` s with ``layers`` transformer layers."""

    def __init__(self, rules: Iterable[TensorRule], layers: int | None = None) -> None:
        self.rules: dict[str, TensorRule] = {}
        for rule in rules:
            if rule.name in self.rules:
                raise ConfigError(f"tensor {rule.name!r} is defined twice")
            self.rules[rule.name] = rule
        highest = max((r.layer for r in self.rules.values() if r.layer is not None), default=-1)
        self.layers = highest + 1 if layers is None else layers
        if highest >= self.layers:
            raise ConfigError(f"a tensor belongs to layer {highest}, but the model has {self.layers} layers")

    @property
    def tensors(self) -> dict[str, TensorSpec]:
        return {name: rule.spec for name, rule in self.rules.items()}

    def total_bytes(self) -> int:
        return sum(rule.spec.nbytes for rule in self.rules.values())

    def stages_of(self, rule: TensorRule, config: ParallelConfig) -> list[int]:
        """The pipeline stages that hold ``rule``'s tensor."""
        if rule.layer is not None:
            counts = stage_layer_counts(self.layers, config)
            below = 0
            for stage, count in enumerate(counts):
                below += count
                if rule.layer < below:
                    return [stage]
        return _anchor_stages(rule, config.pp)

    def stage_rules(self, config: ParallelConfig) -> list[list[TensorRule]]:
        """The rules each pipeline stage holds, in definition order."""
        counts = stage_layer_counts(self.layers, config)
        stage_of_layer = [s for s, n in enumerate(counts) for _ in range(n)]
        stages: list[list[TensorRule]] = [[] for _ in range(config.pp)]
        for rule in self.rules.values():
            if rule.layer is not None:
                stages[stage_of_layer[rule.layer]].append(rule)
            else:
                for s in _anchor_stages(rule, config.pp):
                    stages[s].append(rule)
        return stages

    def check(self, config: ParallelConfig) -> None:
        """Raise ConfigError if ``config`` cannot partition this collection."""
        self.stage_rules(config)
        seen: set[tuple] = set()
        for rule in self.rules.values():
            if rule.tp_dim is not None and rule.split_key() not in seen:
                seen.add(rule.split_key())
                _tp_runs(rule, rule.tp_dim, config.tp, 0)

    def local_shard(self, config: ParallelConfig, rank: int, tensor: str) -> LocalShard | None:
        """``rank``'s local tensor of ``tensor``, or None if its pipeline stage does not hold it."""
        rule = self.rules.get(tensor)
        if rule is None:
            raise ConfigError(f"unknown tensor {tensor!r}; the collection has {len(self.rules)} tensors")
        pp, dp, tp = config.coords(rank)
        if pp not in self.stages_of(rule, config):
            return None
        return _local_shard(rule, config, dp, tp)

    def local_shards(self, config: ParallelConfig, rank: int) -> list[LocalShard]:
        """Every local tensor ``rank`` holds, in definition order."""
        pp, dp, tp = config.coords(rank)
        return [_local_shard(rule, config, dp, tp) for rule in self.stage_rules(config)[pp]]


def _tp_runs(rule: TensorRule, tp_dim: int, tp: int, index: int):
    try:
        return split_dim(rule.shape[tp_dim], tp, index, rule.split, rule.unit, rule.pad_multiple, rule.blocks)
    except ConfigError as e:
        raise ConfigError(f"tensor {rule.name!r} (shape {list(rule.shape)}): dim {rule.tp_dim} cannot be split "
                          f"over tp={tp}: {e}") from None


def _local_shard(rule: TensorRule, config: ParallelConfig, dp: int, tp: int) -> LocalShard:
    sharded = config.sharding == "full" or (config.sharding == "optimizer" and rule.optimizer_state)
    if rule.tp_dim is not None:
        _tp_runs(rule, rule.tp_dim, config.tp, tp)  # raises a ConfigError that names the tensor
    shape, regions = _geometry(rule.split_key(), config.tp, tp, config.dp if sharded else 1, dp if sharded else 0)
    return LocalShard(rule.name, shape, regions)


@lru_cache(maxsize=1 << 16)
def _geometry(split_key: tuple, tp_degree: int, tp: int, dp_degree: int, dp: int
              ) -> tuple[tuple[int, ...], tuple[LocalRegion, ...]]:
    """(local shape, regions) of a tensor split like ``split_key``; all layers' alike tensors share one result."""
    shape, tp_dim, split, unit, pad_multiple, blocks = split_key
    if tp_dim is None:
        local_shape = shape
        pieces = [LocalRegion(Box.whole(shape), Box.whole(shape))]
    else:
        d = tp_dim
        local_len, runs = split_dim(shape[d], tp_degree, tp, split, unit, pad_multiple, blocks)
        local_shape = shape[:d] + (local_len,) + shape[d + 1:]
        pieces = [LocalRegion(Box((0,) * d + (run.local,) + (0,) * (len(shape) - d - 1),
                            shape[:d] + (run.length,) + shape[d + 1:]),
                        Box((0,) * d + (run.start,) + (0,) * (len(shape) - d - 1),
                            shape[:d] + (run.length,) + shape[d + 1:]))
                  for run in runs]
    if dp_degree > 1 and shape:
        # dim-0 torch.chunk of the local tensor (padding included), like FSDP2's fully_shard.
        lo, hi = chunk_range(local_shape[0], dp_degree, dp)
        window = Box((lo,) + (0,) * (len(shape) - 1), (hi - lo,) + local_shape[1:])
        cut = []
        for piece in pieces:
            part = piece.local.intersect(window)
            if part is not None:
                at_global = tuple(g + (p - q) for g, p, q in zip(piece.box.offsets, part.offsets, piece.local.offsets))
                cut.append(LocalRegion(Box((part.offsets[0] - lo,) + part.offsets[1:], part.lengths),
                                 Box(at_global, part.lengths)))
        pieces, local_shape = cut, (hi - lo,) + local_shape[1:]
    return local_shape, tuple(p for p in pieces if not p.box.is_empty())


def iter_local_shards(ptc: PTC, config: ParallelConfig) -> Iterator[tuple[int, list[LocalShard]]]:
    """(rank, local shards) for every rank; ranks that hold identical shards share one computed list."""
    ptc.check(config)
    stages = ptc.stage_rules(config)
    cache: dict[tuple[int, int, int], list[LocalShard]] = {}
    sharding_matters = config.sharding != "none"
    for rank in range(config.world_size):
        pp, dp, tp = config.coords(rank)
        key = (pp, dp if sharding_matters else 0, tp)
        if key not in cache:
            cache[key] = [_local_shard(rule, config, dp, tp) for rule in stages[pp]]
        yield rank, cache[key]


def layout(ptc: PTC, config: ParallelConfig) -> Layout:
    """The layout of ``ptc`` under ``config``: for each device, the global boxes its rank holds."""
    with paused_gc():
        return _layout(ptc, config)


def _layout(ptc: PTC, config: ParallelConfig) -> Layout:
    devices: dict[str, tuple[Shard, ...]] = {}
    shard_cache: dict[int, tuple[Shard, ...]] = {}
    for rank, shards in iter_local_shards(ptc, config):
        key = id(shards)  # ranks sharing a computed list share the Shard tuple too
        if key not in shard_cache:
            shard_cache[key] = tuple(Shard(s.tensor, p.box) for s in shards for p in s.regions)
        devices[config.devices[rank]] = shard_cache[key]
    return Layout.build(ptc.tensors, devices)
