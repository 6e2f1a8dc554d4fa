"""What a store method of ``tenplex bench compare`` moved per host, and its stores' peak memory.

May import: ``tenplex.devices`` and the standard library.
"""

from __future__ import annotations

from pathlib import Path


def host_bytes(the_plan, old, new, report: dict) -> dict[str, dict[str, int]]:
    """Per host: bytes sent and received between hosts, read from its old shards and written into new ones
    (a shard kept by hard link is neither read nor written; a slice of a linked file is read, to verify it,
    but not written)."""
    from ..devices import host_of

    size = {name: spec.itemsize for name, spec in new.tensors.items()}
    hosts = sorted(set(old.hosts()) | set(new.hosts()))
    out = {h: {"sent": 0, "received": 0, "read": 0, "written": 0} for h in hosts}
    for t in the_plan.transfers:
        nbytes = t.box.volume * size[t.tensor]
        src, dst = host_of(t.src), host_of(t.dst)
        out[src]["read"] += nbytes
        out[dst]["written"] += nbytes
        if src != dst:
            out[src]["sent"] += nbytes
            out[dst]["received"] += nbytes
    for h, moved in report["hosts"].items():
        out[h]["read"] -= moved["linked_bytes"] - moved["sliced_bytes"]
        out[h]["written"] -= moved["linked_bytes"]
    return out


def add_host_bytes(a: dict, b: dict) -> dict:
    return {h: {k: a.get(h, {}).get(k, 0) + b.get(h, {}).get(k, 0) for k in ("sent", "received", "read", "written")}
            for h in sorted(set(a) | set(b))}


def peak_rss(pid: int) -> int:
    """Peak resident set (VmHWM) of a live process, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0
