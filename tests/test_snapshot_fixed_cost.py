"""What keeps a snapshot's fixed cost down must not keep a stale view of the state (issue 40 item 2).

The pieces are cached while the state's structure is the same (:mod:`tenplex.integration.snapshot_pieces`): a
replaced parameter, a swapped ``.data``, a new optimizer state or a new parameter group are seen at once. Staging
copies run through views made once per piece (:mod:`tenplex.integration.snapshot_buffers`): they follow the
memory when it changes and copy every dtype bit for bit. The snapshot's all-gather sends unchanged RNG streams as a
word and grows its agreed capacity when a document is longer (:mod:`tenplex.integration.snapshot_round`).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

from tenplex.integration.layouts import state_pieces
from tenplex.ports import free_port
from tenplex.integration.snapshot_buffers import SnapshotBuffers
from tenplex.integration.snapshot_pieces import PiecesCache


def model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    return model, torch.optim.Adam(model[0].parameters(), lr=0.1)  # the LayerNorm's join later


def step(model, optimizer):
    model(torch.randn(2, 4)).square().sum().backward()
    optimizer.step()


def described(pieces):
    return [(p.name, p.box, p.local_box, p.spec, p.version, p.local.data_ptr()) for p in pieces]


def fresh(model, optimizer):
    return [p for p in state_pieces(model, optimizer, None) if not p.box.is_empty()]


def test_cached_pieces_are_the_fresh_ones_and_follow_every_change_of_structure():
    model, optimizer = model_and_optimizer()
    cache = PiecesCache()
    assert described(cache.pieces(model, optimizer, None)) == described(fresh(model, optimizer))
    assert not any(p.name.startswith("optim.") for p in cache.pieces(model, optimizer, None))
    step(model, optimizer)  # Adam's moments appear: a new structure
    assert described(cache.pieces(model, optimizer, None)) == described(fresh(model, optimizer))
    generation = cache.generation
    step(model, optimizer)  # values and version counters change, nothing else: the cache answers
    assert described(cache.pieces(model, optimizer, None)) == described(fresh(model, optimizer))
    assert cache.generation is generation and generation is not None
    with torch.no_grad():
        model[0].weight.data = torch.zeros(3, 4)  # same shape, other memory
    assert described(cache.pieces(model, optimizer, None)) == described(fresh(model, optimizer))
    assert cache.generation is not generation
    model[0].bias = optimizer.param_groups[0]["params"][1] = torch.nn.Parameter(torch.ones(3))  # replaced
    got = cache.pieces(model, optimizer, None)
    assert described(got) == described(fresh(model, optimizer))
    assert any(p.name == "0.bias" and p.local is model[0].bias for p in got)
    optimizer.add_param_group({"params": list(model[1].parameters())})  # a new group, and its moments
    step(model, optimizer)
    got = cache.pieces(model, optimizer, None)
    assert described(got) == described(fresh(model, optimizer))
    assert any(p.name.startswith("optim.") and p.name.endswith("1.weight") for p in got)


def test_fingerprints_of_cached_pieces_are_the_ones_read_afresh_after_every_change():
    model, optimizer = model_and_optimizer()
    cache = PiecesCache()

    def check():
        got = cache.pieces(model, optimizer, None)
        prints = [cache.fingerprint(p) for p in got]
        assert prints == [(p.local.device, p.local.data_ptr(), p.local.dtype, p.version) for p in got]
        return dict(zip((p.name for p in got), prints))

    step(model, optimizer)
    first = check()
    assert check() == first  # nothing changed: the same fingerprints
    with torch.no_grad():
        model[0].weight.mul_(2)  # in place: a new version
    assert check()["0.weight"] != first["0.weight"]
    before = check()
    with torch.no_grad():
        model[0].weight.data = torch.zeros(3, 4)  # other memory, no version bump
    after = check()
    assert after["0.weight"][1] != before["0.weight"][1]
    model[0].bias = optimizer.param_groups[0]["params"][1] = torch.nn.Parameter(torch.ones(3))  # replaced
    assert check()["0.bias"][1] == model[0].bias.data_ptr()


def test_annotations_equal_by_value_keep_the_cache_and_a_new_one_rebuilds_it():
    from tenplex.integration.annotate import Annotation

    model, optimizer = model_and_optimizer()
    step(model, optimizer)
    cache = PiecesCache()

    def annotated(offset):  # made anew at every call, as a model's annotations() method would
        return {"0.weight": Annotation((3, 8), (0, offset))}
    first = cache.pieces(model, optimizer, annotated(4))
    generation = cache.generation
    assert described(cache.pieces(model, optimizer, annotated(4))) == described(first)
    assert cache.generation is generation
    moved = cache.pieces(model, optimizer, annotated(0))
    assert cache.generation is not generation
    assert described(moved) == described([p for p in state_pieces(model, optimizer, annotated(0))
                                          if not p.box.is_empty()])
    assert {p.box for p in moved if p.name == "0.weight"} != {p.box for p in first if p.name == "0.weight"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool,
                                   torch.float8_e4m3fn, torch.complex64])
def test_staging_copies_every_dtype_bit_for_bit_and_follows_new_memory(dtype):
    from tenplex.box import Box
    from tenplex.integration.pieces import Piece
    from tenplex.layout import TensorSpec

    def piece(tensor):  # columns 2..6 of rows 0..5: a strided region of the local tensor
        return Piece("t", TensorSpec((6, 5), str(dtype)), Box((0, 0), (6, 5)), Box((0, 2), (6, 5)), tensor)

    def values(seed):
        g = torch.Generator().manual_seed(seed)
        raw = torch.randint(0, 256, (6, 8 * dtype.itemsize), generator=g).to(torch.uint8)
        return (raw % 2 if dtype == torch.bool else raw).view(dtype)

    buffers = SnapshotBuffers()
    tensor = values(1)
    for round_ in range(3):
        buffers.stage([piece(tensor)])
        (_, _, staged), = buffers.buffers()
        assert torch.equal(staged.view(torch.uint8), tensor[:, 2:7].contiguous().view(torch.uint8))
        if round_ == 0:
            tensor.view(torch.uint8).bitwise_xor_(1)  # new values, same memory
        else:
            tensor = values(round_).clone()  # other memory: the views are made again


def test_the_gather_sends_unchanged_rng_streams_as_a_word_and_grows_its_capacity(tmp_path, monkeypatch):
    import tenplex
    from tenplex.integration import snapshot_round

    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model, optimizer = model_and_optimizer()
        step(model, optimizer)
        ckpt = tenplex.Checkpointer(store_root=tmp_path, host="h0", device="h0/0", replicas=0)
        rounds = snapshot_round.RoundCache(ckpt)
        sent: list[dict] = []
        gather = rounds._gather

        def spy(doc, group=None):
            sent.append(dict(doc))
            return gather(doc, group)
        monkeypatch.setattr(rounds, "_gather", spy)
        pieces = fresh(model, optimizer)
        first = rounds.exchange(pieces, 0, True, model, optimizer)[0]
        capacity = gather.capacity
        assert "static" in sent[0] and capacity >= len(json.dumps(sent[0], separators=(",", ":")).encode())
        second = rounds.exchange(pieces, 0, True, model, optimizer, big="x" * (4 * capacity))[0]
        assert sent[1]["rng"] == snapshot_round._UNCHANGED and "static" not in sent[1]
        assert second["rng"] == first["rng"] and second["big"] == "x" * (4 * capacity)  # a second round
        assert gather.capacity > capacity
        torch.rand(1)  # the torch stream moves on: sent in full again
        third = rounds.exchange(pieces, 0, True, model, optimizer)[0]
        assert sent[2]["rng"] != snapshot_round._UNCHANGED and third["rng"] != first["rng"]
        assert third["tensors"] == first["tensors"]  # the static part, from what this rank sent first
        ckpt.close()
    finally:
        dist.destroy_process_group()
        os.environ.pop("MASTER_PORT", None)


def test_staging_under_the_caches_structure_copies_the_current_values_after_every_change():
    model, optimizer = model_and_optimizer()
    cache, buffers = PiecesCache(), SnapshotBuffers()

    def check():
        pieces = cache.pieces(model, optimizer, None)
        buffers.stage(pieces, cache.generation)  # plans made under the same structure skip their own check
        staged = {(name, box): buffer for name, box, buffer in buffers.buffers()}
        for p in pieces:
            assert torch.equal(staged[(p.name, p.box)], p.local[p.local_box.slices()])
    step(model, optimizer)
    check()
    step(model, optimizer)  # new values, same memory and structure
    check()
    with torch.no_grad():
        model[0].weight.data = torch.randn(3, 4)  # other memory: a new structure, the plan is made again
    check()
    model[0].bias = optimizer.param_groups[0]["params"][1] = torch.nn.Parameter(torch.randn(3))  # replaced
    check()
    step(model, optimizer)
    check()


def test_the_optimizers_named_parameters_follow_a_renamed_module():
    from tenplex.integration.pieces import optimizer_scalars

    model, optimizer = model_and_optimizer()
    step(model, optimizer)
    cache = PiecesCache()
    cache.pieces(model, optimizer, None)
    named = cache.named_params(model, optimizer)
    assert optimizer_scalars(model, optimizer, named) == optimizer_scalars(model, optimizer)
    assert {name for name, _ in named} == {"0.weight", "0.bias"}
    model._modules = {("moved" if k == "0" else k): m for k, m in model._modules.items()}  # same tensors, same
    # order, other names
    pieces = cache.pieces(model, optimizer, None)
    assert {p.name for p in pieces} >= {"moved.weight", "moved.bias"}
    named = cache.named_params(model, optimizer)
    assert {name for name, _ in named} == {"moved.weight", "moved.bias"}
    assert optimizer_scalars(model, optimizer, named) == optimizer_scalars(model, optimizer)


def test_the_cheap_probe_sees_every_change_the_structure_key_sees():
    """The probe (identity and memory, before the exact key) finds each of these changes: the pieces are the
    fresh ones, and from a new structure; in between, the same piece objects under the same structure."""
    import copy

    model, optimizer = model_and_optimizer()
    model[1].register_buffer("hidden", torch.zeros(3), persistent=False)
    step(model, optimizer)
    cache = PiecesCache()
    weight = model[0].weight

    def replace_a_moment():
        optimizer.state[weight]["exp_avg"] = torch.zeros(3, 4)

    def swap_for_a_view_of_the_same_memory():
        weight.data = weight.data[:2]

    def swap_for_another_dtype():  # the same memory, shape and strides
        moment = optimizer.state[weight]["exp_avg_sq"]
        moment.data = moment.data.view(torch.int32)

    def rename_a_state():  # the same tensors in the same order, under another key
        state = optimizer.state[weight]
        renamed = {("exp_avg_sq2" if k == "exp_avg_sq" else k): v for k, v in state.items()}
        state.clear()
        state.update(renamed)

    def give_the_step_a_dimension():
        optimizer.state[weight]["step"].data = torch.zeros(3, 4)

    def load_a_state():  # new tensors (loading the optimizer's own state would keep them)
        optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))

    def register_a_buffer():
        model[1].register_buffer("extra", torch.ones(3))

    def make_a_buffer_persistent():
        model[1]._non_persistent_buffers_set.discard("hidden")

    def hook_that_drops_a_tensor(module, destination, prefix, local_metadata):
        destination.pop(prefix + "bias")

    def register_a_state_dict_hook():
        model[1]._register_state_dict_hook(hook_that_drops_a_tensor)
    def save_only_the_weight(destination, prefix, keep_vars):
        destination[prefix + "weight"] = model[0].weight

    def override_how_a_module_saves():  # on the instance: its class is as before
        model[0]._save_to_state_dict = save_only_the_weight
        assert cache._probe.tree is not None  # (before this change, the cheap tree check was the one used)

    def drop_a_parameter():
        model[1].weight = None

    def replace_a_module():
        model[1] = torch.nn.LayerNorm(3)
    changes = [replace_a_moment, load_a_state, register_a_buffer, make_a_buffer_persistent, register_a_state_dict_hook,
               swap_for_a_view_of_the_same_memory, swap_for_another_dtype, rename_a_state, give_the_step_a_dimension,
               drop_a_parameter, replace_a_module, override_how_a_module_saves]  # the last: a tree checked its way
    for change in changes:
        first = cache.pieces(model, optimizer, None)
        generation = cache.generation
        again = cache.pieces(model, optimizer, None)
        assert cache.generation is generation and all(a is b for a, b in zip(first, again)), change
        change()
        got = cache.pieces(model, optimizer, None)
        assert described(got) == described(fresh(model, optimizer)), change
        assert cache.generation is not generation, change
        if change is give_the_step_a_dimension:
            assert any(p.name.startswith("optim.step.") for p in got)


def test_a_state_of_new_python_numbers_at_every_step_keeps_the_structure():
    """An optimizer state that is a new Python object at every step (not a tensor) fails the probe; the exact
    key still finds the structure unchanged: the same generation and pieces, the fresh version counters."""
    model, optimizer = model_and_optimizer()
    step(model, optimizer)
    cache = PiecesCache()
    cache.pieces(model, optimizer, None)
    generation = cache.generation
    for i in range(3):
        optimizer.state[model[0].bias]["scale"] = 1.0 / (i + 2)  # a new float object every time
        step(model, optimizer)
        assert described(cache.pieces(model, optimizer, None)) == described(fresh(model, optimizer))
        assert cache.generation is generation


def test_cached_pieces_read_their_counters_when_asked_and_stay_hashable():
    import dataclasses

    from tenplex.integration.pieces import Piece

    model, optimizer = model_and_optimizer()
    step(model, optimizer)
    cache = PiecesCache()
    piece = next(p for p in cache.pieces(model, optimizer, None) if p.name == "0.weight")
    before, print_before, known = piece.version, cache.fingerprint(piece), {piece}
    with torch.no_grad():
        model[0].weight.mul_(2)
    assert piece.version == (model[0].weight._version,) != before
    assert cache.fingerprint(piece) != print_before and piece in known
    plain = dataclasses.replace(piece, name="other")  # a plain piece with the counters as they are now
    assert type(plain) is Piece and plain.name == "other" and plain.version == piece.version
    with torch.no_grad():
        model[0].weight.data = torch.zeros(3, 4)  # other memory: a piece of the old structure reads it afresh
    cache.pieces(model, optimizer, None)
    assert cache.fingerprint(piece)[1] == model[0].weight.data_ptr()


def test_staging_replays_its_copies_only_for_the_same_pieces_under_the_same_structure():
    from tenplex.box import Box
    from tenplex.integration.pieces import Piece

    model, optimizer = model_and_optimizer()
    step(model, optimizer)
    cache, buffers = PiecesCache(), SnapshotBuffers()

    def staged():
        return {(name, box): buffer.clone() for name, box, buffer in buffers.buffers()}
    pieces = cache.pieces(model, optimizer, None)
    buffers.stage(pieces, cache.generation)
    step(model, optimizer)
    pieces = cache.pieces(model, optimizer, None)
    buffers.stage(pieces, cache.generation)  # the same pieces and structure: the recorded copies, new values
    assert all(torch.equal(staged()[(p.name, p.box)], p.local[p.local_box.slices()]) for p in pieces)
    weight = next(p for p in pieces if p.name == "0.weight")
    other = torch.randn(3, 4)  # a piece for the same key from other memory (a canonical copy's)
    swapped = [Piece(p.name, p.spec, p.box, Box.whole(p.box.lengths), other) if p is weight else p for p in pieces]
    buffers.stage(swapped, cache.generation)
    assert torch.equal(staged()[(weight.name, weight.box)], other)
    buffers.stage(pieces[1:], cache.generation)  # fewer pieces (unchanged ones linked): the others freed
    assert set(staged()) == {(p.name, p.box) for p in pieces[1:]}
    step(model, optimizer)
    buffers.stage(pieces, cache.generation)
    assert all(torch.equal(staged()[(p.name, p.box)], p.local[p.local_box.slices()]) for p in pieces)
    assert buffers.nbytes == sum(p.box.volume * p.local.element_size() for p in pieces)
    tensor = torch.randn(3, 4)  # the same piece objects under a new structure: their memory may be new
    mine = [Piece("t", weight.spec, weight.box, weight.local_box, tensor)]
    buffers.stage(mine, object())
    tensor.data = torch.randn(3, 4)
    buffers.stage(mine, object())
    assert torch.equal(staged()[("t", weight.box)], tensor)


def test_a_model_that_saves_its_state_its_own_way_is_checked_through_its_state_dict():
    """A module with extra state (or hooks, or its own state_dict) makes the cheap tree check step aside: the
    cache still follows every change, through state_dict()."""
    from tenplex.integration.module_tree import ModuleTree, NotPlain

    class WithExtra(torch.nn.Linear):
        def get_extra_state(self):
            return {"calls": 1}

        def set_extra_state(self, state):
            pass
    model = torch.nn.Sequential(WithExtra(4, 3), torch.nn.LayerNorm(3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    step(model, optimizer)
    with pytest.raises(NotPlain):
        ModuleTree(model)
    assert ModuleTree(torch.nn.Sequential(torch.nn.Linear(4, 3))).same()
    cache = PiecesCache()
    first = cache.pieces(model, optimizer, None)
    generation = cache.generation
    step(model, optimizer)
    assert all(a is b for a, b in zip(first, cache.pieces(model, optimizer, None))) and cache.generation is generation
    model[1].register_buffer("extra", torch.ones(3))
    assert described(cache.pieces(model, optimizer, None)) == described(fresh(model, optimizer))
    assert cache.generation is not generation


def test_a_dtensors_new_local_tensor_is_a_new_structure(monkeypatch):
    """FSDP2 gives a sharded parameter a new local tensor in place (``_local_tensor``, the DTensor the same): the
    probe sees it, and a cached piece's fingerprint follows the local tensor's in-place changes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = torch.nn.Linear(4, 3)
        model.weight = torch.nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Shard(0)]))
        cache = PiecesCache()
        first = cache.pieces(model, None, None)
        generation, weight = cache.generation, next(p for p in first if p.name == "weight")
        print_before = cache.fingerprint(weight)
        with torch.no_grad():
            model.weight._local_tensor.add_(1)
        assert cache.pieces(model, None, None)[0] is first[0] and cache.generation is generation
        assert cache.fingerprint(weight) != print_before
        model.weight._local_tensor = torch.zeros(3, 4)
        got = cache.pieces(model, None, None)
        assert cache.generation is not generation
        assert described(got) == described(fresh(model, None))
        assert next(p for p in got if p.name == "weight").local.data_ptr() == model.weight._local_tensor.data_ptr()
    finally:
        dist.destroy_process_group()
        os.environ.pop("MASTER_PORT", None)
