"""The GPU path of shard I/O: staged saves and restores through pooled host buffers, slab by slab.

Every test runs on each device of ``DEVICES``: the CPU (where the staged
path is called directly: it is the same code, with synchronous copies) and
CUDA where it is present (through ``write_piece``/``read_piece``, pinned and
pageable staging); the CUDA cases skip cleanly without it, as in CI.
``scripts/gpu-check`` runs this file on a GPU machine. Real stores, real files.
"""

from __future__ import annotations

import threading
from contextlib import closing

import pytest
import torch

from tenplex.box import Box
from tenplex.integration import Annotation, staging
from tenplex.integration.pieces import tensor_pieces
from tenplex.integration.readthrough import read_through
from tenplex.integration.shardio import read_piece, read_staged, write_piece, write_staged
from tenplex.layout import Layout, Shard, TensorSpec
from tenplex.planner import plan
from tenplex.store import Store

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="no CUDA device"))]
SLAB = 4096  # small slabs, so that every piece below spans many


@pytest.fixture(params=[True, False], ids=["pinned", "pageable"])
def small_slabs(request, monkeypatch):
    """Staging with SLAB-byte buffers, pinned or pageable (the same where CUDA is absent), in a fresh pool."""
    monkeypatch.setattr(staging, "SLAB_BYTES", SLAB)
    monkeypatch.setattr(staging, "_pools", {})
    staging.use_pinned(request.param)
    yield
    staging.use_pinned(True)


def save(store: Store, device: str, pieces, version: int = 1) -> None:
    with store.begin(version) as writer:
        for piece in pieces:
            (write_staged if device == "cpu" else write_piece)(writer, "h0/0", piece)
        writer.commit()


def restore(reader, pieces, device: str) -> None:
    for piece in pieces:
        if device == "cpu":
            read_staged(reader, "h0/0", piece.name, piece.box, piece.local[piece.local_box.slices()])
        else:
            read_piece(reader, [("h0/0", piece.box)], piece)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().cpu().contiguous().view(torch.uint8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_staged_save_and_restore_are_bit_for_bit_with_bounded_buffers(tmp_path, device, dtype, small_slabs):
    store = Store(tmp_path, "h0")
    values = (torch.randn(96, 40) * 1e3).to(dtype).to(device)  # 15 KiB..30 KiB: 4 to 8 slabs
    if dtype.is_floating_point:  # a parameter, as the checkpointer saves and restores them (autograd on)
        values = torch.nn.Parameter(values)
    save(store, device, tensor_pieces("w", values))
    with closing(store.open(1)) as reader:
        assert torch.equal(bits(torch.from_numpy(reader.read("h0/0", "w", Box.whole((96, 40))).copy())),
                           bits(values))
        target = torch.full_like(values, 7)
        if dtype.is_floating_point:
            target = torch.nn.Parameter(target)
        restore(reader, tensor_pieces("w", target), device)
    assert torch.equal(bits(target), bits(values))
    # One buffer per thread (and on CUDA per copy still running): never a host copy of the piece.
    assert staging.pool().made <= (staging.THREADS if device == "cpu" else staging.BUFFERS)


@pytest.mark.parametrize("device", DEVICES)
def test_a_column_block_is_saved_and_restored_in_place(tmp_path, device, small_slabs):
    """Non-contiguous regions (a Megatron-style column shard of a wider local tensor) go through staging too."""
    store = Store(tmp_path, "h0")
    local = torch.randn(64, 48, device=device)
    shard = local[:, 16:40]  # a view with row stride 48: the piece saved is columns 16..40
    pieces = tensor_pieces("w", shard, Annotation((64, 24), (0, 0)))
    save(store, device, pieces)
    target = torch.full((64, 48), 7.0, device=device)
    with closing(store.open(1)) as reader:
        restore(reader, tensor_pieces("w", target[:, 8:32], Annotation((64, 24), (0, 0))), device)
    assert torch.equal(target[:, 8:32].cpu(), shard.cpu())
    assert torch.all(target[:, :8] == 7.0) and torch.all(target[:, 32:] == 7.0)  # nothing else written


@pytest.mark.parametrize("device", DEVICES)
def test_read_through_with_threads_restores_every_slab(tmp_path, device, small_slabs, monkeypatch):
    """read_through's threads share the pool; the caller's stream sees every copy when it returns."""
    from tenplex.integration import readthrough

    monkeypatch.setattr(readthrough, "SLAB_BYTES", SLAB)
    full = torch.randn(128, 32)
    specs = {"w": TensorSpec((128, 32), "float32")}
    old = Layout.build(specs, {"h0/0": [Shard("w", Box((0, 0), (64, 32)))],
                               "h0/1": [Shard("w", Box((64, 0), (64, 32)))]})
    new = Layout.build(specs, {"h0/2": [Shard("w", Box.whole((128, 32)))]})
    store = Store(tmp_path, "h0")
    with store.begin(1) as writer:
        for dev, (shard,) in old.devices.items():
            part = full[shard.box.slices()].contiguous()
            write_piece(writer, dev, *tensor_pieces("w", part, Annotation((128, 32), shard.box.offsets)))
        writer.commit()
    target = torch.zeros(128, 32, device=device)
    with closing(store.open(1)) as reader:
        moved = read_through(plan(old, new), "h0/2", tensor_pieces("w", target), {"h0": reader}, threads=4)
    assert moved == full.numel() * 4 and torch.equal(target.cpu(), full)


def test_the_pool_reuses_its_buffers_and_waits_when_all_are_taken():
    assert (staging.SLAB_BYTES, staging.BUFFERS, staging.THREADS) == (64 << 20, 6, 4)  # documented (README)
    buffers = staging.HostBuffers(SLAB, pinned=False, count=1)
    first = buffers.take(SLAB)
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(buffers.take(100)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not got  # the only buffer is taken: the second taker waits
    buffers.give(first)
    waiter.join()
    assert got == [first] and buffers.made == 1
    with pytest.raises(ValueError, match="exceeds the staging slab"):
        buffers.take(SLAB + 1)
