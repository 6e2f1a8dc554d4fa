"""The store servers under transformations with many streams, data-plane and gRPC reads and deletions at once:
no operation sees EBADF, every version is exact, no descriptor is left behind (issue 39 item 2). The long form
is ``scripts/store-stress``; ``tests/store_stress.py`` says what runs."""

from __future__ import annotations

from store_stress import run


def test_transformations_reads_and_deletions_at_once_close_no_descriptor_twice(tmp_path):
    outcome = run(tmp_path, rounds=4, streams=8, readers=4)
    assert not outcome.ebadf, outcome.ebadf[:5]
    assert not outcome.unexpected, outcome.unexpected[:5]
    assert not outcome.left_open, outcome.left_open
    assert outcome.transformations == 4 and outcome.collected >= 4
    assert outcome.reads["data plane"] and outcome.reads["grpc"]
