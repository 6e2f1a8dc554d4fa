"""``tenplex bench simulate``: a model of a reconfiguration's time on a real cluster, from the plan's exact bytes.

May import: ``tenplex.gpt``, ``tenplex.ptc``, ``tenplex.parallel``, ``tenplex.planner``,
``tenplex.layout``, ``tenplex.box``, ``tenplex.devices`` and the standard library. Pure
arithmetic over plans: no I/O besides reading ``--validate``'s file.

Inputs: the hosts of both layouts, every host's link rate (the same in and
out, ``--link-gbit``), the aggregate bandwidth of shared storage
(``--storage-gbps``), optionally an aggregate limit on all links at once
(``--fabric-gbps``: one machine's loopback, for instance) and the plan's
exact per-host bytes, and for one machine a rate at which a host writes new
shards into its store (``--write-gbps``, 5 GB/s by default: tmpfs). Methods:

* ``tenplex``: every host sends, receives and writes at once; the time is
  the longest of: the busiest link's bytes (max over hosts of bytes out and
  bytes in) over the link rate, the busiest host's written bytes (all but
  those it links: whole old shards, and slices of them, see ``linked``) over
  the write rate, and all written bytes over the fabric.
* ``centralised``: the same for the gather plan (old layout -> every tensor
  whole on the first old host) followed by the scatter plan (from there to
  the new layout): everything goes into one host and back out of it.
* ``dcp_shared``: every distinct box of the old state is written once to
  shared storage (by the least-loaded host holding it, as DCP's save
  planner balances replicas), then every new device reads its boxes; each
  phase is bounded by the busiest host's link or the storage's aggregate
  bandwidth.

CPU and start-up costs are not modelled: on a cluster the links dominate.
``--validate FILE`` compares the model with the measured tenplex and
centralised rows of ``tenplex bench compare --json``. There all "hosts" are
one machine whose cores do every copy in turn: copies between hosts at that
run's ``raw_socket_file_gbps`` (the link and the fabric), copies within a
host at its ``file_copy_gbps`` (a file copied into a new one; runs that did
not measure it: ``fresh_file_write_gbps``, which reads nothing and so
flatters a copy).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

DESCRIPTION = "model reconfiguration time on a cluster (tenplex, centralised, DCP on shared storage) from plans"

# The paper's models (fp32 parameters + Adam moments: 12 bytes per parameter) and changes on 4 hosts x 4 GPUs,
# as (tp, pp, dp) -> (tp, pp, dp). GPT-3 XL is the 1.3B model; its dp change is the paper's 8 -> 16 GPUs.
PAPER_MODELS = {"GPT-3 1.3B": (24, 2048, 16), "GPT-3 2.7B": (32, 2560, 32), "GPT-3 6.7B": (32, 4096, 32)}
PAPER_CHANGES = [("dp 1->2 (8->16 GPUs)", (4, 2, 1), (4, 2, 2)),
                 ("tp 2->4", (2, 2, 4), (4, 2, 2)),
                 ("pp 2->4", (4, 2, 2), (4, 4, 1))]
# What the paper measured (Tenplex vs Tenplex-Central): seconds for the pp changes, ratios for dp and tp.
PAPER_SECONDS = {("GPT-3 1.3B", "pp 2->4"): (4.6, 4.6), ("GPT-3 2.7B", "pp 2->4"): (5.9, 18.2),
                 ("GPT-3 6.7B", "pp 2->4"): (10.8, 38.0)}
PAPER_RATIOS = {"dp 1->2 (8->16 GPUs)": "3.2-4.0", "tp 2->4": "2.8-3.7"}
# GPT-3 175B on 1,024 GPUs (128 hosts x 8), as in `tenplex bench plan`: (dp, tp, pp, hosts, sharding).
LARGE = ("GPT-3 175B", (96, 12288, 96), (8, 8, 16, 128, "none"),
         [("dp/pp change: pp 16->8", (16, 8, 8, 128, "none")),
          ("tp/dp change: tp 8->4", (16, 4, 16, 128, "none")),
          ("lose one dp replica (16 hosts)", (7, 8, 16, 112, "none")),
          ("ZeRO-1 on", (8, 8, 16, 128, "optimizer"))])
VOCAB = 50257


@dataclass(frozen=True)
class Cluster:
    link_gbps: float                 # GB/s per host, each direction
    storage_gbps: float              # GB/s of shared storage, all hosts together
    fabric_gbps: float = math.inf    # GB/s of all inter-host copies at once (inf: a non-blocking network)
    write_gbps: float = math.inf     # GB/s one host writes new shards (inf: the links dominate)
    local_fabric_gbps: float = math.inf  # GB/s of all copies within hosts at once (one machine's cores)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--link-gbit", type=float, default=100.0, help="per-host link, Gbit/s each way (default 100)")
    parser.add_argument("--storage-gbps", type=float, default=10.0,
                        help="aggregate shared-storage bandwidth, GB/s (default 10)")
    parser.add_argument("--fabric-gbps", type=float, default=math.inf,
                        help="aggregate of all links at once, GB/s (default: unlimited)")
    parser.add_argument("--write-gbps", type=float, default=5.0,
                        help="rate one host writes new shards into its store (tmpfs), GB/s (default 5)")
    parser.add_argument("--cases", default="paper,large", help="paper (the paper's models), large (175B on 1,024 "
                                                               "GPUs) or both, comma-separated (default both)")
    parser.add_argument("--validate", type=Path, metavar="COMPARE.jsonl",
                        help="instead: model the tenplex and centralised rows of `tenplex bench compare --json`")


def plan_seconds(the_plan, old, new, cluster: Cluster) -> float:
    """Seconds of a plan when every host sends, receives and writes at once: the busiest link (bytes out or
    in), the busiest host's writes (every byte but what the transformer links: see :func:`linked`), or all
    copies over the fabric."""
    from ..devices import host_of

    itemsizes = {name: spec.itemsize for name, spec in old.tensors.items()}
    traffic = the_plan.host_traffic(itemsizes)
    busiest = max((max(sent, received) for sent, received in traffic.values()), default=0)
    new_shards = {(device, s.tensor, s.box) for device, s in new.iter_shards()}
    held: dict[tuple[str, str], list] = {}  # (host, tensor) -> its old boxes there
    for device, s in old.iter_shards():
        held.setdefault((host_of(device), s.tensor), []).append(s.box)
    written: dict[str, int] = {}
    inter = local = 0
    for t in the_plan.transfers:
        if not linked(t, held, new_shards):
            nbytes = t.box.volume * itemsizes[t.tensor]
            written[host_of(t.dst)] = written.get(host_of(t.dst), 0) + nbytes
            if t.crosses_hosts:
                inter += nbytes
            else:
                local += nbytes
    return max(busiest / (cluster.link_gbps * 1e9), max(written.values(), default=0) / (cluster.write_gbps * 1e9),
               inter / (cluster.fabric_gbps * 1e9) + local / (cluster.local_fabric_gbps * 1e9))


def linked(t, held: dict, new_shards: set) -> bool:
    """Whether the transformer hard-links transfer ``t`` instead of writing its bytes: it alone fills a new shard
    (``new_shards``: (device, tensor, box)), from old shards on its own host (``held``: (host, tensor) -> old
    boxes there) one of which it is whole or one contiguous run of bytes of (a slice row)."""
    from ..devices import host_of

    if t.source != "old" or t.crosses_hosts or (t.dst, t.tensor, t.box) not in new_shards:
        return False
    return any(t.box.is_run_of(box) for box in held.get((host_of(t.src), t.tensor), ()))


def seconds(old, new, cluster: Cluster) -> dict[str, float]:
    """Modelled seconds of each method for old -> new."""
    from ..planner import plan
    from .centralised import central_layout

    central = central_layout(old)
    return {"tenplex_s": plan_seconds(plan(old, new), old, new, cluster),
            "centralised_s": plan_seconds(plan(old, central), old, central, cluster)
            + plan_seconds(plan(central, new), central, new, cluster),
            "dcp_shared_s": dcp_shared_seconds(old, new, cluster)}


def dcp_shared_seconds(old, new, cluster: Cluster) -> float:
    from ..devices import host_of

    written: dict[str, int] = {h: 0 for h in old.hosts()}
    for name in sorted(old.tensors):
        holders: dict[tuple, set[str]] = {}
        for device, box in old.shards_of(name):
            holders.setdefault((box.offsets, box.lengths), set()).add(host_of(device))
        for (_, lengths), hosts in sorted(holders.items()):
            writer = min(sorted(hosts), key=lambda h: written[h])  # DCP balances replicas across ranks
            written[writer] += math.prod(lengths) * old.tensors[name].itemsize
    read = {h: sum(new.device_bytes(d) for d in new.devices if host_of(d) == h) for h in new.hosts()}

    def phase(per_host: dict[str, int]) -> float:
        return max(max(per_host.values()) / (cluster.link_gbps * 1e9),
                   sum(per_host.values()) / (cluster.storage_gbps * 1e9),
                   sum(per_host.values()) / (cluster.fabric_gbps * 1e9))

    return phase(written) + phase(read)


def run(args: argparse.Namespace) -> list[dict]:
    cluster = Cluster(args.link_gbit / 8, args.storage_gbps, args.fabric_gbps, args.write_gbps)
    if args.validate:
        return validate(args.validate)
    cases = {c.strip() for c in args.cases.split(",") if c.strip()}
    unknown = sorted(cases - {"paper", "large"})
    if unknown:
        raise ValueError(f"unknown --cases {unknown}; choose paper, large or both")
    rows = []
    if "paper" in cases:
        rows += paper_rows(cluster)
    if "large" in cases:
        rows += large_rows(cluster)
    return rows


def _layout(model, dp: int, tp: int, pp: int, hosts: int, sharding: str = "none"):
    from ..parallel import ParallelConfig
    from ..ptc import layout

    world = dp * tp * pp
    return layout(model, ParallelConfig.on_hosts(dp, tp, pp, hosts, world // hosts, sharding=sharding))


def _row(name: str, change: str, old, new, cluster: Cluster) -> dict:
    modelled = seconds(old, new, cluster)
    row = {"model": name, "change": change, **{k: round(v, 3) for k, v in modelled.items()},
           "centralised_over_tenplex": round(modelled["centralised_s"] / modelled["tenplex_s"], 2)
           if modelled["tenplex_s"] else None,
           "state_bytes": old.total_bytes(), "old_hosts": len(old.hosts()), "new_hosts": len(new.hosts()),
           "link_gbit": round(cluster.link_gbps * 8, 3), "storage_gbps": cluster.storage_gbps,
           "write_gbps": cluster.write_gbps}
    if math.isfinite(cluster.fabric_gbps):
        row["fabric_gbps"] = cluster.fabric_gbps
    return row


def paper_rows(cluster: Cluster) -> list[dict]:
    from ..gpt import gpt

    rows = []
    for name, (layers, hidden, heads) in PAPER_MODELS.items():
        model = gpt(layers, hidden, heads, VOCAB, optimizer="adam")
        for change, (tp0, pp0, dp0), (tp1, pp1, dp1) in PAPER_CHANGES:
            old = _layout(model, dp0, tp0, pp0, dp0 * tp0 * pp0 // 4)
            new = _layout(model, dp1, tp1, pp1, dp1 * tp1 * pp1 // 4)
            row = _row(name, f"{change}: (tp,pp,dp) ({tp0},{pp0},{dp0})->({tp1},{pp1},{dp1})", old, new, cluster)
            if (name, change) in PAPER_SECONDS:
                row["paper_tenplex_s"], row["paper_centralised_s"] = PAPER_SECONDS[(name, change)]
                row["paper_centralised_over_tenplex"] = round(row["paper_centralised_s"] / row["paper_tenplex_s"], 2)
            if change in PAPER_RATIOS:
                row["paper_centralised_over_tenplex"] = PAPER_RATIOS[change]
            rows.append(row)
    return rows


def large_rows(cluster: Cluster) -> list[dict]:
    from ..gpt import gpt

    name, (layers, hidden, heads), base, changes = LARGE
    model = gpt(layers, hidden, heads, VOCAB, optimizer="adam")
    old = _layout(model, *base)
    return [_row(name, f"{change} (1,024 GPUs, 128 hosts x 8)", old, _layout(model, *config), cluster)
            for change, config in changes]


def validate(path: Path) -> list[dict]:
    """Model each tenplex and centralised row of a ``bench compare --json`` file with its own measured rate."""
    from .compare_cases import BASE, CHANGES, QUICK_BASE, QUICK_CHANGES
    from ..gpt import gpt

    rows = []
    for line in path.read_text().splitlines():
        if not line.startswith("{"):
            continue
        measured = json.loads(line)
        if measured["method"] not in ("tenplex", "centralised"):
            continue
        shape = measured.get("model") or {"layers": 6, "hidden": 1024, "heads": 16, "vocab": VOCAB}
        model = gpt(**shape, optimizer="adam")
        quick = measured["from"] == QUICK_BASE[0]
        base, changes = (QUICK_BASE, QUICK_CHANGES) if quick else (BASE, CHANGES)
        config = next(c[1:] for c in changes if c[0] == measured["change"])
        old = _layout(model, base[1], base[2], base[3], base[4], base[6])
        new = _layout(model, config[0], config[1], config[2], config[3], config[5])
        rate = measured["raw_socket_file_gbps"]
        local = measured.get("file_copy_gbps") or measured.get("fresh_file_write_gbps", rate)
        # one machine: its cores do every copy in turn, between "hosts" at the socket-to-file rate, within
        # one at the rate of copying a file into a new one
        modelled = seconds(old, new, Cluster(rate, math.inf, rate, math.inf, local))[f"{measured['method']}_s"]
        rows.append({"model": f"compare: {old.total_bytes() / 1e9:.2f} GB GPT+Adam", "change": measured["change"],
                     "method": measured["method"], "measured_s": measured["seconds"], "modelled_s": round(modelled, 4),
                     "measured_over_modelled": round(measured["seconds"] / modelled, 2) if modelled else None,
                     "link_gbps": rate, "fabric_gbps": rate, "local_fabric_gbps": local})
    return rows
