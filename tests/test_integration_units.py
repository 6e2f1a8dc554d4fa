"""Unit tests of the PyTorch integration's pure parts (no process group): boxes of plain and annotated
tensors, store round trips, non-tensor state, and the checks that produce mismatch errors."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tenplex.box import Box
from tenplex.errors import LayoutError
from tenplex.gpt import gpt
from tenplex.integration import Annotation, StateMismatchError, annotations_from_layout, annotations_from_ptc
from tenplex.integration.layouts import check_and_build as _check_and_build, local_sources as _local_sources
from tenplex.integration.nontensor import (apply_optimizer_doc, apply_rng, capture_rng, derived_seed, optimizer_doc,
                                           to_json)
from tenplex.integration.pieces import init_optimizer_state, model_pieces, optimizer_pieces, tensor_pieces
from tenplex.integration.shardio import read_piece, write_piece
from tenplex.layout import Layout, Shard, TensorSpec
from tenplex.parallel import ParallelConfig
from tenplex.ptc import layout
from tenplex.store import Store


def test_annotation_of_a_padded_shard_keeps_only_real_rows():
    (box, local), = Annotation((37, 4), (30, 0)).pieces("embed", (10, 4))
    assert box == Box((30, 0), (7, 4)) and local == Box((0, 0), (7, 4))


def test_annotation_errors_name_the_tensor():
    with pytest.raises(LayoutError, match="'w'.*differ in rank"):
        Annotation((4, 4), (0, 0)).pieces("w", (4,))
    with pytest.raises(LayoutError, match="'w'.*outside"):
        Annotation((4, 4), (5, 0)).pieces("w", (2, 4))


def test_annotations_from_ptc_match_the_partition_rules_layout():
    ptc = gpt(layers=2, hidden=8, heads=2, vocab=11, optimizer="adam", vocab_pad_multiple=2)
    config = ParallelConfig(dp=1, tp=2, pp=1, devices=("h0/0", "h0/1"))
    expected = layout(ptc, config)
    for rank, device in enumerate(config.devices):
        annotations = annotations_from_ptc(ptc, config, rank)
        shards = {(name, box) for name, a in annotations.items() for box in a.boxes}
        assert shards == {(s.tensor, s.box) for s in expected.devices[device]}
        # The fused qkv weight of a tp rank is three boxes, one per block, stacked in its local tensor.
        qkv = annotations["layers.0.attn.qkv.weight"]
        assert len(qkv.boxes) == 3 and [r.offsets[0] for r in qkv.local] == [0, 4, 8]


def test_annotations_from_layout_stack_boxes_along_the_differing_dimension():
    spec = {"qk": TensorSpec((8, 3), "float32")}
    lay = Layout.build(spec, {"h0/0": [Shard("qk", Box((4, 0), (2, 3))), Shard("qk", Box((0, 0), (2, 3)))],
                              "h0/1": [Shard("qk", Box((2, 0), (2, 3))), Shard("qk", Box((6, 0), (2, 3)))]})
    a = annotations_from_layout(lay, "h0/0")["qk"]
    assert a.pieces("qk", (4, 3)) == [(Box((0, 0), (2, 3)), Box((0, 0), (2, 3))),
                                      (Box((4, 0), (2, 3)), Box((2, 0), (2, 3)))]
    with pytest.raises(LayoutError, match="holds nothing"):
        annotations_from_layout(lay, "h1/0")


def test_plain_parameters_and_adam_states_are_whole_tensors_with_ptc_names():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    init_optimizer_state(optimizer)
    names = {p.name: p.box for p in model_pieces(model) + optimizer_pieces(model, optimizer)}
    assert names["weight"] == Box((0, 0), (2, 3)) and names["optim.exp_avg_sq.bias"] == Box((0,), (2,))
    assert all(torch.equal(s["exp_avg"], torch.zeros_like(s["exp_avg"])) for s in optimizer.state.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pieces_round_trip_through_a_real_store_bit_for_bit(tmp_path, dtype):
    store = Store(tmp_path, "h0")
    local = torch.randn(10, 4).to(dtype)  # padded: global rows 30..36 are real, the last 3 local rows are padding
    pieces = tensor_pieces("embed", local, Annotation((37, 4), (30, 0)))
    with store.begin(1) as writer:
        for piece in pieces:
            write_piece(writer, "h0/0", piece)
        writer.commit()
    target = torch.full((10, 4), 7.0, dtype=dtype)
    for piece in tensor_pieces("embed", target, Annotation((37, 4), (30, 0))):
        read_piece(store.open(1), [("h0/0", piece.box)], piece)
    assert torch.equal(target[:7].view(torch.uint8), local[:7].view(torch.uint8))
    assert torch.all(target[7:] == 7.0)  # padding is neither saved nor overwritten


def test_rng_state_round_trips_through_json():
    import json
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    doc = json.loads(json.dumps(capture_rng()))
    expected = (random.random(), np.random.rand(), torch.rand(2))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    apply_rng(doc)
    got = (random.random(), np.random.rand(), torch.rand(2))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])
    assert derived_seed(5, "dp=1,tp=0") == derived_seed(5, "dp=1,tp=0") != derived_seed(5, "dp=0,tp=1")


def test_non_json_state_is_refused_with_a_reason():
    with pytest.raises(StateMismatchError, match="extra holds a object"):
        to_json({"x": object()}, "extra")


def test_optimizer_of_another_kind_or_other_groups_is_an_error():
    model = torch.nn.Linear(2, 2)
    doc = optimizer_doc(torch.optim.AdamW(model.parameters(), lr=0.5), [["weight", "bias"]])
    with pytest.raises(StateMismatchError, match="AdamW.*Adam"):
        apply_optimizer_doc(torch.optim.Adam(model.parameters()), doc, [["weight", "bias"]])
    with pytest.raises(StateMismatchError, match="holds other"):
        apply_optimizer_doc(torch.optim.AdamW(model.parameters()), doc, [["weight", "other"]])
    restored = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.8, 0.9))
    apply_optimizer_doc(restored, doc, [["weight", "bias"]])
    assert restored.param_groups[0]["lr"] == 0.5 and restored.param_groups[0]["betas"] == (0.9, 0.999)


def _doc(device, tensors, boxes):
    return {"device": device, "tensors": tensors, "boxes": boxes}


def test_mismatch_errors_name_the_tensor_and_both_shapes():
    old = Layout.build({"w": TensorSpec((4, 4), "float32"), "gone": TensorSpec((2,), "float32")},
                       {"h0/0": [Shard("w", Box.whole((4, 4))), Shard("gone", Box.whole((2,)))]})
    docs = [_doc("h0/0", {"w": [[4, 5], "float32"], "new": [[3], "float32"]},
                 [["w", [0, 0], [4, 5]], ["new", [0], [3]]])]
    with pytest.raises(StateMismatchError) as err:
        _check_and_build(old, docs, None, "h0/0", [])
    message = str(err.value)
    assert "'w' has shape [4, 5] float32 in the restored job but [4, 4] float32" in message
    assert "'new' (shape [3], float32) is not in the saved state" in message
    assert "'gone' (shape [2]) was saved but the restored job has no such tensor" in message


def test_boxes_assembled_from_shards_on_the_same_host_are_read_directly_others_need_a_transformation():
    spec = {"w": TensorSpec((4, 4), "float32")}
    old = Layout.build(spec, {"h0/0": [Shard("w", Box((0, 0), (2, 4)))], "h0/1": [Shard("w", Box((2, 0), (2, 4)))]})
    new = Layout.build(spec, {"h0/2": [Shard("w", Box((1, 0), (2, 4)))], "h0/0": [Shard("w", Box((0, 0), (2, 4)))],
                              "h0/1": [Shard("w", Box((3, 0), (1, 4)))]})
    assert _local_sources(old, new) == {
        "h0/2": {("w", Box((1, 0), (2, 4))): [("h0/0", Box((1, 0), (1, 4))), ("h0/1", Box((2, 0), (1, 4)))]},
        "h0/0": {("w", Box((0, 0), (2, 4))): [("h0/0", Box((0, 0), (2, 4)))]},
        "h0/1": {("w", Box((3, 0), (1, 4))): [("h0/1", Box((3, 0), (1, 4)))]}}
    other_host = Layout.build(spec, {"h1/0": [Shard("w", Box((0, 0), (2, 4)))],
                                     "h0/0": [Shard("w", Box((2, 0), (2, 4)))]})
    assert _local_sources(old, other_host) is None


def test_regions_are_read_into_tensors_from_several_shards(tmp_path):
    store = Store(tmp_path, "h0")
    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    with store.begin(1) as writer:  # two column halves: a row range of one is not contiguous in its file
        for d, cols in (("h0/0", (0, 3)), ("h0/1", (3, 3))):
            write_piece(writer, d, tensor_pieces("w", full[:, cols[0]:cols[0] + cols[1]].contiguous(),
                                                 Annotation((4, 6), (0, cols[0])))[0])
        writer.commit()
    target = torch.zeros(2, 6)
    piece, = tensor_pieces("w", target, Annotation((4, 6), (1, 0)))
    read_piece(store.open(1), [("h0/0", Box((1, 0), (2, 3))), ("h0/1", Box((1, 3), (2, 3)))], piece)
    assert torch.equal(target, full[1:3])


def test_a_layout_made_in_advance_must_give_each_device_what_its_model_needs():
    old = Layout.build({"w": TensorSpec((4, 4), "float32")}, {"h0/0": [Shard("w", Box.whole((4, 4)))]})
    docs = [_doc("h0/0", {"w": [[4, 4], "float32"]}, [["w", [0, 0], [2, 4]]])]
    piece, = tensor_pieces("w", torch.zeros(2, 4), Annotation((4, 4), (0, 0)))
    given = Layout.build(old.tensors, {"h0/0": [Shard("w", Box((0, 0), (2, 4)))],
                                       "h0/1": [Shard("w", Box((2, 0), (2, 4)))]})
    assert _check_and_build(old, docs, given, "h0/0", [piece]) is given
    wrong = Layout.build(old.tensors, {"h0/0": [Shard("w", Box((2, 0), (2, 4)))],
                                       "h0/1": [Shard("w", Box((0, 0), (2, 4)))]})
    with pytest.raises(StateMismatchError, match=r"does not give device h0/0 .*w \[0:2, 0:4\]"):
        _check_and_build(old, docs, wrong, "h0/0", [piece])


def test_gradient_scaler_and_scheduler_state_round_trip_as_json():
    import json
    from tenplex.integration.nontensor import from_json
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    docs = json.loads(json.dumps([to_json(scheduler.state_dict(), "s"), to_json(scaler.state_dict(), "g")]))
    fresh_scheduler = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=1.0), step_size=2)
    fresh_scheduler.load_state_dict(from_json(docs[0]))
    fresh_scaler = torch.amp.GradScaler("cpu")
    fresh_scaler.load_state_dict(from_json(docs[1]))
    assert fresh_scheduler.state_dict() == scheduler.state_dict()
    assert fresh_scaler.state_dict() == scaler.state_dict() and fresh_scaler.get_scale() == 1024.0


def test_a_model_only_restore_ignores_saved_optimizer_tensors_but_not_missing_parameters():
    old = Layout.build({"w": TensorSpec((2,), "float32"), "optim.exp_avg.w": TensorSpec((2,), "float32"),
                        "b": TensorSpec((1,), "float32")},
                       {"h0/0": [Shard("w", Box.whole((2,))), Shard("optim.exp_avg.w", Box.whole((2,))),
                                 Shard("b", Box.whole((1,)))]})
    docs = [_doc("h0/0", {"w": [[2], "float32"], "b": [[1], "float32"]}, [["w", [0], [2]], ["b", [0], [1]]])]
    assert set(_check_and_build(old, docs, None, "h0/0", [], with_optimizer=False).tensors) == {"w", "b"}
    with pytest.raises(StateMismatchError, match="'optim.exp_avg.w'"):
        _check_and_build(old, docs, None, "h0/0", [])
    docs = [_doc("h0/0", {"w": [[2], "float32"]}, [["w", [0], [2]]])]
    with pytest.raises(StateMismatchError, match="'b' \\(shape \\[1\\]\\) was saved"):
        _check_and_build(old, docs, None, "h0/0", [], with_optimizer=False)
