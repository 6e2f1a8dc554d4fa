"""One canonical copy of every replicated buffer: the values of the lowest rank that holds it.

May import: ``tenplex.box`` and this package's :mod:`.pieces` and :mod:`.exchange`, torch and
torch.distributed.

Data-parallel replicas of a parameter are identical: the optimizer applies the same averaged gradients
everywhere. Buffers need not be: BatchNorm's running statistics under DDP or FSDP2 without SyncBatchNorm
are updated by each rank from its own batches (DDP overwrites them with rank 0's at the next forward).
A save writes one copy per host, and a restore reads each region from one copy, its own host's or one
the planner picks; copies that differ would give a new rank some mix that no rank ever held. So, at every
save, the buffers' values of the lowest rank holding each box (data-parallel rank 0, whose copy DCP keeps
too) are broadcast and written by every host's writer. Only buffers are sent (they are small); the live
buffers of the ranks are left as they are, so saving does not change training.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..box import Box
from .exchange import collective_device
from .pieces import Piece


def canonical_sends(docs, writers: dict[tuple[str, str, Box], int]) -> list[tuple[int, str, Box]]:
    """(source rank, buffer, box) for every buffer box that a writer on a host other than the source's
    writes, in one order on every rank. The source is the lowest rank holding the box."""
    buffers = {name for d in docs for name in d["buffers"]}
    holders: dict[tuple[str, Box], int] = {}
    for rank, d in enumerate(docs):
        for name, offsets, lengths in d["boxes"]:
            if name in buffers:
                holders.setdefault((name, Box(tuple(offsets), tuple(lengths))), rank)
    writing_hosts: dict[tuple[str, Box], set[str]] = {}
    for host, name, box in writers:
        if (name, box) in holders:
            writing_hosts.setdefault((name, box), set()).add(host)
    sends = []
    for (name, box), src in sorted(holders.items(), key=lambda kv: (kv[1], kv[0][0], kv[0][1])):
        if writing_hosts[(name, box)] - {docs[src]["host"]}:
            sends.append((src, name, box))
    return sends


def canonical_buffers(pieces: list[Piece], docs, writers: dict[tuple[str, str, Box], int], rank: int,
                      group=None, sends: list[tuple[int, str, Box]] | None = None) -> dict[tuple[str, Box], Piece]:
    """The pieces this rank writes in place of its own buffers' (the canonical values). Collective: one
    broadcast of the concatenated bytes per source rank. ``sends``: :func:`canonical_sends`, when known."""
    sends = canonical_sends(docs, writers) if sends is None else sends
    if not sends:
        return {}
    mine = {(p.name, p.box): p for p in pieces}
    host = docs[rank]["host"]
    by_src: dict[int, list[tuple[str, Box]]] = {}
    for src, name, box in sends:
        by_src.setdefault(src, []).append((name, box))
    device = collective_device(group)
    replaced: dict[tuple[str, Box], Piece] = {}
    for src, keys in sorted(by_src.items()):
        sizes = [k[1].volume * getattr(torch, docs[src]["tensors"][k[0]][1]).itemsize for k in keys]
        if rank == src:
            flat = torch.cat([mine[k].read().reshape(-1).view(torch.uint8) for k in keys]).to(device)
        else:
            flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        dist.broadcast(flat, src=dist.get_global_rank(group, src) if group is not None else src, group=group)
        offset = 0
        for key, size in zip(keys, sizes):
            if writers.get((host, *key)) == rank and rank != src:
                piece = mine[key]
                values = flat[offset:offset + size].cpu().clone().view(getattr(torch, piece.spec.dtype))
                values = values.reshape(piece.box.lengths)
                replaced[key] = Piece(piece.name, piece.spec, piece.box, Box.whole(piece.box.lengths), values)
            offset += size
    return replaced
