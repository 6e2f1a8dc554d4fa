"""Per-rank planning against the global planner, from 1,024 to 16,384 devices (``tenplex bench plan``'s rows
``per-rank: …``).

For each scenario of :mod:`tenplex.bench.plan` and device count: the global planner's CPU time, its peak
traced memory (up to ``--global-memory-up-to`` devices: tracing doubles its time) and its busiest sender;
beside them one rank's: the CPU time to index both layouts (:class:`~tenplex.plan_index.LayoutIndex`), the
CPU time to plan its share (:func:`~tenplex.share_planner.plan_share` on fresh indexes, the worst of the
first and the last device of a host in the middle: the last walks its host-mates' boxes), the peak traced
memory of index and share together, and the busiest sender of the union of all shares (planned host by host
and added up, so the union is never held in memory). Times are CPU seconds of this one process.

May import: the PTC core (``tenplex.layout``, ``tenplex.gpt``, ``tenplex.ptc``, ``tenplex.parallel``,
``tenplex.planner``, ``tenplex.plan_index``, ``tenplex.share_planner``) and the standard library.
"""

from __future__ import annotations

import gc
import time
import tracemalloc
from typing import Callable

from ..layout import Layout
from ..plan_index import LayoutIndex
from ..planner import plan
from ..share_planner import plan_share


def _cpu(fn: Callable, *args):
    gc.collect()
    started = time.process_time()
    result = fn(*args)
    return result, time.process_time() - started


def _peak(fn: Callable, *args) -> int:
    gc.collect()
    tracemalloc.start()
    try:
        fn(*args)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _busiest(loads: dict[str, int]) -> int:
    return max(loads.values(), default=0)


def _rank(old: Layout, new: Layout, device: str) -> None:
    plan_share(LayoutIndex(old), LayoutIndex(new), [device])


def per_rank(old: Layout, new: Layout, global_memory: bool) -> dict:
    """The global planner's and one rank's time, memory and busiest sender for ``old`` -> ``new``."""
    itemsizes = {name: spec.itemsize for name, spec in new.tensors.items()}
    whole, global_cpu = _cpu(plan, old, new)
    row = {"global": {"plan_cpu_seconds": round(global_cpu, 3), "transfers": len(whole.transfers),
                      "max_source_device_bytes": _busiest(whole.device_loads(itemsizes)),
                      "max_host_send_bytes": whole.stats.max_host_send_bytes,
                      "peak_traced_bytes": _peak(plan, old, new) if global_memory else None}}
    del whole
    (o, n), index_cpu = _cpu(lambda: (LayoutIndex(old), LayoutIndex(new)))
    middle = n.devices_on[sorted(n.devices_on)[len(n.devices_on) // 2]]
    samples = [middle[0], middle[-1]]
    shares, times = [], []
    for device in samples:
        (fresh_old, fresh_new), _ = _cpu(lambda: (LayoutIndex(old), LayoutIndex(new)))
        share, cpu = _cpu(plan_share, fresh_old, fresh_new, [device])
        shares.append(share)
        times.append(cpu)
    loads: dict[str, int] = {}
    sent: dict[str, int] = {}
    for devices in n.devices_on.values():  # the union of all shares, host by host
        part = plan_share(o, n, devices)
        for src, nbytes in part.device_loads(itemsizes).items():
            loads[src] = loads.get(src, 0) + nbytes
        for t in part.transfers:
            if o.host[t.src] != n.host[t.dst] and t.source == "old":
                sent[o.host[t.src]] = sent.get(o.host[t.src], 0) + t.box.volume * itemsizes[t.tensor]
    row["rank"] = {"index_cpu_seconds": round(index_cpu, 4), "plan_cpu_seconds": round(max(times), 4),
                   "sampled_devices": samples, "transfers": max(len(s.transfers) for s in shares),
                   "peak_traced_bytes": max(_peak(_rank, old, new, d) for d in samples),
                   "union_max_source_device_bytes": _busiest(loads), "union_max_host_send_bytes": _busiest(sent)}
    return row
