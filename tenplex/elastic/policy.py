"""Which parallel configuration a world of a given size trains with.

May import: ``tenplex.parallel``, ``tenplex.devices``, ``tenplex.errors`` and the
standard library. Pure: no torch, no I/O (the Kubernetes operator and the
workers of every new world call it with the same arguments and must get the
same answer).

The default policy, for ``world_size`` ranks on nodes of ``ranks_per_node``:

1. **tp** is the largest divisor of ``ranks_per_node`` that is at most
   ``max_tp``, so that a tensor-parallel group never spans two nodes (rank
   order puts tp fastest, see :mod:`tenplex.parallel`).
2. **pp** is the ``pp`` argument, or 1 when it is ``None``: the policy does
   not know the model's memory, so a model that must be split into stages
   says so with ``pp``. If ``tp * pp`` exceeds the world, tp shrinks to the
   largest divisor of ``ranks_per_node`` with ``tp * pp <= world_size``; if
   even ``pp`` alone exceeds it, that is a :class:`~tenplex.errors.ConfigError`.
3. **dp** takes the rest: ``dp = world_size // (tp * pp)``.
4. **Worlds that don't factor**: when ``tp * pp`` does not divide
   ``world_size``, the last ``world_size % (tp * pp)`` ranks stay **idle**
   (they train nothing) and :attr:`Choice.reason` says so. tp is never
   lowered to avoid idle ranks, because tp is what bounds the memory a rank
   needs. With ``pp=None`` this never happens (tp divides the node size).

**Nodes of different sizes** (``ranks_per_node`` a sequence, one count per
node in rank order, e.g. ``[8, 7]`` after a node lost a GPU): tp is chosen
as above from the largest node (never lowered to use more devices: tp bounds
the memory a rank needs; a data-parallel job with ``max_tp=1`` uses every
device). Each node then trains on the largest multiple of tp it holds, so a
tp group never spans nodes and tp divides what each node uses; pipelines are
made of consecutive tp groups (in rank order) and dp takes as many whole
pipelines as there are. The ranks left over (a node's remainder, and the tp
groups that do not fill a last pipeline) stay idle, wherever they are in rank
order; :attr:`Choice.ranks` lists the ranks that train and
:meth:`Choice.position` gives each its place in the configuration. With equal
node sizes this is exactly the rule above.

Overrides, in this order of precedence:

* ``pinned``: a configuration per world size, a ``ParallelConfig`` (its
  degrees, sharding, mapping and stage sizes are used; its devices are
  replaced by this world's) or a string ``"tp=2,pp=2"``; a string without
  ``dp`` lets dp take the rest. A pin may use fewer ranks than the world;
  the rest stay idle.
* ``policy``: a function ``policy(world_size, ranks_per_node)`` returning a
  ``ParallelConfig``, such a string, or ``None`` for the default.

Devices are ``HOST/LOCAL_RANK``, rank ``r`` on node ``r // ranks_per_node``,
as torchrun numbers them; hosts are named ``h0, h1, …`` or by ``hosts``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from ..devices import device_id
from ..errors import ConfigError
from ..parallel import ParallelConfig, parse_degrees


@dataclass(frozen=True)
class Choice:
    """The configuration of the ranks that train, and which ranks stay idle.

    ``config`` covers the ranks ``ranks`` (its devices are theirs, in that
    order): ``0 .. used-1`` when every node has the same number of ranks;
    ``idle`` lists the others.
    """

    config: ParallelConfig
    world_size: int
    ranks: tuple[int, ...]  # the ranks that train, in configuration order
    reason: str

    @property
    def used(self) -> int:
        """How many ranks train."""
        return len(self.ranks)

    @property
    def idle(self) -> tuple[int, ...]:
        """The ranks that train nothing, in rank order."""
        training = set(self.ranks)
        return tuple(r for r in range(self.world_size) if r not in training)

    def is_idle(self, rank: int) -> bool:
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} is outside the world of {self.world_size} ranks")
        return rank not in self.ranks

    def position(self, rank: int) -> int:
        """``rank``'s place in :attr:`config` (its index among the training ranks; the rank itself when no
        idle rank comes before it). Also its rank in the training ranks' process group."""
        if self.is_idle(rank):
            raise ConfigError(f"rank {rank} is idle in this world ({self.reason}): it has no place in "
                              f"{self.degrees()}")
        return self.ranks.index(rank)

    def degrees(self) -> str:
        """``"dp=2,tp=2,pp=1"`` (plus ``,sharding=…`` when sharded): what status lines and JSON show."""
        c = self.config
        sharding = f",sharding={c.sharding}" if c.sharding != "none" else ""
        return f"dp={c.dp},tp={c.tp},pp={c.pp}{sharding}"

    def to_dict(self) -> dict:
        c = self.config
        return {"world_size": self.world_size, "used": self.used, "idle": list(self.idle), "ranks": list(self.ranks),
                "dp": c.dp, "tp": c.tp, "pp": c.pp, "sharding": c.sharding, "reason": self.reason}


def choose(world_size: int, ranks_per_node: int | Sequence[int], *, max_tp: int = 8, pp: int | None = None,
           pinned: Mapping[int, ParallelConfig | str] | None = None,
           policy: Callable[[int, int], ParallelConfig | str | None] | None = None,
           sharding: str = "none", hosts: Sequence[str] | None = None) -> Choice:
    """The configuration for ``world_size`` ranks, ``ranks_per_node`` per node: one count for every node, or a
    count per node in rank order (see the module docstring). A ``policy`` function gets the largest node's count."""
    for name, value in (("world_size", world_size), ("max_tp", max_tp)):
        if not _positive(value):
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    if pp is not None and not _positive(pp):
        raise ConfigError(f"pp must be a positive integer or None, got {pp!r}")
    sizes = _node_sizes(world_size, ranks_per_node)
    devices = _devices(sizes, hosts)
    if pinned and world_size in pinned:
        return _resolve(pinned[world_size], world_size, devices, f"pinned for world size {world_size}", sizes)
    if policy is not None:
        result = policy(world_size, max(sizes))
        if result is not None:
            return _resolve(result, world_size, devices, f"policy {getattr(policy, '__name__', policy)!s}", sizes)
    return _default(world_size, sizes, max_tp, pp, sharding, devices)


def _positive(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _node_sizes(world: int, ranks_per_node: int | Sequence[int]) -> list[int]:
    if isinstance(ranks_per_node, int) and not isinstance(ranks_per_node, bool):
        if ranks_per_node < 1:
            raise ConfigError(f"ranks_per_node must be a positive integer, got {ranks_per_node!r}")
        if world % ranks_per_node:
            raise ConfigError(f"world_size={world} is not a multiple of ranks_per_node={ranks_per_node}; give "
                              f"one count per node (a sequence) when nodes run different numbers of workers")
        return [ranks_per_node] * (world // ranks_per_node)
    sizes = list(ranks_per_node) if isinstance(ranks_per_node, (list, tuple)) else None
    if not sizes or not all(_positive(n) for n in sizes):
        raise ConfigError(f"ranks_per_node must be a positive integer or a non-empty sequence of them (one per "
                          f"node), got {ranks_per_node!r}")
    if sum(sizes) != world:
        raise ConfigError(f"ranks_per_node {sizes} add up to {sum(sizes)} ranks, but the world has {world}")
    return sizes


def _default(world: int, sizes: list[int], max_tp: int, pp: int | None, sharding: str,
             devices: list[str]) -> Choice:
    stages = 1 if pp is None else pp
    if stages > world:
        raise ConfigError(f"pp={stages} needs at least {stages} ranks but the world has {world}; wait for more "
                          f"nodes (torchrun --nnodes=MIN:MAX with a larger MIN) or pin a smaller pp")
    per_node = max(sizes)
    even = len(set(sizes)) == 1
    of = f"{per_node} ranks per node" if even else f"{per_node} ranks on the largest node"
    divisors = [t for t in range(1, per_node + 1) if per_node % t == 0 and t <= max_tp]
    tp = max(divisors)
    why_tp = f"tp={tp}: the largest divisor of {of} <= max_tp={max_tp}"
    if _tp_groups(sizes, tp) < stages:  # with equal nodes: tp * pp > world
        tp = max(t for t in divisors if _tp_groups(sizes, t) >= stages)
        why_tp = (f"tp={tp}: the largest divisor of {of} with tp*pp <= {world} ranks" if even else
                  f"tp={tp}: the largest divisor of {of} whose tp groups fill a pipeline of pp={stages}")
    group = tp * stages
    dp = _tp_groups(sizes, tp) // stages
    ranks = _training_ranks(sizes, tp, dp * group)
    why_pp = f"pp={stages} ({'pinned' if pp is not None else 'not pinned'})"
    reason = f"default policy: {why_tp}; {why_pp}; dp={dp} takes the rest"
    training = set(ranks)
    idle = tuple(r for r in range(world) if r not in training)
    if idle and even:
        reason += (f"; {len(idle)} of {world} ranks idle (ranks {idle[0]}..{idle[-1]}): {world} is not a multiple "
                   f"of tp*pp={group}")
    elif idle:
        reason += (f"; nodes of {'+'.join(map(str, sizes))} ranks: each trains on whole tp groups of {tp}, so "
                   f"{len(idle)} of {world} ranks idle (ranks {_ranges(idle)})")
    config = ParallelConfig(dp, tp, stages, tuple(devices[r] for r in ranks), sharding=sharding)
    return Choice(config, world, tuple(ranks), reason)


def _tp_groups(sizes: list[int], tp: int) -> int:
    """How many tp groups of ``tp`` ranks the nodes hold, no group spanning two nodes."""
    return sum(n // tp for n in sizes)


def _training_ranks(sizes: list[int], tp: int, count: int) -> list[int]:
    """The first ``count`` ranks, in rank order, that belong to whole tp groups within their node."""
    ranks: list[int] = []
    first = 0
    for n in sizes:
        ranks += range(first, first + n - n % tp)
        first += n
    return ranks[:count]


def _ranges(ranks: Sequence[int]) -> str:
    """``(3, 4, 5, 9)`` -> ``"3..5, 9"``."""
    parts: list[list[int]] = []
    for r in ranks:
        if parts and parts[-1][1] == r - 1:
            parts[-1][1] = r
        else:
            parts.append([r, r])
    return ", ".join(f"{a}..{b}" if a != b else f"{a}" for a, b in parts)


def _resolve(spec: ParallelConfig | str, world: int, devices: list[str], source: str, sizes: list[int]) -> Choice:
    """A pinned or policy-made configuration placed on the first ranks of this world (with nodes of different
    sizes: on the first whole tp groups within nodes)."""
    if isinstance(spec, ParallelConfig):
        used, tp = spec.world_size, spec.tp
        ranks = _placed(sizes, tp, used, world, source, spec.describe())
        config = dataclasses.replace(spec, devices=tuple(devices[r] for r in ranks))
    elif isinstance(spec, str):
        degrees = parse_degrees(spec)
        group, tp = degrees["tp"] * degrees["pp"], degrees["tp"]
        room = world if len(set(sizes)) == 1 else _tp_groups(sizes, tp) * tp  # ranks in whole tp groups
        if not _names_dp(spec):
            if group > room:
                raise ConfigError(f"{source}: {spec!r} needs tp*pp = {group} ranks but the world has {room}"
                                  + ("" if room == world else f" in whole tp groups (nodes of {sizes} ranks)"))
            degrees["dp"] = room // group
        used = degrees["dp"] * group
        ranks = _placed(sizes, tp, used, world, source, repr(spec))
        config = ParallelConfig(degrees["dp"], degrees["tp"], degrees["pp"], tuple(devices[r] for r in ranks))
    else:
        raise ConfigError(f"{source}: expected a ParallelConfig or a string like 'dp=2,tp=2', "
                          f"got {type(spec).__name__} {spec!r}")
    training = set(ranks)
    idle = tuple(r for r in range(world) if r not in training)
    reason = f"{source}"
    if idle:
        reason += f"; {len(idle)} of {world} ranks idle (ranks {_ranges(idle)})"
    return Choice(config, world, tuple(ranks), reason)


def _placed(sizes: list[int], tp: int, used: int, world: int, source: str, what: str) -> list[int]:
    """The ranks a pinned configuration of ``used`` ranks trains on: the first ones, or with nodes of different
    sizes the first whole tp groups within nodes."""
    if len(set(sizes)) == 1:
        if used > world:
            raise ConfigError(f"{source}: {what} needs {used} ranks but the world has {world}")
        return list(range(used))
    ranks = _training_ranks(sizes, tp, used)
    if len(ranks) < used:
        raise ConfigError(f"{source}: {what} needs {used} ranks but the world has {len(ranks)} in whole tp groups "
                          f"of {tp} (nodes of {sizes} ranks)")
    return ranks


def _names_dp(spec: str) -> bool:
    return any(part.split("=", 1)[0].strip() == "dp" for part in spec.split(","))


def _devices(sizes: list[int], hosts: Sequence[str] | None) -> list[str]:
    """Every rank's device, in rank order: node ``n``'s ranks are ``HOST/0 .. HOST/sizes[n]-1``."""
    if hosts is None:
        hosts = [f"h{n}" for n in range(len(sizes))]
    elif len(hosts) != len(sizes):
        per_node = f"{sizes[0]} per node" if len(set(sizes)) == 1 else f"nodes of {sizes}"
        raise ConfigError(f"{len(hosts)} host names given for {len(sizes)} nodes ({sum(sizes)} ranks, {per_node})")
    return [device_id(host, local) for host, n in zip(hosts, sizes) for local in range(n)]
