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

    ``config`` covers ranks ``0 .. used-1`` (its devices are theirs);
    ``idle`` lists the ranks ``used .. world_size-1`` that train nothing.
    """

    config: ParallelConfig
    world_size: int
    used: int
    idle: tuple[int, ...]
    reason: str

    def is_idle(self, rank: int) -> bool:
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} is outside the world of {self.world_size} ranks")
        return rank >= self.used

    def degrees(self) -> str:
        """``"dp=2,tp=2,pp=1"`` (plus ``,sharding=…`` when sharded): what status lines and JSON show."""
        c = self.config
        sharding = f",sharding={c.sharding}" if c.sharding != "none" else ""
        return f"dp={c.dp},tp={c.tp},pp={c.pp}{sharding}"

    def to_dict(self) -> dict:
        c = self.config
        return {"world_size": self.world_size, "used": self.used, "idle": list(self.idle),
                "dp": c.dp, "tp": c.tp, "pp": c.pp, "sharding": c.sharding, "reason": self.reason}


def choose(world_size: int, ranks_per_node: int, *, max_tp: int = 8, pp: int | None = None,
           pinned: Mapping[int, ParallelConfig | str] | None = None,
           policy: Callable[[int, int], ParallelConfig | str | None] | None = None,
           sharding: str = "none", hosts: Sequence[str] | None = None) -> Choice:
    """The configuration for ``world_size`` ranks, ``ranks_per_node`` per node (see the module docstring)."""
    for name, value in (("world_size", world_size), ("ranks_per_node", ranks_per_node), ("max_tp", max_tp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    if pp is not None and (not isinstance(pp, int) or isinstance(pp, bool) or pp < 1):
        raise ConfigError(f"pp must be a positive integer or None, got {pp!r}")
    if world_size % ranks_per_node:
        raise ConfigError(f"world_size={world_size} is not a multiple of ranks_per_node={ranks_per_node}; "
                          f"torchrun starts the same number of workers on every node (--nproc-per-node)")
    devices = _devices(world_size, ranks_per_node, hosts)
    if pinned and world_size in pinned:
        return _resolve(pinned[world_size], world_size, devices, f"pinned for world size {world_size}")
    if policy is not None:
        result = policy(world_size, ranks_per_node)
        if result is not None:
            return _resolve(result, world_size, devices, f"policy {getattr(policy, '__name__', policy)!s}")
    return _default(world_size, ranks_per_node, max_tp, pp, sharding, devices)


def _default(world: int, per_node: int, max_tp: int, pp: int | None, sharding: str,
             devices: list[str]) -> Choice:
    stages = 1 if pp is None else pp
    if stages > world:
        raise ConfigError(f"pp={stages} needs at least {stages} ranks but the world has {world}; wait for more "
                          f"nodes (torchrun --nnodes=MIN:MAX with a larger MIN) or pin a smaller pp")
    divisors = [t for t in range(1, per_node + 1) if per_node % t == 0 and t <= max_tp]
    tp = max(divisors)
    why_tp = f"tp={tp}: the largest divisor of {per_node} ranks per node <= max_tp={max_tp}"
    if tp * stages > world:
        tp = max(t for t in divisors if t * stages <= world)
        why_tp = f"tp={tp}: the largest divisor of {per_node} ranks per node with tp*pp <= {world} ranks"
    group = tp * stages
    dp, idle = divmod(world, group)
    used = dp * group
    why_pp = f"pp={stages} ({'pinned' if pp is not None else 'not pinned'})"
    reason = f"default policy: {why_tp}; {why_pp}; dp={dp} takes the rest"
    if idle:
        reason += (f"; {idle} of {world} ranks idle (ranks {used}..{world - 1}): {world} is not a multiple of "
                   f"tp*pp={group}")
    config = ParallelConfig(dp, tp, stages, tuple(devices[:used]), sharding=sharding)
    return Choice(config, world, used, tuple(range(used, world)), reason)


def _resolve(spec: ParallelConfig | str, world: int, devices: list[str], source: str) -> Choice:
    """A pinned or policy-made configuration placed on the first ranks of this world."""
    if isinstance(spec, ParallelConfig):
        used = spec.world_size
        if used > world:
            raise ConfigError(f"{source}: {spec.describe()} needs {used} ranks but the world has {world}")
        config = dataclasses.replace(spec, devices=tuple(devices[:used]))
    elif isinstance(spec, str):
        degrees = parse_degrees(spec)
        group = degrees["tp"] * degrees["pp"]
        if not _names_dp(spec):
            if group > world:
                raise ConfigError(f"{source}: {spec!r} needs tp*pp = {group} ranks but the world has {world}")
            degrees["dp"] = world // group
        used = degrees["dp"] * group
        if used > world:
            raise ConfigError(f"{source}: {spec!r} needs {used} ranks but the world has {world}")
        config = ParallelConfig(degrees["dp"], degrees["tp"], degrees["pp"], tuple(devices[:used]))
    else:
        raise ConfigError(f"{source}: expected a ParallelConfig or a string like 'dp=2,tp=2', "
                          f"got {type(spec).__name__} {spec!r}")
    reason = f"{source}"
    if used < world:
        reason += f"; {world - used} of {world} ranks idle (ranks {used}..{world - 1})"
    return Choice(config, world, used, tuple(range(used, world)), reason)


def _names_dp(spec: str) -> bool:
    return any(part.split("=", 1)[0].strip() == "dp" for part in spec.split(","))


def _devices(world: int, per_node: int, hosts: Sequence[str] | None) -> list[str]:
    nodes = world // per_node
    if hosts is None:
        hosts = [f"h{n}" for n in range(nodes)]
    elif len(hosts) != nodes:
        raise ConfigError(f"{len(hosts)} host names given for {nodes} nodes ({world} ranks, {per_node} per node)")
    return [device_id(hosts[r // per_node], r % per_node) for r in range(world)]
