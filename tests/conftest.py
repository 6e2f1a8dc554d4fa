"""Suite-wide pytest hooks: the slowest test files run first.

``make test`` runs the files on pytest-xdist workers (``--dist loadfile --no-loadscope-reorder``: each worker takes
the next file in this order when it is free). Longest first leaves the many short files to fill the end, so that
no worker runs one long file alone while the others are done. The order only changes when a file runs, never what
it checks: files are independent, and a file's own tests keep their order.
"""

from __future__ import annotations

import pytest

# The slowest files, slowest first: their wall time in a two-worker run of the whole suite (2026-12-05, 2 cores,
# `pytest -n 2 --dist loadfile --durations=80`, load 15-20; files added later by their authors' timings). A file
# missing here just runs in its usual place.
SLOW_FIRST = (
    "test_bench_goodput.py",
    "test_snapshot.py",
    "test_elastic_restarts.py",
    "test_elastic_dataview.py",
    "test_elastic_sources.py",
    "test_elastic_ddp_defaults.py",
    "test_elastic_torchrun.py",
    "test_elastic_gpufail.py",
    "test_elastic_dtensor_worlds.py",
    "test_elastic_inplace_faults.py",
    "test_examples_llama_ddp.py",
    "test_elastic_partition.py",
    "test_elastic_sigterm.py",
    "test_bench_compare.py",
    "test_readthrough.py",
    "test_demo_installed.py",
    "test_elastic_evict.py",
    "test_snapshot_replication.py",
    "test_replication.py",
    "test_demo.py",
    "test_examples_gpt_train.py",
    "test_process_group.py",
    "test_snapshot_lost_host.py",
    "test_elastic_join_batch.py",
    "test_elastic_inplace_memory.py",
    "test_elastic_inplace_tp.py",
    "test_share_planner.py",
    "test_integration_gpt.py",
    "test_ops_metrics.py",
    "test_integration_models.py",
)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
