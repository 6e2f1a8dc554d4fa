"""Parallel configurations: degrees, sharding mode, devices, and the rank <-> (pp, dp, tp) mapping.

May import: ``tenplex.devices``, ``tenplex.errors`` and the standard library.
Pure value objects; only :func:`detect` reads environment variables, and it
takes the environment as an argument so that it can be tested without one.

Ranks and coordinates. A configuration has ``dp * tp * pp`` ranks; rank ``r``
runs on ``devices[r]``. By default the tensor-parallel coordinate varies
fastest, then data-parallel, then pipeline (Megatron's order)::

    rank = (pp_index * dp + dp_index) * tp + tp_index

so with ``tp <= devices per host`` the ranks of one tensor-parallel group sit
on one host. ``mapping`` replaces this order: ``mapping[rank] == (pp, dp, tp)``.

Sharding modes (sharded data parallelism over the dp group):

* ``"none"``: parameters and optimizer states are replicated over dp.
* ``"optimizer"``: optimizer states are sharded over dp (ZeRO-1); parameters replicated.
* ``"full"``: parameters and optimizer states are sharded over dp (FSDP / ZeRO-3).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from .devices import host_of, make_devices, parse_device
from .errors import ConfigError

SHARDING_MODES = ("none", "optimizer", "full")

Coord = tuple[int, int, int]  # (pp, dp, tp)


@dataclass(frozen=True)
class ParallelConfig:
    """dp x tp x pp ranks on ``devices``, with a sharded-data-parallel mode.

    ``stage_layers``, when given, fixes how many transformer layers each
    pipeline stage holds (``len == pp``); otherwise stages are as even as
    possible (see :func:`tenplex.ptc.stage_layer_counts`).

    Frozen, with one hidden cache: :meth:`rank_of` under a ``mapping`` keeps
    the inverse mapping in the instance (``_inverse_cache``, outside equality).
    """

    dp: int
    tp: int
    pp: int
    devices: tuple[str, ...]
    sharding: str = "none"
    mapping: tuple[Coord, ...] | None = None
    stage_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.sharding not in SHARDING_MODES:
            raise ConfigError(f"sharding {self.sharding!r} is not one of {', '.join(SHARDING_MODES)}")
        object.__setattr__(self, "devices", tuple(self.devices))
        for device in self.devices:
            parse_device(device)
        if len(set(self.devices)) != len(self.devices):
            dupes = sorted({d for d in self.devices if self.devices.count(d) > 1})
            raise ConfigError(f"device ids must be distinct; repeated: {', '.join(dupes)}")
        world = self.dp * self.tp * self.pp
        if world != len(self.devices):
            raise ConfigError(f"dp*tp*pp = {self.dp}*{self.tp}*{self.pp} = {world} ranks, but {len(self.devices)} "
                              f"devices were given; use exactly {world} devices or degrees whose product is "
                              f"{len(self.devices)}")
        if self.mapping is not None:
            mapping = tuple(tuple(int(c) for c in coord) for coord in self.mapping)
            expected = {(p, d, t) for p in range(self.pp) for d in range(self.dp) for t in range(self.tp)}
            if len(mapping) != world or set(mapping) != expected:
                raise ConfigError(f"mapping must list each (pp, dp, tp) coordinate with pp<{self.pp}, dp<{self.dp}, "
                                  f"tp<{self.tp} exactly once ({world} entries, one per rank); got {len(mapping)} "
                                  f"entries with {len(set(mapping) & expected)} distinct valid coordinates")
            object.__setattr__(self, "mapping", mapping)
        if self.stage_layers is not None:
            counts = tuple(int(n) for n in self.stage_layers)
            if len(counts) != self.pp or any(n < 0 for n in counts):
                raise ConfigError(f"stage_layers {list(counts)} must give a non-negative layer count for each of "
                                  f"the pp={self.pp} stages")
            object.__setattr__(self, "stage_layers", counts)

    @classmethod
    def on_hosts(cls, dp: int, tp: int, pp: int, hosts: int, devices_per_host: int, **kwargs) -> "ParallelConfig":
        """A configuration on ``hosts`` hosts named h0, h1, … with ``devices_per_host`` devices each."""
        return cls(dp, tp, pp, tuple(make_devices(hosts, devices_per_host)), **kwargs)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def coords(self, rank: int) -> Coord:
        """(pp, dp, tp) coordinates of ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} is outside 0..{self.world_size - 1}")
        if self.mapping is not None:
            return self.mapping[rank]
        rest, tp_index = divmod(rank, self.tp)
        pp_index, dp_index = divmod(rest, self.dp)
        return pp_index, dp_index, tp_index

    def rank_of(self, pp: int, dp: int, tp: int) -> int:
        if not (0 <= pp < self.pp and 0 <= dp < self.dp and 0 <= tp < self.tp):
            raise ConfigError(f"coordinate (pp={pp}, dp={dp}, tp={tp}) is outside pp<{self.pp}, dp<{self.dp}, "
                              f"tp<{self.tp}")
        if self.mapping is not None:
            return self._inverse()[(pp, dp, tp)]
        return (pp * self.dp + dp) * self.tp + tp

    def _inverse(self) -> dict[Coord, int]:
        inverse = self.__dict__.get("_inverse_cache")
        if inverse is None:
            inverse = {coord: rank for rank, coord in enumerate(self.mapping or ())}
            object.__setattr__(self, "_inverse_cache", inverse)
        return inverse

    def device(self, rank: int) -> str:
        self.coords(rank)  # range check
        return self.devices[rank]

    def device_at(self, pp: int, dp: int, tp: int) -> str:
        return self.devices[self.rank_of(pp, dp, tp)]

    def hosts(self) -> list[str]:
        """Host names in order of first appearance in ``devices``."""
        return list(dict.fromkeys(host_of(d) for d in self.devices))

    def describe(self) -> str:
        extra = f", sharding={self.sharding}" if self.sharding != "none" else ""
        return (f"dp={self.dp},tp={self.tp},pp={self.pp}{extra} on {len(self.devices)} devices / "
                f"{len(self.hosts())} hosts")


def parse_degrees(text: str, options: tuple[str, ...] = ()) -> dict[str, int]:
    """Parse ``"dp=2,tp=2,pp=2"`` (any order, missing degrees are 1): the one parser of parallel specs.

    ``options`` names further keys a caller accepts, such as ``("fsdp",)`` for
    the reference GPT's ``fsdp=1``; their values are non-negative integers and
    they appear in the result only when given.
    """
    degrees = {"dp": 1, "tp": 1, "pp": 1}
    given: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = (s.strip() for s in part.partition("="))
        smallest = 1 if key in degrees else 0
        if not sep or key not in (*degrees, *options) or not value.isdigit() or int(value) < smallest:
            keys = ", ".join((*degrees, *options))
            raise ConfigError(f"cannot parse {part!r} in parallel spec {text!r}; expected e.g. 'dp=2,tp=2,pp=2' "
                              f"with positive integers for dp, tp and pp (keys: {keys})")
        given[key] = int(value)
    return {**degrees, **given}


@dataclass(frozen=True)
class WorkerEnv:
    """What torchrun tells one worker about itself."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int

    @property
    def device(self) -> str:
        return f"h{self.node_rank}/{self.local_rank}"


def detect(tp: int = 1, pp: int = 1, sharding: str = "none",
           env: Mapping[str, str] | None = None) -> tuple[ParallelConfig, WorkerEnv]:
    """Build the configuration from torchrun's environment variables.

    Reads RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and GROUP_RANK (the
    node rank; derived from RANK // LOCAL_WORLD_SIZE when absent). Assumes
    every node runs LOCAL_WORLD_SIZE workers, as torchrun does; devices are
    ``h{node}/{local_rank}``. dp is WORLD_SIZE / (tp * pp).
    """
    env = os.environ if env is None else env

    def number(name: str, default: int | None = None) -> int:
        value = env.get(name)
        if value is None:
            if default is None:
                raise ConfigError(f"environment variable {name} is not set; run under torchrun or set it")
            return default
        if not value.isdigit():
            raise ConfigError(f"environment variable {name}={value!r} is not a non-negative integer")
        return int(value)

    rank, world = number("RANK"), number("WORLD_SIZE")
    local_world = number("LOCAL_WORLD_SIZE", world)
    worker = WorkerEnv(rank, world, number("LOCAL_RANK", rank % max(local_world, 1)), local_world,
                       number("GROUP_RANK", rank // max(local_world, 1)))
    if local_world < 1 or world % local_world:
        raise ConfigError(f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local_world}")
    if world % (tp * pp):
        raise ConfigError(f"WORLD_SIZE={world} is not divisible by tp*pp = {tp}*{pp}; choose tp and pp whose "
                          f"product divides {world}")
    devices = make_devices(world // local_world, local_world)
    return ParallelConfig(world // (tp * pp), tp, pp, tuple(devices), sharding=sharding), worker

