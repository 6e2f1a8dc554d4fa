"""Exchange JSON documents between ranks without pickling.

May import: ``tenplex.errors``, torch, torch.distributed and the standard library.

``all_gather_object`` and ``broadcast_object_list`` pickle, and unpickling
what another process sent is unsafe. These helpers encode a JSON document as
UTF-8 bytes in a uint8 tensor: first the lengths are exchanged, then the bytes
(padded to the longest), on the device the process group's backend needs
(CUDA for NCCL, CPU otherwise).
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from ..errors import TenplexError


def collective_device(group) -> torch.device:
    """Where the process group's backend wants tensors: CUDA for NCCL, CPU otherwise."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _encode(doc: Any, device: torch.device) -> torch.Tensor:
    data = json.dumps(doc, separators=(",", ":")).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)  # never empty: JSON has >= 1 byte


def _decode(tensor: torch.Tensor, length: int) -> Any:
    return json.loads(bytes(tensor[:length].cpu().numpy().tobytes()).decode())


def all_gather_json(doc: Any, group=None) -> list[Any]:
    """Every rank's ``doc``, in rank order of ``group``, on every rank."""
    device = collective_device(group)
    data = _encode(doc, device)
    world = dist.get_world_size(group)
    length = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    lengths = [torch.zeros_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    sizes = [int(n.item()) for n in lengths]
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    padded[:data.numel()] = data
    gathered = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return [_decode(t, n) for t, n in zip(gathered, sizes)]


class JsonGather:
    """:func:`all_gather_json` in one collective when the documents fit, for a caller that gathers documents of
    similar sizes again and again: every rank sends its document in a buffer of the agreed capacity, its length
    in front. The capacity is what every rank derives from the last gather's lengths (the longest, rounded up to
    a power of two), so it is the same on every rank; a longer document (the first time, a new kind) makes every
    rank send again, padded to the longest."""

    def __init__(self) -> None:
        self.capacity = 0

    def __call__(self, doc: Any, group=None) -> list[Any]:
        device = collective_device(group)
        data = _encode(doc, torch.device("cpu"))
        world = dist.get_world_size(group)
        buffer = torch.zeros(8 + self.capacity, dtype=torch.uint8)
        buffer[:8] = torch.tensor([data.numel()], dtype=torch.int64).view(torch.uint8)
        if data.numel() <= self.capacity:
            buffer[8:8 + data.numel()] = data
        gathered = [torch.empty_like(buffer, device=device) for _ in range(world)]
        dist.all_gather(gathered, buffer.to(device), group=group)
        lengths = [int(t[:8].cpu().view(torch.int64).item()) for t in gathered]
        bodies = [t[8:] for t in gathered]
        longest = max(lengths)
        if longest > self.capacity:
            padded = torch.zeros(longest, dtype=torch.uint8)
            padded[:data.numel()] = data
            bodies = [torch.empty_like(padded, device=device) for _ in range(world)]
            dist.all_gather(bodies, padded.to(device), group=group)
        self.capacity = 1 << (longest - 1).bit_length()  # room for the next ones, the same on every rank
        return [_decode(t, n) for t, n in zip(bodies, lengths)]


def broadcast_json(doc: Any, src: int = 0, group=None) -> Any:
    """``doc`` of global rank ``src`` on every rank (other ranks' ``doc`` is ignored)."""
    device = collective_device(group)
    is_src = dist.get_rank() == src
    data = _encode(doc if is_src else None, device)
    length = torch.tensor([data.numel() if is_src else 0], dtype=torch.int64, device=device)
    dist.broadcast(length, src=src, group=group)
    buffer = data if is_src else torch.zeros(int(length.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src=src, group=group)
    return _decode(buffer, int(length.item()))


class CollectiveError(TenplexError, RuntimeError):
    """A coordinated step failed on some ranks; raised on every rank, listing each failure."""


def agree(what: str, fn, group=None):
    """Run ``fn()`` on every rank; if it raised anywhere, raise one error listing every failed rank, everywhere.

    A rank that fails alone would otherwise leave the others waiting in the next
    collective. A failed rank re-raises its own error when every failure says the
    same (so callers can catch e.g. StateMismatchError); otherwise, and on the
    ranks that did not fail, a CollectiveError lists them all.
    """
    result, error = None, None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 -- reported to every rank below
        error = e
    mine = None if error is None else {"type": type(error).__name__, "message": str(error)}
    reports = all_gather_json(mine, group)
    failed = [(rank, r) for rank, r in enumerate(reports) if r is not None]
    if not failed:
        return result
    lines = "; ".join(f"rank {rank}: {r['type']}: {r['message']}" for rank, r in failed[:8])
    more = f" (and {len(failed) - 8} more)" if len(failed) > 8 else ""
    messages = {r["message"] for _, r in failed}
    if error is not None and len(messages) == 1:
        raise error  # one failure, or the same one on every failed rank: keep its type and message
    raise CollectiveError(f"{what} failed on {len(failed)} of {len(reports)} ranks: {lines}{more}")
