"""PTC partition rules and layouts: uneven, padded and fused splits, pipeline stages, sharded dp, JSON files."""

import json

import numpy as np
import pytest

from tenplex.box import Box, union_volume
from tenplex.errors import ConfigError, LayoutError
from tenplex.files import load_layout, save_layout
from tenplex.gpt import gpt, optimizer_state_name
from tenplex.layout import Layout, Shard, TensorSpec, from_dict
from tenplex.parallel import ParallelConfig
from tenplex.partition import split_dim
from tenplex.ptc import PTC, TensorRule, layout, stage_layer_counts


def config(dp=1, tp=1, pp=1, per_host=None, **kw):
    n = dp * tp * pp
    per_host = per_host or n
    return ParallelConfig.on_hosts(dp, tp, pp, n // per_host, per_host, **kw)


@pytest.mark.parametrize("size", range(1, 14))
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 5])
def test_chunk_split_matches_torch_chunk(size, parts):
    torch = pytest.importorskip("torch")
    chunks = torch.arange(size).chunk(parts)
    for index in range(parts):
        local_len, runs = split_dim(size, parts, index, "chunk")
        expected = chunks[index].tolist() if index < len(chunks) else []
        assert local_len == len(expected)
        got = [g for run in runs for g in range(run.start, run.start + run.length)]
        assert got == expected


def test_even_split_requires_a_divisor_and_says_which():
    with pytest.raises(ConfigError, match=r"degree must divide 6 \(valid: 1, 2, 3, 6\)"):
        split_dim(6, 4, 0, "even")


def test_padded_vocab_keeps_the_global_shape_real():
    ptc = gpt(2, 8, 2, 37, vocab_pad_multiple=2)
    cfg = config(tp=4)
    assert ptc.tensors["embed.weight"].shape == (37, 8)
    shards = [ptc.local_shard(cfg, rank, "embed.weight") for rank in range(4)]
    # 37 rows padded to a multiple of 2 * 4 = 40: each rank's local tensor has 10 rows; the last holds 7 real ones.
    assert [s.shape for s in shards] == [(10, 8)] * 4
    assert [s.boxes for s in shards] == [(Box((10 * r, 0), (10 if r < 3 else 7, 8)),) for r in range(4)]
    assert shards[3].regions[0].local == Box((0, 0), (7, 8))


def test_padding_can_leave_a_rank_without_real_rows():
    rule = TensorRule("t", (3, 2), tp_dim=0, split="pad", anchors=("first",))
    ptc = PTC([rule])
    shard = ptc.local_shard(config(tp=4), 3, "t")
    assert shard.shape == (1, 2) and shard.regions == ()
    assert layout(ptc, config(tp=4)).devices["h0/3"] == ()


def test_fused_qkv_gives_each_rank_its_slice_of_every_block():
    h = 8
    ptc = gpt(1, h, 4, 16)
    cfg = config(tp=2)
    shard = ptc.local_shard(cfg, 1, "layers.0.attn.qkv.weight")
    assert shard.shape == (3 * h // 2, h)
    assert shard.boxes == (Box((4, 0), (4, h)), Box((12, 0), (4, h)), Box((20, 0), (4, h)))
    assert [p.local.offsets[0] for p in shard.regions] == [0, 4, 8]
    whole = ptc.local_shard(config(tp=1), 0, "layers.0.attn.qkv.weight")
    assert whole.boxes == (Box((0, 0), (3 * h, h)),)  # contiguous pieces merge


def test_fused_blocks_split_unevenly_with_chunk_semantics():
    ptc = gpt(1, 8, 2, 16, ffn=5, gated=True)
    cfg = config(tp=2)
    boxes = [ptc.local_shard(cfg, r, "layers.0.mlp.fc1.weight").boxes for r in range(2)]
    assert boxes[0] == (Box((0, 0), (3, 8)), Box((5, 0), (3, 8)))
    assert boxes[1] == (Box((3, 0), (2, 8)), Box((8, 0), (2, 8)))


def test_attention_split_by_heads_names_the_tensor():
    with pytest.raises(ConfigError, match=r"'layers.0.attn.qkv.weight'.*tp=3.*4 units of 2"):
        layout(gpt(1, 8, 4, 16), config(tp=3))


def test_pipeline_stages_even_and_explicit():
    assert stage_layer_counts(7, config(pp=3)) == (3, 2, 2)
    assert stage_layer_counts(8, config(pp=2)) == (4, 4)
    assert stage_layer_counts(7, config(pp=3, stage_layers=(1, 3, 3))) == (1, 3, 3)
    with pytest.raises(ConfigError, match="pp=4 pipeline stages but the model has only 3 layers; use pp <= 3"):
        stage_layer_counts(3, config(pp=4))
    with pytest.raises(ConfigError, match="sum to 6, but the model has 7 layers"):
        stage_layer_counts(7, config(pp=2, stage_layers=(3, 3)))


def test_embedding_first_head_last_and_tied_on_both():
    cfg = config(pp=3)
    ptc = gpt(7, 8, 2, 16)
    placed = layout(ptc, cfg)
    names = {device: {s.tensor for s in shards} for device, shards in placed.devices.items()}
    assert "embed.weight" in names["h0/0"] and "head.weight" in names["h0/2"]
    assert {n for n in names["h0/1"] if n.endswith("ln1.weight")} == {"layers.3.ln1.weight", "layers.4.ln1.weight"}
    tied = layout(gpt(7, 8, 2, 16, tied=True), cfg)
    holders = {d for d, shards in tied.devices.items() if any(s.tensor == "embed.weight" for s in shards)}
    assert holders == {"h0/0", "h0/2"} and "head.weight" not in tied.tensors


@pytest.mark.parametrize("sharding", ["optimizer", "full"])
def test_sharded_dp_splits_dim0_of_the_local_tensor(sharding):
    ptc = gpt(1, 8, 2, 16, optimizer="adam")
    cfg = config(dp=3, tp=2, sharding=sharding)
    name = "layers.0.attn.qkv.weight"
    state = optimizer_state_name("exp_avg", name)
    for tensor, sharded in ((name, sharding == "full"), (state, True)):
        for tp in range(2):
            tp_boxes = ptc.local_shard(config(tp=2), tp, tensor).boxes
            parts = [ptc.local_shard(cfg, cfg.rank_of(0, dp, tp), tensor) for dp in range(3)]
            if not sharded:
                assert all(p.boxes == tp_boxes for p in parts)
                continue
            # local tensor of 12 rows (3 blocks of 4) chunked 4/4/4 over dp: each dp rank holds one block's slice.
            assert [p.shape for p in parts] == [(4, 8)] * 3
            got = sorted(b for p in parts for b in p.boxes)
            assert got == sorted(tp_boxes)


def test_local_pieces_reassemble_the_global_tensor():
    rng = np.random.default_rng(0)
    ptc = gpt(3, 16, 4, 37, ffn=23, optimizer="adam", gated=True, vocab_pad_multiple=2)
    globals_ = {n: rng.standard_normal(s.shape).astype(np.float32) for n, s in ptc.tensors.items()}
    for cfg in (config(dp=2, tp=2, pp=2, per_host=4, sharding="full"), config(dp=3, tp=4, sharding="optimizer")):
        for rank in range(cfg.world_size):
            for shard in ptc.local_shards(cfg, rank):
                local = np.full(shard.shape, np.nan, dtype=np.float32)
                for piece in shard.regions:
                    assert piece.local.lengths == piece.box.lengths
                    assert Box.whole(shard.shape).contains(piece.local)
                    local[piece.local.slices()] = globals_[shard.tensor][piece.box.slices()]
                assert np.isnan(local).sum() == local.size - sum(p.box.volume for p in shard.regions)


@pytest.mark.parametrize("dp,tp,pp,sharding", [(1, 1, 1, "none"), (2, 2, 2, "none"), (4, 3, 1, "optimizer"),
                                               (2, 3, 3, "full"), (5, 1, 2, "full")])
def test_every_tensor_is_covered_and_replicas_agree(dp, tp, pp, sharding):
    ptc = gpt(6, 24, 6, 50, ffn=35, optimizer="adam", tied=True)
    placed = layout(ptc, config(dp, tp, pp, sharding=sharding))
    for name, spec in placed.tensors.items():
        boxes = [box for _, box in placed.shards_of(name)]
        assert union_volume(sorted(set(boxes))) == Box.whole(spec.shape).volume, name
        assert sum(box.volume for box in set(boxes)) == Box.whole(spec.shape).volume, name  # distinct boxes tile


def test_layout_json_round_trip(tmp_path):
    placed = layout(gpt(2, 8, 2, 11, dtype="bfloat16", optimizer="adam"), config(dp=2, tp=2, per_host=2))
    assert placed.tensors["embed.weight"] == TensorSpec((11, 8), "bfloat16")
    assert placed.tensors["optim.exp_avg.embed.weight"].dtype == "float32"
    assert from_dict(json.loads(json.dumps(placed.to_dict()))).to_dict() == placed.to_dict()
    path = tmp_path / "layout.json"
    save_layout(placed, path)
    assert load_layout(path).to_dict() == placed.to_dict()


def doc(devices, tensors=None):
    return {"format": "tenplex.layout/1", "tensors": tensors or {"w": {"shape": [4, 2], "dtype": "float16"}},
            "devices": devices}


def box(offsets, lengths, tensor="w"):
    return {"tensor": tensor, "offsets": offsets, "lengths": lengths}


@pytest.mark.parametrize("document, message", [
    (doc({"h0/0": [box([0, 0], [3, 2]), box([2, 0], [2, 2])]}),
     r"h0/0 holds overlapping boxes \[0:3, 0:2\] and \[2:4, 0:2\] of tensor 'w'"),
    (doc({"h0/0": [box([2, 0], [3, 2])]}), r"box \[2:5, 0:2\] of tensor 'w' lies outside its shape \[4, 2\]"),
    (doc({"h0/0": [box([0, 0], [4, 2])]}, {"w": {"shape": [4, 2], "dtype": "float17"}}),
     "unknown dtype 'float17'; known dtypes: bfloat16"),
    (doc({"h0/0": [box([0, 0], [4, 2])]}, {"w": {"shape": [4, 2], "dtype": "float16"},
                                           "v": {"shape": [3], "dtype": "float16"}}),
     "no device holds tensor\\(s\\) 'v'"),
    (doc({"h0/0": [box([0, 0], [4, 2], tensor="x")]}), "tensor 'x', which the layout's 'tensors' does not declare"),
    (doc({"gpu0": [box([0, 0], [4, 2])]}), "HOST/INDEX"),
    (doc({"h0/0": [{"tensor": "w", "offsets": [0, 0]}]}), "missing key 'lengths'"),
    ({"format": "tenplex.layout/0"}, "expected format 'tenplex.layout/1'"),
    (doc({"h0/0": [box([0, 0], [4, 2])]}, {"w": {"shape": [4.9, 2], "dtype": "float16"}}),
     "'float' object cannot be interpreted as an integer"),
    (doc({"h0/0": [box([0.5, 0], [4, 2])]}), "'float' object cannot be interpreted as an integer"),
])
def test_malformed_layout_files_fail_clearly(tmp_path, document, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(document))
    with pytest.raises(LayoutError, match=message) as info:
        load_layout(path)
    assert str(path) in str(info.value)


def test_not_json_is_a_layout_error(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{")
    with pytest.raises(LayoutError, match="not valid JSON"):
        load_layout(path)


def test_hand_built_layout_validates():
    spec = {"w": TensorSpec((4,), "int8")}
    with pytest.raises(LayoutError, match="overlapping"):
        Layout.build(spec, {"h0/0": [Shard("w", Box((0,), (3,))), Shard("w", Box((1,), (3,)))]})
    ok = Layout.build(spec, {"h0/0": [Shard("w", Box((0,), (2,))), Shard("w", Box((2,), (2,)))]})
    assert ok.device_bytes("h0/0") == 4 and ok.hosts() == ["h0"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(tp_dim=2, anchors=("first",)), "tp_dim 2 is not a dimension of a 2-d tensor"),
    (dict(layer=0, anchors=("first",)), "either a layer index or anchors"),
    (dict(), "either a layer index or anchors"),
    (dict(anchors=("middle",)), "anchors .* must be among"),
    (dict(dtype="float17", anchors=("first",)), "unknown dtype 'float17'"),
    (dict(tp_dim=0, blocks=(2, 3), anchors=("first",)), r"fused blocks \[2, 3\] must sum to the size of tp_dim"),
    (dict(tp_dim=0, split="ragged", anchors=("first",)), "split 'ragged' is not one of"),
    (dict(layer=-1), "layer -1 is negative"),
])
def test_bad_rules_name_the_tensor(kwargs, message):
    with pytest.raises(ConfigError, match=message) as info:
        TensorRule("w", (4, 6), **kwargs)
    assert "'w'" in str(info.value)


def test_duplicate_tensor_and_layer_out_of_range():
    rule = TensorRule("w", (2,), layer=3)
    with pytest.raises(ConfigError, match="defined twice"):
        PTC([rule, rule])
    with pytest.raises(ConfigError, match="belongs to layer 3, but the model has 2 layers"):
        PTC([rule], layers=2)


def test_gpt_rejects_bad_sizes():
    with pytest.raises(ConfigError, match="hidden 10 is not divisible by heads 4"):
        gpt(1, 10, 4, 16)
    with pytest.raises(ConfigError, match="layers must be a positive integer"):
        gpt(0, 8, 2, 16)
    with pytest.raises(ConfigError, match="unknown optimizer 'sgd'"):
        gpt(1, 8, 2, 16, optimizer="sgd")


def test_gpt_names_and_counts():
    ptc = gpt(2, 8, 2, 16, optimizer="adam", max_seq=32, bias=False)
    params = [n for n in ptc.rules if not n.startswith("optim.")]
    assert params[:2] == ["embed.weight", "pos_embed.weight"] and params[-2:] == ["norm.weight", "head.weight"]
    assert "layers.1.mlp.fc2.weight" in params and not any(n.endswith(".bias") for n in params)
    assert len(ptc.rules) == 3 * len(params)
    assert ptc.rules["optim.exp_avg_sq.layers.0.attn.qkv.weight"].optimizer_state
