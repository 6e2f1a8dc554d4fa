"""A new shard is finished by the thread that writes its last region; fan-out copies run as soon as their source
region has landed (per region, so shards that feed each other cannot deadlock), and prepare reuses the checksums."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from tenplex.box import Box
from tenplex.errors import StoreError, TransformError
from tenplex.store import Store
from tenplex.transfer_plan import Transfer
from tenplex.transform.completion import Completion, FanOutCopy
from tenplex.transform.staging import _Work, _queue_fan_out

VALUES = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
TOP, BOTTOM, WHOLE = Box((0, 0), (4, 4)), Box((4, 0), (4, 4)), Box((0, 0), (8, 4))


def _targets(tmp_path, n):
    store = Store(tmp_path / "h0", "h0")
    writer = store.begin(1, part="transform")
    return store, writer, [writer.create(f"h0/{i}", "x", WHOLE, "float32", (8, 4)) for i in range(n)]


def _copy(box, target, source):
    return FanOutCopy(box, target, source, lambda: source.read(box), f"x {box}")


def test_the_last_region_finishes_a_shard_and_prepare_keeps_its_checksums(tmp_path):
    store, writer, (pulled, fanned) = _targets(tmp_path, 2)
    completion = Completion()
    completion.expect(pulled)
    completion.expect(pulled)
    completion.add_copy(_copy(WHOLE, fanned, pulled))
    pulled.write(TOP, VALUES[:4])
    completion.landed(pulled, TOP)
    assert pulled._blocks is None  # one region still to come
    pulled.write(BOTTOM, VALUES[4:])
    completion.landed(pulled, BOTTOM)
    blocks = pulled._blocks
    assert blocks  # finished by the last region
    with pytest.raises(StoreError, match="already finished"):
        pulled.write(Box((0, 0), (1, 4)), VALUES[:1])
    copied = []
    completion.run_copies(lambda: True, threading.Event(), copied.append)
    assert copied == [WHOLE.volume * 4]
    assert fanned._blocks  # the copy was its last write: finished by the fan-out thread
    writer.prepare()
    assert pulled.finish() is blocks  # prepare reused the checksums
    store.commit(1)
    reader = store.open(1)
    for device in ("h0/0", "h0/1"):
        assert np.array_equal(reader.read(device, "x", WHOLE), VALUES)  # verified against the blocks


def test_a_copy_is_released_when_its_region_has_landed_not_when_its_shard_is_complete(tmp_path):
    # a gets TOP pulled and BOTTOM copied from b; b gets BOTTOM pulled and TOP copied from a. Waiting for whole
    # shards would deadlock; waiting per region lets both copies run once the two pulls landed.
    _, _, (a, b) = _targets(tmp_path, 2)
    completion = Completion()
    completion.expect(a)
    completion.expect(b)
    completion.add_copy(_copy(BOTTOM, a, b))
    completion.add_copy(_copy(TOP, b, a))
    order = []
    a.write(TOP, VALUES[:4])
    completion.landed(a, TOP)
    done = threading.Event()
    fan_out = threading.Thread(target=completion.run_copies,
                               args=(done.is_set, threading.Event(), order.append))
    fan_out.start()
    deadline = time.monotonic() + 120
    while not order and fan_out.is_alive():  # b's copy runs (whenever the machine lets the thread run)
        assert time.monotonic() < deadline, "b's copy never ran"
        time.sleep(0.01)
    fan_out.join(0.2)  # gives a copy that did not wait the time to show itself
    assert fan_out.is_alive() and order == [TOP.volume * 4]  # b's copy ran; a's waits for b's BOTTOM
    b.write(BOTTOM, VALUES[4:])
    completion.landed(b, BOTTOM)
    done.set()
    fan_out.join(120)
    assert not fan_out.is_alive() and order == [TOP.volume * 4, BOTTOM.volume * 4]
    assert a._blocks and b._blocks  # each finished by its last write
    for target in (a, b):
        assert np.array_equal(target.read(WHOLE), VALUES)


def test_a_copy_whose_source_region_is_never_filled_fails_once_the_pulls_are_done(tmp_path):
    _, _, (a, b) = _targets(tmp_path, 2)
    completion = Completion()
    completion.expect(a)
    completion.add_copy(_copy(WHOLE, b, a))
    a.write(TOP, VALUES[:4])
    completion.landed(a, TOP)  # BOTTOM of a never comes
    with pytest.raises(TransformError, match="no transfer of the plan fills"):
        completion.run_copies(lambda: True, threading.Event(), lambda n: None)


def test_cancel_stops_a_waiting_fan_out_thread(tmp_path):
    _, _, (a, b) = _targets(tmp_path, 2)
    completion = Completion()
    completion.expect(a)
    completion.add_copy(_copy(WHOLE, b, a))
    cancelled = threading.Event()
    fan_out = threading.Thread(target=completion.run_copies, args=(lambda: False, cancelled, lambda n: None))
    fan_out.start()
    cancelled.set()
    fan_out.join(120)
    assert not fan_out.is_alive() and b._blocks is None  # nothing copied, nothing finished


def test_a_fan_out_from_a_shard_this_host_does_not_stage_fails_before_any_pull(tmp_path):
    _, _, (a,) = _targets(tmp_path, 1)
    work = _Work()
    work.targets[("h0/0", "x", WHOLE)] = a
    work.fan_out.append((Transfer("x", "h0/1", "h0/0", "new", WHOLE), ("h0/0", "x", WHOLE)))  # h0/1 stages nothing
    with pytest.raises(TransformError, match="h0/1's new shard to h0/0, but this host stages no such shard"):
        _queue_fan_out(work, None)
