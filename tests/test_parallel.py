"""ParallelConfig: rank <-> (pp, dp, tp) mapping, device placement, validation, torchrun detection."""

import pytest

from tenplex.errors import ConfigError
from tenplex.devices import parse_host_addresses
from tenplex.parallel import ParallelConfig, detect, parse_degrees


def test_default_order_keeps_tp_groups_on_one_host():
    config = ParallelConfig.on_hosts(dp=2, tp=4, pp=2, hosts=4, devices_per_host=4)
    assert config.world_size == 16
    assert [config.coords(r) for r in range(5)] == [(0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 0, 3), (0, 1, 0)]
    assert config.coords(15) == (1, 1, 3)
    for pp in range(2):
        for dp in range(2):
            hosts = {config.device_at(pp, dp, tp).split("/")[0] for tp in range(4)}
            assert len(hosts) == 1
    assert config.device_at(1, 0, 2) == "h2/2"
    assert config.hosts() == ["h0", "h1", "h2", "h3"]


def test_rank_and_coords_are_inverse():
    config = ParallelConfig.on_hosts(dp=3, tp=2, pp=2, hosts=3, devices_per_host=4)
    for rank in range(config.world_size):
        assert config.rank_of(*config.coords(rank)) == rank


def test_explicit_mapping():
    mapping = [(0, dp, tp) for tp in range(2) for dp in range(2)]  # dp fastest
    config = ParallelConfig(dp=2, tp=2, pp=1, devices=("a/0", "a/1", "b/0", "b/1"), mapping=mapping)
    assert config.coords(1) == (0, 1, 0)
    assert config.rank_of(0, 1, 0) == 1
    assert config.device_at(0, 0, 1) == "b/0"
    with pytest.raises(ConfigError, match="exactly once"):
        ParallelConfig(dp=2, tp=2, pp=1, devices=("a/0", "a/1", "b/0", "b/1"), mapping=[(0, 0, 0)] * 4)


@pytest.mark.parametrize("kwargs, message", [
    (dict(dp=2, tp=2, pp=2, devices=tuple(f"h0/{i}" for i in range(6))), r"8 ranks, but 6 devices"),
    (dict(dp=0, tp=1, pp=1, devices=()), "dp must be a positive integer"),
    (dict(dp=1, tp=1, pp=1, devices=("h0/0",), sharding="zero2"), "sharding 'zero2' is not one of"),
    (dict(dp=2, tp=1, pp=1, devices=("h0/0", "h0/0")), "repeated: h0/0"),
    (dict(dp=1, tp=1, pp=1, devices=("gpu0",)), "HOST/INDEX"),
    (dict(dp=1, tp=1, pp=2, devices=("h0/0", "h0/1"), stage_layers=(3,)), "each of the pp=2 stages"),
])
def test_invalid_configs_name_the_values(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ParallelConfig(**kwargs)


def test_coordinate_range_errors():
    config = ParallelConfig.on_hosts(1, 2, 1, 1, 2)
    with pytest.raises(ConfigError, match="rank 2 is outside 0..1"):
        config.coords(2)
    with pytest.raises(ConfigError, match="outside"):
        config.rank_of(0, 0, 2)


def test_parse_degrees():
    assert parse_degrees("tp=4,dp=2") == {"dp": 2, "tp": 4, "pp": 1}
    assert parse_degrees(" tp = 2 , fsdp=0", options=("fsdp",)) == {"dp": 1, "tp": 2, "pp": 1, "fsdp": 0}
    for bad in ("dp=0", "xp=2", "dp", "dp=two", "fsdp=1"):
        with pytest.raises(ConfigError, match="expected e.g."):
            parse_degrees(bad)


def test_parse_host_addresses():
    assert parse_host_addresses("h0=127.0.0.1:7000, h1=[::1]:7001") == {"h0": "127.0.0.1:7000", "h1": "[::1]:7001"}
    assert parse_host_addresses("") == {}
    for bad, why in (("h0", "has no '='"), ("=a:1", "lacks the host"), ("h0=", "lacks the address"),
                     ("h0=a:1,h0=b:2", "twice")):
        with pytest.raises(ConfigError, match=f"TENPLEX_STORES .*{why}"):
            parse_host_addresses(bad, "TENPLEX_STORES")


def test_detect_reads_torchrun_environment():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1"}
    config, worker = detect(tp=2, pp=2, env=env)
    assert (config.dp, config.tp, config.pp) == (2, 2, 2)
    assert worker.device == "h1/1" and config.device(worker.rank) == "h1/1"
    assert config.coords(worker.rank) == (1, 0, 1)
    with pytest.raises(ConfigError, match="RANK is not set"):
        detect(env={})
    with pytest.raises(ConfigError, match="not divisible by tp\\*pp"):
        detect(tp=3, env=env)
