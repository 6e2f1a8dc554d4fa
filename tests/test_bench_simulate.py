"""The cluster model of `tenplex bench simulate`: golden values on hand-made layouts, and the CLI's rows."""

from __future__ import annotations

import json
import math

import pytest

from tenplex.bench.simulate import Cluster, dcp_shared_seconds, seconds, validate
from tenplex.box import Box
from tenplex.layout import Layout, Shard, TensorSpec

SPEC = {"x": TensorSpec((1000,), "float32")}  # 4,000 bytes
WHOLE = Box((0,), (1000,))
HALF = (Box((0,), (500,)), Box((500,), (500,)))


def layout(devices: dict[str, list[Box]]) -> Layout:
    return Layout.build(SPEC, {d: tuple(Shard("x", b) for b in boxes) for d, boxes in devices.items()})


def test_one_tensor_moving_to_another_host():
    old, new = layout({"h0/0": [WHOLE]}), layout({"h1/0": [WHOLE]})
    links_only = Cluster(link_gbps=1e-6, storage_gbps=2e-6)  # 1,000 B/s per link, 2,000 B/s storage
    # tenplex: 4,000 B over h0's and h1's links at once; centralised: gathered on h0 (local), then h0 -> h1
    # DCP: h0 writes 4,000 B (its link: 4 s; storage 2 s), then h1 reads them (4 s)
    assert seconds(old, new, links_only) == pytest.approx({"tenplex_s": 4.0, "centralised_s": 4.0,
                                                          "dcp_shared_s": 8.0})
    writes = Cluster(link_gbps=1e-6, storage_gbps=2e-6, write_gbps=2e-6)
    # the gather moves h0/0's whole shard to another device of h0: the transformer hard-links it, no write
    assert seconds(old, new, writes) == pytest.approx({"tenplex_s": 4.0, "centralised_s": 4.0, "dcp_shared_s": 8.0})
    # in halves on two devices, the gather writes the whole tensor on h0 (2 s) before anything leaves it
    halves = layout({"h0/0": HALF[:1], "h0/1": HALF[1:]})
    assert seconds(halves, new, writes) == pytest.approx({"tenplex_s": 4.0, "centralised_s": 6.0,
                                                          "dcp_shared_s": 8.0})


def test_links_and_slices_write_nothing():
    """What the transformer hard-links costs no write: a whole old shard of the host, or a contiguous run of one
    (a slice); a column block is written."""
    writes = Cluster(link_gbps=math.inf, storage_gbps=math.inf, write_gbps=2e-6)  # 2,000 B/s
    old = layout({"h0/0": [WHOLE], "h0/1": [WHOLE]})
    assert seconds(old, layout({"h0/0": [HALF[0]], "h0/1": [HALF[1]]}), writes)["tenplex_s"] == 0  # ZeRO on
    assert seconds(old, layout({"h0/2": [WHOLE]}), writes)["tenplex_s"] == 0  # a whole shard to another device
    # two halves into one new shard: the second half is written (1 s), the first too, as the shard is new
    assert seconds(layout({"h0/0": [HALF[0]], "h0/1": [HALF[1]]}), layout({"h0/0": [WHOLE]}),
                   writes)["tenplex_s"] == pytest.approx(2.0)
    grid = {"x": TensorSpec((10, 100), "float32")}  # 4,000 bytes
    columns = Layout.build(grid, {"h0/0": (Shard("x", Box((0, 0), (10, 50))),)})
    assert seconds(Layout.build(grid, {"h0/0": (Shard("x", Box((0, 0), (10, 100))),)}), columns,
                   writes)["tenplex_s"] == pytest.approx(1.0)  # 2,000 B of a column block


def test_spreading_a_tensor_uses_every_link_at_once():
    old = layout({"h0/0": HALF[:1], "h1/0": HALF[1:]})
    new = layout({"h2/0": [WHOLE], "h3/0": [WHOLE]})
    cluster = Cluster(link_gbps=1e-6, storage_gbps=math.inf)
    # tenplex: h0 and h1 each send 2,000 B to h2 and to h3 (4,000 B out each), h2 and h3 each receive 4,000 B
    # centralised: gather 2,000 B into h0, then h0 sends 4,000 B to h2 and 4,000 B to h3
    modelled = seconds(old, new, cluster)
    assert modelled["tenplex_s"] == pytest.approx(4.0)
    assert modelled["centralised_s"] == pytest.approx(2.0 + 8.0)
    # a fabric of 1,000 B/s for everything at once serialises tenplex's 8,000 B
    assert seconds(old, new, Cluster(1e-6, math.inf, fabric_gbps=1e-6))["tenplex_s"] == pytest.approx(8.0)


def test_dcp_writes_each_replicated_box_once_balanced_over_hosts():
    old = layout({"h0/0": list(HALF), "h1/0": list(HALF)})  # two replicas of both halves
    new = layout({"h0/0": [WHOLE]})
    # h0 writes one half and h1 the other (2,000 B each, 2 s at 1,000 B/s); h0 then reads 4,000 B (4 s)
    assert dcp_shared_seconds(old, new, Cluster(1e-6, math.inf)) == pytest.approx(6.0)


def test_validate_models_the_rows_of_bench_compare(tmp_path):
    row = {"change": "dp 2->1, tp 1->2", "method": "centralised", "seconds": 0.5, "from": "dp=2 on 2 hosts x 1 device",
           "raw_socket_file_gbps": 1.0, "model": {"layers": 2, "hidden": 64, "heads": 4, "vocab": 512}}
    path = tmp_path / "compare.jsonl"
    path.write_text(" 07:00:00 up 1 day\n" + json.dumps(row) + "\n" + json.dumps({**row, "method": "dcp_disk"}) + "\n")
    (result,) = validate(path)
    assert result["method"] == "centralised" and result["measured_s"] == 0.5
    assert result["modelled_s"] > 0 and result["measured_over_modelled"] == pytest.approx(0.5 / result["modelled_s"],
                                                                                         rel=0.05)
    assert result["local_fabric_gbps"] == 1.0  # a run with no local baselines: the socket-to-file rate


def test_validate_copies_within_a_host_at_the_file_copy_rate(tmp_path):
    """A local-only change (pp 2->4 with tp 2->1: every byte that is not linked is copied within its host) is
    modelled at the run's file_copy_gbps, falling back to fresh_file_write_gbps for runs that did not measure it."""
    from tenplex.bench import compare

    change = next(name for name, *config in compare.CHANGES if config[:3] == [2, 1, 4])
    row = {"change": change, "method": "tenplex", "seconds": 0.5, "from": compare.BASE[0],
           "raw_socket_file_gbps": 0.001, "fresh_file_write_gbps": 0.004, "file_copy_gbps": 0.002,  # seconds, not ms
           "model": {"layers": 4, "hidden": 64, "heads": 4, "vocab": 512}}
    path = tmp_path / "compare.jsonl"
    older = {k: v for k, v in row.items() if k != "file_copy_gbps"}
    path.write_text(json.dumps(row) + "\n" + json.dumps(older) + "\n")
    copy, write = validate(path)
    assert (copy["local_fabric_gbps"], write["local_fabric_gbps"]) == (0.002, 0.004)
    assert copy["modelled_s"] > 0.1 and copy["modelled_s"] == pytest.approx(2 * write["modelled_s"], rel=1e-3)
