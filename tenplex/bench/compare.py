"""``tenplex bench compare``: tenplex vs a centralised transformer vs PyTorch DCP on the same resharding work.

May import: every tenplex layer, numpy, matplotlib (``--plot``) and the standard library.

The state is a GPT model with Adam moments (fp32, >= 2 GB by default) whose
every element is known (``gpt_state``). It starts under dp=2, tp=2, pp=2 on
2 hosts x 4 devices; each change moves it to another configuration with four
methods:

* ``tenplex``: one ``tenplex store serve`` process per simulated host holds
  version 1; ``tenplex.planner.plan`` and ``tenplex.transform.transform``
  (every destination pulls in parallel, committed on every host) make version 2.
* ``centralised``: the same stores and the same transformer, used the way a
  centralised transformer works: every region is gathered into full tensors
  in the first old host's store (one device there holds the whole state),
  then each destination host receives its shards from that host alone. Only
  the algorithm differs from ``tenplex``, not the transport.
* ``dcp_tmpfs`` / ``dcp_disk``: one process per device (real gloo process
  groups) ``dcp.save``s its shards under the old layout, then one process per
  new device ``dcp.load``s its boxes with resharding (``compare_dcp``). The
  save is the same for every change, so it runs once per medium and its time
  is added to every change's load; the disk checkpoint is evicted from the
  page cache before every load.

Per (change, method): ``seconds`` (wall time; tenplex and centralised include
planning; the state already sits in the stores, as after a checkpoint),
``inter_host_bytes`` (bytes that crossed hosts; for DCP, the bytes written to
and read from the checkpoint directory, which a cluster keeps on shared
storage), the plan's ``inter_host_lower_bound``, per host the bytes ``sent`` /
``received`` between hosts and ``read`` / ``written`` on its filesystem, and
the peak RSS (``VmHWM``) of every process: the store servers, or DCP's ranks,
which hold the training state. Baselines measured at the start and the end of
the same run (the mean is reported): ``raw_socket_file_gbps``, one TCP socket
from a file into a fresh file on the stores' filesystem,
``fresh_file_write_gbps``, writing such a file in one process, and
``file_copy_gbps``, copying such a file into a new one in the kernel (the
limit of a copy within a host).
``--verify`` checks every new shard bit for bit; ``--quick`` is a tiny model
that checks the command works. With ``--link-mbit N`` the store methods run on
hosts with links of their own and report what the links carried
(``compare_linked``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from .compare_cases import BASE, CHANGES, QUICK_BASE, QUICK_CHANGES, QUICK_MODEL
from .store_traffic import add_host_bytes, host_bytes, peak_rss
from .warm import add_warm_argument, warm

DESCRIPTION = "tenplex vs a centralised transformer vs DCP (tmpfs, disk) on dp, tp, pp, host and ZeRO changes"
METHODS = ("tenplex", "centralised", "dcp_tmpfs", "dcp_disk")
BASELINE_BYTES = 512 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=6, help="GPT layers (default 6: 2.1 GB with Adam)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--streams", type=int, default=None,
                        help="concurrent pulls per destination host (default: each store's own, one per CPU, 2 to 4)")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}")
    parser.add_argument("--changes", help="comma-separated 1-based indices into the changes (default: all): "
                                          + "; ".join(f"{i + 1}: {c[0]}" for i, c in enumerate(CHANGES)))
    parser.add_argument("--dir", type=Path, help="directory for stores and the tmpfs checkpoint (default /dev/shm)")
    parser.add_argument("--disk", type=Path, default=Path("/var/tmp"), help="directory for DCP on disk")
    parser.add_argument("--verify", action="store_true", help="check every new shard against the known values")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny model (checks that the command works; implies --verify)")
    parser.add_argument("--plot", type=Path, metavar="FILE", help="write a PNG bar chart of seconds per method")
    add_warm_argument(parser)
    parser.add_argument("--link-mbit", type=float,
                        help="run the store methods' hosts behind links of this many Mbit/s each way (emulated "
                             "cluster; needs root and iproute2): wire bytes, link efficiency, speedup the links allow")


def run(args: argparse.Namespace) -> list[dict]:
    from .compare_linked import link_speedups

    methods = _methods(args.methods)
    base, changes = _changes(args)
    shape = QUICK_MODEL if args.quick else {k: getattr(args, k) for k in ("layers", "hidden", "heads", "vocab")}
    old, news = _layouts(shape, base, changes)
    load_start = [round(x, 2) for x in os.getloadavg()]
    rows, baselines = _measure(args, methods, old, news, verify=args.verify or args.quick)
    results = _rows(rows, methods, shape, base, old, news, baselines,
                    {"load_average_start": load_start, "load_average": [round(x, 2) for x in os.getloadavg()]})
    link_speedups(results)
    if args.plot:
        plot(results, args.plot)
    return results


def _methods(text: str) -> list[str]:
    methods = [m for m in text.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    return methods


def _changes(args: argparse.Namespace) -> tuple[tuple, list[tuple]]:
    """The starting configuration and the changes picked by ``--changes`` (all by default; ``--quick``: tiny)."""
    from ..errors import ConfigError

    base, changes = (QUICK_BASE, QUICK_CHANGES) if args.quick else (BASE, CHANGES)
    if args.changes:
        picked = [i.strip() for i in args.changes.split(",") if i.strip()]
        if not all(i.isdigit() and 1 <= int(i) <= len(changes) for i in picked):
            raise ConfigError(f"--changes {args.changes!r} should be comma-separated numbers from 1 to {len(changes)}")
        changes = [changes[int(i) - 1] for i in picked]
    return base, changes


def _layouts(shape: dict, base: tuple, changes: list[tuple]):
    """(the old layout, {change name: new layout}) of the GPT+Adam model ``shape``."""
    from ..gpt import gpt
    from ..parallel import ParallelConfig
    from ..ptc import layout

    model = gpt(**shape, optimizer="adam")

    def make(dp, tp, pp, hosts, per_host, sharding):
        return layout(model, ParallelConfig.on_hosts(dp, tp, pp, hosts, per_host, sharding=sharding))

    return make(*base[1:]), {name: make(*config) for name, *config in changes}


def _measure(args: argparse.Namespace, methods: list[str], old, news: dict, verify: bool):
    """Run every (change, method); returns ({(change, method): raw row}, the socket-to-file, fresh-file write and
    file copy rates in GB/s, each measured at the start and at the end: on a shared machine the load drifts)."""
    from .compare_linked import run_store_method
    from .transfer import fresh_file_seconds, file_copy_seconds, socket_file_seconds

    base_dir = args.dir or (Path("/dev/shm") if Path("/dev/shm").is_dir() else None)
    rows: dict[tuple[str, str], dict] = {}
    with tempfile.TemporaryDirectory(prefix="tenplex-compare-", dir=base_dir) as tmp_name:
        tmp = Path(tmp_name)
        baseline = min(BASELINE_BYTES, max(1 << 20, old.total_bytes()))
        warm(args.warm_gb)  # the baselines write fresh files too: the same memory conditions as each method
        file_gbps = [baseline / socket_file_seconds(tmp, baseline) / 1e9]
        write_gbps = [baseline / fresh_file_seconds(tmp, baseline) / 1e9]
        copy_gbps = [baseline / file_copy_seconds(tmp, baseline) / 1e9]
        # Method by method, so that tmpfs holds one method's copies of the state at a time.
        if {"tenplex", "centralised"} & set(methods):
            from .gpt_state import write_version

            write_version(tmp / "stores", old, 1)
            for name, new in news.items():
                for method in ("tenplex", "centralised"):
                    if method in methods and args.link_mbit:
                        rows[(name, method)] = run_store_method(method, tmp / "stores", old, new, args.streams,
                                                                verify, args.link_mbit)
                    elif method in methods:
                        rows[(name, method)] = _run_store_method(method, tmp / "stores", old, new, args.streams,
                                                                 verify, args.warm_gb)
            shutil.rmtree(tmp / "stores")
        for method, where in (("dcp_tmpfs", tmp), ("dcp_disk", args.disk)):
            if method in methods:
                rows.update(_run_dcp_method(method, where, tmp, old, news, verify, args.warm_gb))
        warm(args.warm_gb)
        file_gbps.append(baseline / socket_file_seconds(tmp, baseline) / 1e9)
        write_gbps.append(baseline / fresh_file_seconds(tmp, baseline) / 1e9)
        copy_gbps.append(baseline / file_copy_seconds(tmp, baseline) / 1e9)
    return rows, {"file": file_gbps, "write": write_gbps, "copy": copy_gbps}


def _rows(rows: dict, methods: list[str], shape: dict, base: tuple, old, news: dict, baselines: dict,
          loads: dict) -> list[dict]:
    """One output row per (change, method), with the plan's statistics, the baselines and ``seconds_over_tenplex``."""
    from ..planner import plan

    file_gbps, write_gbps, copy_gbps = baselines["file"], baselines["write"], baselines["copy"]
    results = []
    for name, new in news.items():
        stats = plan(old, new).stats
        for method in methods:
            row = rows[(name, method)]
            results.append({"change": name, "method": method, "model": shape, "seconds": round(row.pop("seconds"), 3),
                            "inter_host_bytes": row.pop("inter_host_bytes"),
                            "inter_host_lower_bound": stats.inter_host_lower_bound,
                            "peak_rss_bytes": max(row["peak_rss"].values()), **row,
                            "from": base[0], "state_bytes": old.total_bytes(), "target_bytes": stats.target_bytes,
                            "raw_socket_file_gbps": round(sum(file_gbps) / 2, 3),
                            "raw_socket_file_gbps_start_end": [round(x, 3) for x in file_gbps],
                            "fresh_file_write_gbps": round(sum(write_gbps) / 2, 3),
                            "file_copy_gbps": round(sum(copy_gbps) / 2, 3), "cpus": os.cpu_count(), **loads})
    for row in results:
        tenplex = next((r for r in results if r["change"] == row["change"] and r["method"] == "tenplex"), None)
        if tenplex is not None:
            row["seconds_over_tenplex"] = round(row["seconds"] / max(tenplex["seconds"], 1e-9), 2)
    return results


def _run_store_method(method: str, root: Path, old, new, streams: int | None, verify: bool,
                      warm_gib: float = 0.0) -> dict:
    """Run one change with ``tenplex`` or ``centralised`` through fresh store servers (so their peak RSS is
    this change's); version 2 is checked (``verify``) and deleted again."""
    from ..planner import plan
    from ..store import Store
    from ..transform import transform
    from .gpt_state import mismatches
    from .centralised import central_layout

    hosts = sorted(set(old.hosts()) | set(new.hosts()))
    servers = _start_servers(root, hosts)
    stores = {h: address for h, (_, address) in servers.items()}
    try:
        warm(warm_gib)
        if method == "tenplex":
            start = time.perf_counter()
            the_plan = plan(old, new)
            report = transform(the_plan, old, new, stores, 1, 2, streams=streams)
            seconds = time.perf_counter() - start
            traffic = host_bytes(the_plan, old, new, report)
            inter = the_plan.stats.inter_host_bytes
        else:
            central = central_layout(old)
            start = time.perf_counter()
            gather = plan(old, central)
            gathered = transform(gather, old, central, stores, 1, 3, streams=streams)
            scatter = plan(central, new)
            scattered = transform(scatter, central, new, stores, 3, 2, streams=streams)
            seconds = time.perf_counter() - start
            traffic = add_host_bytes(host_bytes(gather, old, central, gathered),
                                     host_bytes(scatter, central, new, scattered))
            inter = gather.stats.inter_host_bytes + scatter.stats.inter_host_bytes
        peak = {f"store {h}": peak_rss(proc.pid) for h, (proc, _) in servers.items()}
    finally:
        _stop_servers(servers)
    wrong = mismatches(root, new, 2) if verify else []
    for h in hosts:
        for version in (2, 3):
            Store(root / h, h).delete(version)
    row = {"seconds": seconds, "inter_host_bytes": inter, "hosts": traffic, "peak_rss": peak}
    if verify:
        row["mismatches"] = wrong
    return row


def _run_dcp_method(method: str, where: Path, tmp: Path, old, news: dict, verify: bool,
                    warm_gib: float = 0.0) -> dict:
    """DCP save once under ``old`` into ``where``, then a load per change; rows keyed (change, method)."""
    from ..files import save_layout
    from .compare_dcp import run_dcp

    work = Path(tempfile.mkdtemp(prefix="tenplex-compare-dcp-", dir=tmp))
    checkpoint = Path(tempfile.mkdtemp(prefix="tenplex-compare-dcp-", dir=where))
    rows = {}
    try:
        save_layout(old, work / "old.json")
        warm(warm_gib)
        saved = run_dcp(work / "old.json", "save", checkpoint, work / "save")
        for i, (name, new) in enumerate(news.items()):
            save_layout(new, work / f"new-{i}.json")
            warm(warm_gib)
            loaded = run_dcp(work / f"new-{i}.json", "load", checkpoint, work / f"load-{i}", verify=verify,
                             drop_cache=method == "dcp_disk")
            traffic = {}
            for h in sorted(set(saved["hosts"]) | set(loaded["hosts"])):
                written = saved["hosts"].get(h, {}).get("written", 0) + loaded["hosts"].get(h, {}).get("written", 0)
                read = saved["hosts"].get(h, {}).get("read", 0) + loaded["hosts"].get(h, {}).get("read", 0)
                # on shared storage every byte written or read crosses the host's link
                traffic[h] = {"sent": written, "received": read, "read": read, "written": written}
            row = {"seconds": saved["seconds"] + loaded["seconds"],
                   "inter_host_bytes": sum(t["sent"] + t["received"] for t in traffic.values()),
                   "save_seconds": round(saved["seconds"], 3), "load_seconds": round(loaded["seconds"], 3),
                   "hosts": traffic,
                   "peak_rss": {**{f"save {d}": b for d, b in saved["peak_rss"].items()},
                                **{f"load {d}": b for d, b in loaded["peak_rss"].items()}}}
            if verify:
                row["mismatches"] = loaded["mismatches"]
            rows[(name, method)] = row
    finally:
        shutil.rmtree(checkpoint, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return rows


def _start_servers(root: Path, hosts: list[str], timeout: float = 60.0) -> dict:
    """One ``tenplex store serve`` per host, started at once; {host: (process, address)}."""
    from ..runtime.hosts import await_store, spawn_store

    procs = {}
    try:
        for h in hosts:
            (root / h).mkdir(parents=True, exist_ok=True)
            procs[h] = spawn_store(root / h, h, root / f"{h}.port")
        deadline = time.monotonic() + timeout
        addresses = {h: await_store(proc, h, root / f"{h}.port", deadline) for h, proc in procs.items()}
    except BaseException:
        _stop_servers({h: (proc, "") for h, proc in procs.items()})
        raise
    return {h: (proc, addresses[h]) for h, proc in procs.items()}


def _stop_servers(servers: dict) -> None:
    for proc, _ in servers.values():
        proc.terminate()
    for proc, _ in servers.values():
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def table(results: list[dict]) -> str:
    """The readable form: one line per (change, method)."""
    if not results:
        return "no results"
    first = results[0]
    lines = [f"state {first['state_bytes'] / 1e9:.3g} GB from {first['from']}; raw socket -> file "
             f"{first['raw_socket_file_gbps']} GB/s; load average {first['load_average']}",
             f"{'change':<18} {'method':<12} {'seconds':>8} {'x tenplex':>9} {'inter-host GB':>13} "
             f"{'lower bound GB':>14} {'peak RSS GB':>11}"]
    for r in results:
        ratio = r.get("seconds_over_tenplex")
        lines.append(f"{r['change']:<18} {r['method']:<12} {r['seconds']:>8.2f} "
                     f"{'' if ratio is None else f'{ratio:.2f}':>9} {r['inter_host_bytes'] / 1e9:>13.2f} "
                     f"{r['inter_host_lower_bound'] / 1e9:>14.2f} {r['peak_rss_bytes'] / 1e9:>11.2f}")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    """A PNG bar chart: seconds per method, grouped by change."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install 'tenplex[bench]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    changes = list(dict.fromkeys(r["change"] for r in results))
    methods = list(dict.fromkeys(r["method"] for r in results))
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(changes)), 4.5))
    for i, method in enumerate(methods):
        seconds = [next((r["seconds"] for r in results if r["change"] == c and r["method"] == method), 0)
                   for c in changes]
        bars = ax.bar([j + (i - (len(methods) - 1) / 2) * width for j in range(len(changes))], seconds, width,
                      label=method)
        ax.bar_label(bars, fmt="%.3g", fontsize=7)
    ax.set_xticks(range(len(changes)), changes, rotation=15, fontsize=8)
    ax.set_ylabel("seconds (lower is better)")
    first = results[0]
    ax.set_title(f"resharding {first['state_bytes'] / 1e9:.3g} GB GPT+Adam from {first['from']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
