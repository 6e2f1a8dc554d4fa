"""The parallel-configuration policy: golden choices for the default rule, pins, policy functions and errors."""

import ast
from pathlib import Path

import pytest

import tenplex
from tenplex.elastic.policy import Choice, choose
from tenplex.errors import ConfigError
from tenplex.parallel import ParallelConfig


def summary(choice: Choice) -> tuple:
    c = choice.config
    return (c.dp, c.tp, c.pp, choice.used, choice.idle)


# (world_size, ranks_per_node, max_tp, pp) -> (dp, tp, pp, used, idle)
GOLDEN = [
    ((1, 1, 8, None), (1, 1, 1, 1, ())),
    ((2, 2, 8, None), (1, 2, 1, 2, ())),
    ((4, 2, 8, None), (2, 2, 1, 4, ())),
    ((6, 2, 8, None), (3, 2, 1, 6, ())),
    ((8, 8, 8, None), (1, 8, 1, 8, ())),
    ((16, 8, 8, None), (2, 8, 1, 16, ())),
    ((16, 8, 4, None), (4, 4, 1, 16, ())),       # the cap
    ((24, 8, 3, None), (12, 2, 1, 24, ())),      # 3 does not divide 8: the largest divisor <= 3 is 2
    ((12, 6, 8, None), (2, 6, 1, 12, ())),
    ((12, 6, 4, None), (4, 3, 1, 12, ())),
    ((4, 1, 8, None), (4, 1, 1, 4, ())),         # one rank per node: tp never crosses nodes
    ((8, 4, 8, 2), (1, 4, 2, 8, ())),
    ((16, 4, 8, 2), (2, 4, 2, 16, ())),
    ((6, 2, 8, 2), (1, 2, 2, 4, (4, 5))),        # 6 % (tp*pp=4) = 2 ranks idle; tp stays 2
    ((10, 2, 8, 2), (2, 2, 2, 8, (8, 9))),
    ((2, 2, 8, 2), (1, 1, 2, 2, ())),            # tp*pp=4 > 2 ranks: tp shrinks to 1
    ((6, 2, 8, 4), (1, 1, 4, 4, (4, 5))),        # tp shrinks to 1, and 2 ranks stay idle
    ((3, 1, 8, 2), (1, 1, 2, 2, (2,))),
    ((8, 8, 1, None), (8, 1, 1, 8, ())),
]


@pytest.mark.parametrize("args,expected", GOLDEN, ids=[str(a) for a, _ in GOLDEN])
def test_default_policy_golden(args, expected):
    world, per_node, max_tp, pp = args
    choice = choose(world, per_node, max_tp=max_tp, pp=pp)
    assert summary(choice) == expected
    assert choice.world_size == world
    assert choice.config.world_size == choice.used
    assert choice.config.sharding == "none"
    # The config's devices are the first `used` ranks, rank r on node r // per_node, as torchrun numbers them.
    assert choice.config.devices == tuple(f"h{r // per_node}/{r % per_node}" for r in range(choice.used))


def test_tp_groups_never_span_nodes():
    for per_node in (1, 2, 3, 4, 6, 8):
        for nodes in (1, 2, 3, 5):
            for max_tp in (1, 2, 3, 4, 8):
                for pp in (None, 1, 2, 3):
                    world = per_node * nodes
                    if pp is not None and pp > world:
                        continue
                    choice = choose(world, per_node, max_tp=max_tp, pp=pp)
                    c = choice.config
                    assert per_node % c.tp == 0 and c.tp <= max_tp
                    assert c.pp == (pp or 1)
                    assert choice.used + len(choice.idle) == world
                    assert len(choice.idle) < c.tp * c.pp  # dp takes every full group
                    for rank in range(choice.used):
                        pp_i, dp_i, _ = c.coords(rank)
                        group = {c.device_at(pp_i, dp_i, t).split("/")[0] for t in range(c.tp)}
                        assert len(group) == 1, (world, per_node, max_tp, pp, rank, group)


def test_reason_says_why_and_names_idle_ranks():
    choice = choose(4, 2)
    assert choice.reason == ("default policy: tp=2: the largest divisor of 2 ranks per node <= max_tp=8; "
                             "pp=1 (not pinned); dp=2 takes the rest")
    choice = choose(6, 2, pp=2)
    assert choice.reason == ("default policy: tp=2: the largest divisor of 2 ranks per node <= max_tp=8; "
                             "pp=2 (pinned); dp=1 takes the rest; 2 of 6 ranks idle (ranks 4..5): "
                             "6 is not a multiple of tp*pp=4")
    choice = choose(2, 2, pp=2)
    assert "tp=1: the largest divisor of 2 ranks per node with tp*pp <= 2 ranks" in choice.reason


def test_idle_helpers_and_dict():
    choice = choose(6, 2, pp=2)
    assert [choice.is_idle(r) for r in range(6)] == [False] * 4 + [True] * 2
    with pytest.raises(ConfigError, match="outside the world of 6"):
        choice.is_idle(6)
    assert choice.degrees() == "dp=1,tp=2,pp=2"
    assert choice.to_dict() == {"world_size": 6, "used": 4, "idle": [4, 5], "ranks": [0, 1, 2, 3], "dp": 1, "tp": 2,
                                "pp": 2, "sharding": "none", "reason": choice.reason}


def test_sharding_and_host_names():
    choice = choose(4, 2, sharding="full", hosts=["a", "b"])
    assert choice.config.sharding == "full"
    assert choice.degrees() == "dp=2,tp=2,pp=1,sharding=full"
    assert choice.config.devices == ("a/0", "a/1", "b/0", "b/1")
    with pytest.raises(ConfigError, match="1 host names given for 2 nodes"):
        choose(4, 2, hosts=["a"])


def test_pinned_string_with_and_without_dp():
    pins = {4: "tp=1,pp=2", 6: "dp=1,tp=2", 8: "dp=2,tp=2,pp=2"}
    assert summary(choose(4, 2, pinned=pins)) == (2, 1, 2, 4, ())     # dp takes the rest
    assert summary(choose(6, 2, pinned=pins)) == (1, 2, 1, 2, (2, 3, 4, 5))  # explicit dp: the rest idle
    assert summary(choose(8, 2, pinned=pins)) == (2, 2, 2, 8, ())
    assert summary(choose(2, 2, pinned=pins)) == (1, 2, 1, 2, ())     # not pinned: the default
    assert choose(4, 2, pinned=pins).reason == "pinned for world size 4"
    assert choose(6, 2, pinned=pins).reason == "pinned for world size 6; 4 of 6 ranks idle (ranks 2..5)"
    assert summary(choose(6, 2, pinned={6: "tp=2,pp=2"})) == (1, 2, 2, 4, (4, 5))


def test_pinned_parallel_config_keeps_its_settings_on_this_worlds_devices():
    pin = ParallelConfig(2, 1, 2, ("x/0", "x/1", "x/2", "x/3"), sharding="optimizer", stage_layers=(3, 1))
    choice = choose(4, 2, pinned={4: pin})
    c = choice.config
    assert (c.dp, c.tp, c.pp, c.sharding, c.stage_layers) == (2, 1, 2, "optimizer", (3, 1))
    assert c.devices == ("h0/0", "h0/1", "h1/0", "h1/1")
    with pytest.raises(ConfigError, match="pinned for world size 2: .* needs 4 ranks but the world has 2"):
        choose(2, 2, pinned={2: pin})


def test_policy_function_and_precedence():
    calls = []

    def mine(world, per_node):
        calls.append((world, per_node))
        return "tp=1" if world == 4 else None

    assert summary(choose(4, 2, policy=mine)) == (4, 1, 1, 4, ())
    assert choose(4, 2, policy=mine).reason == "policy mine"
    assert summary(choose(2, 2, policy=mine)) == (1, 2, 1, 2, ())     # None: the default
    assert summary(choose(4, 2, policy=mine, pinned={4: "pp=2"})) == (2, 1, 2, 4, ())  # the pin wins (tp unnamed: 1)
    assert calls == [(4, 2), (4, 2), (2, 2)]
    with pytest.raises(ConfigError, match="policy bad: expected a ParallelConfig or a string"):
        def bad(world, per_node):
            return 3
        choose(4, 2, policy=bad)


@pytest.mark.parametrize("kwargs,message", [
    (dict(world_size=0, ranks_per_node=1), "world_size must be a positive integer"),
    (dict(world_size=4, ranks_per_node=0), "ranks_per_node must be a positive integer"),
    (dict(world_size=4, ranks_per_node=2, max_tp=0), "max_tp must be a positive integer"),
    (dict(world_size=4, ranks_per_node=2, pp=0), "pp must be a positive integer or None"),
    (dict(world_size=5, ranks_per_node=2), "world_size=5 is not a multiple of ranks_per_node=2"),
    (dict(world_size=2, ranks_per_node=2, pp=3), "pp=3 needs at least 3 ranks but the world has 2"),
    (dict(world_size=4, ranks_per_node=2, pinned={4: "tp=8"}), "'tp=8' needs tp\\*pp = 8 ranks"),
    (dict(world_size=4, ranks_per_node=2, pinned={4: "dp=4,tp=2"}), "'dp=4,tp=2' needs 8 ranks"),
    (dict(world_size=4, ranks_per_node=2, pinned={4: "tq=2"}), "cannot parse 'tq=2'"),
])
def test_bad_input_is_a_config_error(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        choose(**kwargs)


def test_policy_module_is_pure():
    tree = ast.parse((Path(tenplex.__file__).parent / "elastic" / "policy.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            imported.add(("." * node.level) + (node.module or ""))
        elif isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
    assert imported <= {"__future__", "dataclasses", "typing", "..devices", "..errors", "..parallel"}, imported


def test_importing_the_policy_loads_no_torch():
    import subprocess
    import sys
    code = "import sys, tenplex.elastic.policy; print(any(m == 'torch' or m.startswith('torch.') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


# Nodes of different sizes (issue 26: a node that lost a GPU keeps the others).
# (node sizes, max_tp, pp) -> (dp, tp, pp, training ranks, idle ranks)
UNEVEN = [
    (([8, 7], 8, None), (1, 8, 1, tuple(range(8)), tuple(range(8, 15)))),   # tp=8 is kept: h1's 7 ranks hold none
    (([8, 7], 1, None), (15, 1, 1, tuple(range(15)), ())),                  # data parallel: every device trains
    (([8, 7], 2, None), (7, 2, 1, tuple(range(14)), (14,))),                # h1 trains on 6 of its 7
    (([7, 8], 2, None), (7, 2, 1, tuple(range(6)) + tuple(range(7, 15)), (6,))),  # the idle rank is mid-world
    (([2, 1], 8, None), (1, 2, 1, (0, 1), (2,))),
    (([4, 3, 4], 4, 2), (1, 4, 2, (0, 1, 2, 3, 7, 8, 9, 10), (4, 5, 6))),   # a pipeline of two tp groups skips h1
    (([2, 1], 8, 2), (1, 1, 2, (0, 1), (2,))),                              # one tp group of 2 can't fill pp=2
    (([8] * 7 + [7], 8, None), (7, 8, 1, tuple(range(56)), tuple(range(56, 63)))),
    (([8] * 7 + [7], 4, None), (15, 4, 1, tuple(range(60)), (60, 61, 62))),
    (([8] * 7 + [7], 1, None), (63, 1, 1, tuple(range(63)), ())),           # 8 x 8 less one GPU: 63 train
    (([3, 3], 8, None), (2, 3, 1, tuple(range(6)), ())),                    # equal sizes as a list: the old rule
]


@pytest.mark.parametrize("args,expected", UNEVEN, ids=[str(a) for a, _ in UNEVEN])
def test_uneven_nodes_golden(args, expected):
    sizes, max_tp, pp = args
    choice = choose(sum(sizes), sizes, max_tp=max_tp, pp=pp)
    c = choice.config
    assert (c.dp, c.tp, c.pp, choice.ranks, choice.idle) == expected
    assert choice.used == len(choice.ranks) == c.world_size
    nodes = [f"h{n}/{i}" for n, size in enumerate(sizes) for i in range(size)]
    assert c.devices == tuple(nodes[r] for r in choice.ranks)
    assert [choice.position(r) for r in choice.ranks] == list(range(choice.used))
    assert all(choice.is_idle(r) for r in choice.idle)


def test_uneven_reason_says_why_ranks_idle_and_equal_lists_keep_the_old_reason():
    assert choose(15, [7, 8], max_tp=2).reason == (
        "default policy: tp=2: the largest divisor of 8 ranks on the largest node <= max_tp=2; pp=1 (not pinned); "
        "dp=7 takes the rest; nodes of 7+8 ranks: each trains on whole tp groups of 2, so 1 of 15 ranks idle "
        "(ranks 6)")
    assert choose(3, [2, 1], pp=2).reason.startswith(
        "default policy: tp=1: the largest divisor of 2 ranks on the largest node whose tp groups fill a pipeline "
        "of pp=2")
    assert choose(6, [2, 2, 2], pp=2).reason == choose(6, 2, pp=2).reason
    with pytest.raises(ConfigError, match="idle in this world"):
        choose(15, [7, 8], max_tp=2).position(6)


def test_uneven_tp_groups_stay_within_a_node_and_use_every_whole_pipeline():
    import itertools

    for sizes in itertools.product((1, 2, 3, 4, 6, 8), repeat=3):
        for max_tp in (1, 2, 4, 8):
            for pp in (None, 2, 3):
                world = sum(sizes)
                if pp is not None and pp > world:
                    continue
                choice = choose(world, list(sizes), max_tp=max_tp, pp=pp)
                c = choice.config
                hosts = [d.split("/")[0] for d in c.devices]
                for start in range(0, c.world_size, c.tp):
                    assert len(set(hosts[start:start + c.tp])) == 1, (sizes, max_tp, pp)
                groups = sum(n // c.tp for n in sizes)  # whole tp groups the nodes hold
                assert choice.used == (groups // c.pp) * c.pp * c.tp, (sizes, max_tp, pp)
                assert sorted(choice.ranks + choice.idle) == list(range(world))


def test_pins_on_uneven_nodes_take_whole_tp_groups():
    choice = choose(7, [3, 4], pinned={7: "tp=2"})
    assert (choice.config.dp, choice.ranks, choice.idle) == (3, (0, 1, 3, 4, 5, 6), (2,))
    assert choice.reason == "pinned for world size 7; 1 of 7 ranks idle (ranks 2)"
    with pytest.raises(ConfigError, match=r"needs 8 ranks but the world has 6 in whole tp groups of 2"):
        choose(7, [3, 4], pinned={7: "dp=4,tp=2"})


@pytest.mark.parametrize("sizes,match", [([2, 2], "add up to 4 ranks, but the world has 5"),
                                         ([2, 0, 3], "positive integer or a non-empty sequence"),
                                         ([], "positive integer or a non-empty sequence")])
def test_bad_node_sizes(sizes, match):
    with pytest.raises(ConfigError, match=match):
        choose(5, sizes)
