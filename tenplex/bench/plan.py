"""Planning cost at GPT-3-175B scale: layout construction and ``plan()`` for 1,024 devices, and how it grows.

The model is GPT-3 175B shaped (96 layers, hidden 12288, 96 heads, vocab
50257, ffn 4 * hidden) with Adam states (3 tensors per parameter, 3,468 in
all). The old configuration is dp=N/128, tp=8, pp=16 on N/8 hosts of 8
devices; the scenarios change it to dp/pp (2N/128, 8, 8), tp/dp
(2N/128, 4, 16), lose one dp replica (16 hosts fewer) and turn on ZeRO-1
optimizer sharding. A scaling series repeats the dp/pp change for several
device counts and layer counts.

Baselines measured in the same run: ``floor_seconds`` creates one transfer per
new box with no geometry at all (the unavoidable output cost of any planner
written in Python), and ``reload_bytes`` is what a stop / checkpoint /
restart would move between hosts (every byte of the new state).
Times are wall (``*_seconds``) and CPU (``*_cpu_seconds``); the CPU time is the
fairer number on a shared machine.

May import: the PTC core (``tenplex.box``, ``tenplex.parallel``, ``tenplex.gpt``,
``tenplex.ptc``, ``tenplex.planner``, ``tenplex.transfer_plan``,
``tenplex._gc``, ``tenplex.errors``), this package's :mod:`.plan_share`, tqdm and the standard library.

Per rank (``--rank-series``, 1,024 to 16,384 devices by default): every scenario again, with one rank's
share planned beside the global planner (:mod:`.plan_share`).
"""

from __future__ import annotations

import argparse
import time

from tqdm import tqdm

from .._gc import paused_gc
from ..box import Box
from ..errors import ConfigError
from ..gpt import gpt
from ..parallel import ParallelConfig
from ..transfer_plan import Transfer
from ..planner import plan
from ..ptc import PTC, layout
from .plan_share import per_rank

DESCRIPTION = ("time layout construction and planning for a GPT-3-175B-shaped model on 1,024 devices, and one "
               "rank's share of the plan beside the global planner up to 16,384 devices")
PER_HOST = 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rank-series", default="1024,4096,16384", metavar="N,N,…",
                        help="device counts at which every scenario also plans one rank's share beside the global "
                             "planner ('per-rank: …' rows; '' to skip)")
    parser.add_argument("--global-memory-up-to", type=int, default=4096, metavar="N",
                        help="trace the global planner's memory up to N devices (tracing doubles its time)")
    parser.add_argument("--devices", type=int, default=1024, help="devices (a multiple of 128; default 1024)")
    parser.add_argument("--layers", type=int, default=96)
    parser.add_argument("--hidden", type=int, default=12288)
    parser.add_argument("--heads", type=int, default=96)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--series-devices", default="128,256,512,1024", metavar="N,N,…",
                        help="device counts for the scaling series ('' to skip)")
    parser.add_argument("--series-layers", default="24,48,96", metavar="L,L,…",
                        help="layer counts for the scaling series, at --devices ('' to skip)")


def _numbers(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag} {text!r} should be comma-separated integers") from None


def _timed(fn, *args, **kwargs):
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - wall, time.process_time() - cpu


def _config(devices: int, dp_per_128: float, tp: int, pp: int, sharding: str = "none") -> ParallelConfig:
    dp = round(devices * dp_per_128 / 128)
    n = dp * tp * pp
    return ParallelConfig.on_hosts(dp, tp, pp, n // PER_HOST, PER_HOST, sharding=sharding)


def _floor(new) -> float:
    """Seconds to emit one transfer per new box with no geometry: the output cost any planner pays."""
    started = time.process_time()
    with paused_gc():  # as plan() does
        out = [Transfer(name, device, device, "old", Box.trusted(box.offsets, box.lengths))
               for name in sorted(new.tensors) for device, box in new.shards_of(name)]
    assert len(out) == sum(len(s) for s in new.devices.values())
    return time.process_time() - started


def _measure(ptc, old_config: ParallelConfig, new_config: ParallelConfig, label: str, floor: bool = False) -> dict:
    old, old_wall, old_cpu = _timed(layout, ptc, old_config)
    new, new_wall, new_cpu = _timed(layout, ptc, new_config)
    result, wall, cpu = _timed(plan, old, new)
    s = result.stats
    entries = sum(len(v) for v in old.devices.values()) + sum(len(v) for v in new.devices.values())
    row = {
        "scenario": label, "old": old_config.describe(), "new": new_config.describe(),
        "tensors": len(ptc.rules), "layers": ptc.layers, "box_entries": entries,
        "layout_seconds": round(old_wall + new_wall, 3), "layout_cpu_seconds": round(old_cpu + new_cpu, 3),
        "plan_seconds": round(wall, 3), "plan_cpu_seconds": round(cpu, 3),
        "plan_cpu_us_per_entry": round(1e6 * cpu / entries, 2),
        "transfers": len(result.transfers),
        "target_bytes": s.target_bytes, "kept_bytes": s.kept_bytes, "intra_host_bytes": s.intra_host_bytes,
        "inter_host_bytes": s.inter_host_bytes, "inter_host_lower_bound": s.inter_host_lower_bound,
        "max_host_send_bytes": s.max_host_send_bytes, "max_host_recv_bytes": s.max_host_recv_bytes,
        "baseline": {"reload_bytes": s.target_bytes},
    }
    if floor:
        row["baseline"]["floor_cpu_seconds"] = round(_floor(new), 3)
    return row


def run(args: argparse.Namespace) -> list[dict]:
    jobs = _scenarios(args, *_series(args))
    rows = [_measure(*job) for job in tqdm(jobs, desc="bench plan", unit="plan", leave=False, disable=None)]
    ranked = tqdm(_rank_jobs(args), desc="bench plan per rank", unit="plan", leave=False, disable=None)
    return rows + [_measure_rank(ptc, old, new, label, args.global_memory_up_to) for ptc, old, new, label in ranked]


def _rank_jobs(args: argparse.Namespace) -> list[tuple[PTC, ParallelConfig, ParallelConfig, str]]:
    """(PTC, old config, new config, label) for every scenario at every ``--rank-series`` device count."""
    counts = _numbers(args.rank_series, "--rank-series")
    if any(n % 128 or n < 256 for n in counts):
        raise ConfigError(f"--rank-series {args.rank_series!r}: device counts must be multiples of 128, at least 256")
    ptc = gpt(args.layers, args.hidden, args.heads, args.vocab, optimizer="adam")
    return [(ptc, old, new, f"per-rank: {label} at {n} devices")
            for n in counts for old, new, label in _changes(n)]


def _measure_rank(ptc, old_config: ParallelConfig, new_config: ParallelConfig, label: str, memory_up_to: int) -> dict:
    old, new = layout(ptc, old_config), layout(ptc, new_config)
    return {"scenario": label, "old": old_config.describe(), "new": new_config.describe(),
            **per_rank(old, new, global_memory=len(new.devices) <= memory_up_to)}


def _series(args: argparse.Namespace) -> tuple[list[int], list[int]]:
    """The checked device and layer counts of the scaling series."""
    if args.devices % 128 or args.layers < 16:
        raise ConfigError(f"--devices {args.devices} must be a multiple of 128 and --layers {args.layers} at least "
                          f"16 (the old configuration is dp=devices/128, tp=8, pp=16)")
    series_devices = _numbers(args.series_devices, "--series-devices")
    series_layers = _numbers(args.series_layers, "--series-layers")
    if any(n % 128 for n in series_devices) or any(n < 16 for n in series_layers):
        raise ConfigError("series device counts must be multiples of 128 and layer counts at least 16")
    return series_devices, series_layers


def _changes(n: int) -> list[tuple[ParallelConfig, ParallelConfig, str]]:
    """The benchmark's scenarios at ``n`` devices: (old config, new config, label)."""
    changes = [(_config(n, 1, 8, 16), _config(n, 2, 8, 8), "dp/pp change"),
               (_config(n, 1, 8, 16), _config(n, 2, 4, 16), "tp/dp change"),
               (_config(n, 1, 8, 16), _config(n, 1, 8, 16, "optimizer"), "ZeRO-1 on")]
    if n > 128:
        changes.append((_config(n, 1, 8, 16), _config(n - 128, 1, 8, 16), "lose one dp replica"))
    return changes


def _scenarios(args: argparse.Namespace, series_devices: list[int], series_layers: list[int]) -> list[tuple]:
    """(PTC, old config, new config, label, with floor baseline) for every scenario, then the series."""
    def model(layers: int):
        return gpt(layers, args.hidden, args.heads, args.vocab, optimizer="adam")

    n = args.devices
    ptc = model(args.layers)
    jobs = [(ptc, old, new, label, True) for old, new, label in _changes(n)]
    jobs += [(ptc, _config(d, 1, 8, 16), _config(d, 2, 8, 8), f"series: {d} devices", False)
             for d in series_devices]
    jobs += [(model(layers), _config(n, 1, 8, 16), _config(n, 2, 8, 8), f"series: {layers} layers", False)
             for layers in series_layers]
    return jobs
