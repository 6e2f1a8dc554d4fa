"""The minimal-movement planner: exact plans for hand-written layouts, and properties over random layout pairs."""

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tenplex.apply import apply_plan, shards_from_global
from tenplex.box import Box, subtract_all
from tenplex.devices import host_of
from tenplex.dtypes import numpy_storage
from tenplex.errors import PlanError
from tenplex.gpt import gpt
from tenplex.layout import Layout, Shard, TensorSpec
from tenplex.parallel import ParallelConfig
from tenplex.transfer_plan import Transfer, plan_from_dict
from tenplex.planner import plan
from tenplex.ptc import layout

PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def build(tensors, devices):
    return Layout.build({n: TensorSpec(shape, dtype) for n, (shape, dtype) in tensors.items()},
                        {d: [Shard(t, Box(o, n)) for t, o, n in boxes] for d, boxes in devices.items()})


def test_unchanged_layout_keeps_everything():
    old = build({"w": ((4, 2), "float32")}, {"h0/0": [("w", (0, 0), (2, 2))], "h0/1": [("w", (2, 0), (2, 2))]})
    result = plan(old, old)
    assert result.transfers == (Transfer("w", "h0/0", "h0/0", "old", Box((0, 0), (2, 2))),
                                Transfer("w", "h0/1", "h0/1", "old", Box((2, 0), (2, 2))))
    assert result.stats.kept_bytes == result.stats.target_bytes == 32
    assert result.stats.inter_host_bytes == result.stats.intra_host_bytes == 0


def test_local_copy_remote_once_and_fan_out():
    old = build({"w": ((4,), "float16")}, {"h0/0": [("w", (0,), (4,))]})
    new = build({"w": ((4,), "float16")}, {"h0/1": [("w", (2,), (2,))], "h1/0": [("w", (0,), (4,))],
                                           "h1/1": [("w", (0,), (2,))]})
    result = plan(old, new)
    assert result.transfers == (
        Transfer("w", "h0/0", "h0/1", "old", Box((2,), (2,))),   # same host: copied locally
        Transfer("w", "h0/0", "h1/0", "old", Box((0,), (4,))),   # crosses to h1 once
        Transfer("w", "h1/0", "h1/1", "new", Box((0,), (2,))),   # fanned out on h1
    )
    s = result.stats
    assert (s.target_bytes, s.kept_bytes, s.intra_host_bytes, s.inter_host_bytes) == (16, 0, 8, 8)
    assert s.inter_host_lower_bound == 8 and s.max_host_send_bytes == 8 and s.max_host_recv_bytes == 8


def test_kept_before_local_before_remote():
    old = build({"w": ((6,), "int8")}, {"h0/0": [("w", (0,), (2,))], "h0/1": [("w", (2,), (2,))],
                                        "h1/0": [("w", (0,), (6,))]})
    new = build({"w": ((6,), "int8")}, {"h0/0": [("w", (0,), (6,))]})
    assert plan(old, new).transfers == (
        Transfer("w", "h0/0", "h0/0", "old", Box((0,), (2,))),
        Transfer("w", "h0/1", "h0/0", "old", Box((2,), (2,))),
        Transfer("w", "h1/0", "h0/0", "old", Box((4,), (2,))),
    )


def test_pieces_come_from_the_boxes_that_hold_them():
    old = build({"w": ((6, 2), "float32")}, {"h0/0": [("w", (0, 0), (3, 2))], "h1/0": [("w", (3, 0), (3, 2))]})
    new = build({"w": ((6, 2), "float32")}, {"h2/0": [("w", (1, 0), (5, 2))]})
    result = plan(old, new)
    assert result.transfers == (Transfer("w", "h0/0", "h2/0", "old", Box((1, 0), (2, 2))),
                                Transfer("w", "h1/0", "h2/0", "old", Box((3, 0), (3, 2))))
    assert result.stats.max_host_recv_bytes == 40 and result.stats.max_host_send_bytes == 24


def test_senders_are_balanced_over_replicas():
    tensors = {name: ((8,), "float32") for name in "abcd"}
    old = build(tensors, {"h0/0": [(n, (0,), (8,)) for n in "abcd"], "h1/0": [(n, (0,), (8,)) for n in "abcd"]})
    new = build(tensors, {"h2/0": [(n, (0,), (8,)) for n in "abcd"]})
    result = plan(old, new)
    assert [t.src for t in result.transfers] == ["h0/0", "h1/0", "h0/0", "h1/0"]
    assert result.stats.max_host_send_bytes == 64 and result.stats.max_host_recv_bytes == 128


def test_within_a_host_the_least_loaded_device_sends():
    """Of a host's replicas, the device that has sent fewest bytes so far sends (ties: the first in device
    order), for copies to other hosts and within the host alike: two replicas on h0 take turns."""
    tensors = {name: ((8,), "float32") for name in "abcd"}
    old = build(tensors, {d: [(n, (0,), (8,)) for n in "abcd"] for d in ("h0/0", "h0/1")})
    for dst in ("h1/0", "h0/2"):  # remote, then local
        result = plan(old, build(tensors, {dst: [(n, (0,), (8,)) for n in "abcd"]}))
        assert [(t.tensor, t.src) for t in result.transfers] == [("a", "h0/0"), ("b", "h0/1"), ("c", "h0/0"),
                                                                  ("d", "h0/1")], dst


def test_new_tensors_are_an_error_unless_allowed():
    old = build({"w": ((2,), "float32")}, {"h0/0": [("w", (0,), (2,))]})
    new = build({"w": ((2,), "float32"), "v": ((3,), "float32")},
                {"h0/0": [("w", (0,), (2,)), ("v", (0,), (3,))]})
    with pytest.raises(PlanError, match="1 tensor\\(s\\) that the old layout lacks: 'v'"):
        plan(old, new)
    result = plan(old, new, allow_new_tensors=True)
    assert result.new_tensors == ("v",) and result.stats.initialized_bytes == 12
    assert [t.tensor for t in result.transfers] == ["w"]
    assert plan_from_dict(result.to_dict()) == result
    shards = apply_plan(result, old, new, shards_from_global(old, {"w": np.arange(2, dtype=np.float32)}))
    assert (shards["h0/0"][Shard("v", Box((0,), (3,)))] == 0).all()


def test_dropped_tensors_are_fine_and_changed_ones_are_not():
    old = build({"w": ((2,), "float32"), "v": ((3,), "float32")}, {"h0/0": [("w", (0,), (2,)), ("v", (0,), (3,))]})
    assert plan(old, build({"w": ((2,), "float32")}, {"h0/0": [("w", (0,), (2,))]})).stats.kept_bytes == 8
    with pytest.raises(PlanError, match=r"'w' \[2\] float32 -> \[2\] bfloat16"):
        plan(old, build({"w": ((2,), "bfloat16"), "v": ((3,), "float32")},
                        {"h0/0": [("w", (0,), (2,)), ("v", (0,), (3,))]}))
    with pytest.raises(PlanError, match=r"'v' \[3\] float32 -> \[4\] float32"):
        plan(old, build({"w": ((2,), "float32"), "v": ((4,), "float32")},
                        {"h0/0": [("w", (0,), (2,)), ("v", (0,), (4,))]}))


def test_region_missing_from_old_layout_is_named():
    old = build({"w": ((4,), "float32")}, {"h0/0": [("w", (0,), (2,))]})
    new = build({"w": ((4,), "float32")}, {"h1/0": [("w", (0,), (4,))]})
    with pytest.raises(PlanError, match=r"no device of the old layout holds region \[2:4\] of tensor 'w'.*h1/0"):
        plan(old, new)


def test_apply_plan_enforces_the_contract():
    old = build({"w": ((4,), "float32")}, {"h0/0": [("w", (0,), (4,))]})
    new = build({"w": ((4,), "float32")}, {"h1/0": [("w", (0,), (4,))], "h1/1": [("w", (0,), (4,))]})
    good = plan(old, new)
    shards = shards_from_global(old, {"w": np.arange(4, dtype=np.float32)})
    fanout_first = type(good)(tuple(reversed(good.transfers)), good.stats)
    with pytest.raises(PlanError, match="before any transfer filled it"):
        apply_plan(fanout_first, old, new, shards)
    with pytest.raises(PlanError, match="already filled"):
        apply_plan(type(good)(good.transfers + good.transfers[:1], good.stats), old, new, shards)
    with pytest.raises(PlanError, match="unfilled"):
        apply_plan(type(good)(good.transfers[:1], good.stats), old, new, shards)
    cross = Transfer("w", "h1/0", "h0/0", "new", Box((0,), (4,)))
    with pytest.raises(PlanError, match="within a host|no new box"):
        apply_plan(type(good)((cross,), good.stats), old, new, shards)


# ---- properties over random layout pairs ---------------------------------------------------------

def lower_bound(old, new):
    """Sum over hosts and tensors of |union new on h - union old on h| * itemsize, from boxes alone."""
    total = 0
    for name, spec in new.tensors.items():
        for h in new.hosts():
            olds = [b for d, b in old.shards_of(name) if host_of(d) == h]
            news = [b for d, b in new.shards_of(name) if host_of(d) == h]
            for i, box in enumerate(news):
                total += sum(p.volume for p in subtract_all(box, olds + news[:i])) * spec.itemsize
    return total


def kept_bound(old, new):
    """Bytes every device already holds of what it needs."""
    total = 0
    for device, shards in new.devices.items():
        for shard in shards:
            for other in old.devices.get(device, ()):
                common = other.tensor == shard.tensor and shard.box.intersect(other.box)
                if common:
                    total += common.volume * new.tensors[shard.tensor].itemsize
    return total


def check_plan(old, new, seed=0):
    result = plan(old, new)
    assert plan(old, new).to_dict() == result.to_dict()  # deterministic
    return check_transfers(old, new, result, seed)


def check_transfers(old, new, result, seed=0):
    """``result`` meets the Plan contract for old -> new: minimal bytes, exact stats, a bit-exact new state."""
    s = result.stats
    assert s.inter_host_bytes == s.inter_host_lower_bound == lower_bound(old, new)
    assert s.kept_bytes == kept_bound(old, new)
    assert s.kept_bytes + s.intra_host_bytes + s.inter_host_bytes == s.target_bytes
    traffic = result.host_traffic({n: t.itemsize for n, t in new.tensors.items()})
    assert s.max_host_send_bytes == max((v[0] for v in traffic.values()), default=0)
    assert s.max_host_recv_bytes == max((v[1] for v in traffic.values()), default=0)
    rng = np.random.default_rng(seed)
    globals_ = {n: rng.integers(0, 100, size=spec.shape).astype(numpy_storage(spec.dtype))
                for n, spec in old.tensors.items()}
    # apply_plan raises if any box is filled twice or left unfilled, or a read breaks the contract.
    new_shards = apply_plan(result, old, new, shards_from_global(old, globals_))
    for device, shards in new.devices.items():
        for shard in shards:
            assert np.array_equal(new_shards[device][shard], globals_[shard.tensor][shard.box.slices()])
    return result


@st.composite
def gpt_configs(draw):
    dp, tp, pp = draw(st.sampled_from([1, 2, 3])), draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 3]))
    n = dp * tp * pp
    per_host = draw(st.sampled_from([k for k in (1, 2, 3, 4, 6) if n % k == 0]))
    stages = draw(st.sampled_from([None, (1, 2) if pp == 2 else None]))
    # Sometimes an explicit rank order, which may spread a tp group over hosts.
    grid = [(p, d, t) for p in range(pp) for d in range(dp) for t in range(tp)]
    mapping = draw(st.one_of(st.none(), st.permutations(grid)))
    return ParallelConfig.on_hosts(dp, tp, pp, n // per_host, per_host, stage_layers=stages, mapping=mapping,
                                   sharding=draw(st.sampled_from(["none", "optimizer", "full"])))


@PROPERTY
@given(gpt_configs(), gpt_configs(), st.booleans(), st.booleans(), st.sampled_from(["float32", "bfloat16"]))
def test_random_gpt_reconfigurations(old_config, new_config, tied, gated, dtype):
    ptc = gpt(3, 8, 4, 13, ffn=7, optimizer="adam", tied=tied, gated=gated, vocab_pad_multiple=2, dtype=dtype)
    check_plan(layout(ptc, old_config), layout(ptc, new_config))


@st.composite
def random_layouts(draw, tensors, hosts):
    """Each device cuts each tensor on its own random grid and holds a random subset of the cells."""
    devices = [f"h{h}/{i}" for h in range(hosts) for i in range(draw(st.integers(1, 3)))]
    chosen = draw(st.lists(st.sampled_from(devices), min_size=1, max_size=len(devices), unique=True))
    held = {d: [] for d in chosen}
    for name, (shape, _) in tensors.items():
        for k, device in enumerate(chosen):
            cuts = [sorted(set(draw(st.lists(st.integers(1, max(n - 1, 1)), max_size=2))) - {n}) for n in shape]
            grid = [list(zip([0] + c, c + [n])) for c, n in zip(cuts, shape)]
            cells = [(tuple(a for a, _ in combo), tuple(b for _, b in combo)) for combo in itertools.product(*grid)]
            keep = cells if k == 0 else [c for c in cells if draw(st.booleans())]  # the first device holds all
            held[device] += [(name, lo, tuple(b - a for a, b in zip(lo, hi))) for lo, hi in keep]
    return build(tensors, held)


@PROPERTY
@given(st.data())
def test_random_hand_written_layouts(data):
    tensors = {f"t{i}": (tuple(data.draw(st.lists(st.integers(1, 5), max_size=3))),
                         data.draw(st.sampled_from(["float32", "float16", "int8"])))
               for i in range(data.draw(st.integers(1, 3)))}
    old = data.draw(random_layouts(tensors, data.draw(st.integers(1, 3))))
    new = data.draw(random_layouts(tensors, data.draw(st.integers(1, 4))))
    check_plan(old, new)


def test_fewer_and_more_hosts_with_sharded_states():
    ptc = gpt(4, 16, 4, 37, ffn=24, optimizer="adam", vocab_pad_multiple=4)
    big = layout(ptc, ParallelConfig.on_hosts(4, 2, 2, 4, 4, sharding="full"))
    small = layout(ptc, ParallelConfig.on_hosts(1, 2, 1, 1, 2, sharding="optimizer"))
    assert check_plan(big, small).stats.inter_host_bytes > 0
    check_plan(small, big)


def plan_both_ways(old, new):
    """The plan with every replica set's least-loaded host found by the heap, and by the plain scan."""
    from tenplex import planner
    saved = planner.HEAP_FROM
    try:
        planner.HEAP_FROM = 2
        heaped = plan(old, new)
        planner.HEAP_FROM = 1 << 60
        return heaped, plan(old, new)
    finally:
        planner.HEAP_FROM = saved


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(gpt_configs(), gpt_configs(), st.data())
def test_the_heap_picks_the_senders_the_scan_picks(old_config, new_config, data):
    """Sender choice by heap (many replica hosts, as at 16k devices) and by a scan give the same plan."""
    ptc = gpt(3, 8, 4, 13, ffn=7, optimizer="adam", vocab_pad_multiple=2)
    heaped, scanned = plan_both_ways(layout(ptc, old_config), layout(ptc, new_config))
    assert heaped == scanned
    tensors = {f"t{i}": ((data.draw(st.integers(1, 6)), 2), "float32") for i in range(3)}
    heaped, scanned = plan_both_ways(data.draw(random_layouts(tensors, 4)), data.draw(random_layouts(tensors, 3)))
    assert heaped == scanned
