"""A new shard is finished (fsynced, checksummed) by the thread that writes its last piece; prepare reuses that."""

from __future__ import annotations

import numpy as np
import pytest

from tenplex.box import Box
from tenplex.errors import StoreError
from tenplex.store import Store
from tenplex.transform.host import _Completion


def test_the_last_piece_finishes_a_shard_and_prepare_keeps_its_checksums(tmp_path):
    store = Store(tmp_path / "h0", "h0")
    values = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
    writer = store.begin(1, part="transform")
    pulled = writer.create("h0/0", "x", Box((0, 0), (8, 4)), "float32", (8, 4))
    fanned = writer.create("h0/1", "x", Box((0, 0), (8, 4)), "float32", (8, 4))
    completion = _Completion()
    for target in (pulled, pulled, fanned):
        completion.expect(target)
    completion.exclude(fanned)  # the fan-out writes into it after the pulls
    pulled.write(Box((0, 0), (4, 4)), values[:4])
    completion.landed(pulled)
    assert pulled._blocks is None  # one piece still to come
    pulled.write(Box((4, 0), (4, 4)), values[4:])
    completion.landed(pulled)
    blocks = pulled._blocks
    assert blocks  # finished by the last piece
    with pytest.raises(StoreError, match="already finished"):
        pulled.write(Box((0, 0), (1, 4)), values[:1])
    completion.landed(fanned)
    assert fanned._blocks is None
    fanned.write(Box((0, 0), (8, 4)), values)
    writer.prepare()
    assert pulled.finish() is blocks  # prepare reused the checksums
    store.commit(1)
    reader = store.open(1)
    for device in ("h0/0", "h0/1"):
        assert np.array_equal(reader.read(device, "x", Box((0, 0), (8, 4))), values)  # verified against the blocks
