"""The Transform RPC's domain values and their protobuf form: only ``wire`` converts, and nothing is lost."""

from __future__ import annotations

import json

from tenplex.planner import plan
from tenplex.store import wire
from tenplex.store._proto import store_pb2 as pb
from tenplex.transform import TransformProgress, TransformRequest

from store_helpers import gpt_layout


def _request(**options) -> TransformRequest:
    old, new = gpt_layout(2, 2, 1, 2, 2), gpt_layout(1, 4, 1, 2, 2)
    return TransformRequest(host="h1", old_version=3, new_version=4, plan=plan(old, new), old_layout=old,
                            new_layout=new, peers={"h0": "127.0.0.1:5001", "h1": "127.0.0.1:5002"}, **options)


def test_a_request_survives_the_round_trip_through_its_message():
    for options in ({}, {"streams": 8, "chunk_bytes": 1 << 20, "json_from_host": "h0", "stall_timeout_s": 2.5}):
        request = _request(**options)
        message = wire.to_pb_transform_request(request)
        back = wire.from_pb_transform_request(pb.TransformRequest.FromString(message.SerializeToString()), "h9")
        assert back == request


def test_defaults_travel_as_the_messages_zero_values():
    """None (the transformer's default) is 0 or "" on the wire, as store.proto documents for other clients."""
    message = wire.to_pb_transform_request(_request())
    assert (message.streams, message.chunk_bytes, message.json_from_host, message.timeout_s) == (0, 0, "", 0.0)
    assert json.loads(message.plan_json)["format"] == "tenplex.plan/1"
    assert json.loads(message.new_layout_json)["format"] == "tenplex.layout/1"


def test_a_message_without_a_host_is_for_the_receiving_store():
    message = wire.to_pb_transform_request(_request())
    message.host = ""
    assert wire.from_pb_transform_request(message, "h9").host == "h9"


def test_progress_survives_the_round_trip_field_by_field():
    progress = TransformProgress(bytes_done=1, bytes_total=2, kept_bytes=3, linked_bytes=4, local_bytes=5,
                                 remote_bytes=6, refetched_bytes=7, sliced_bytes=8, done=True)
    message = wire.to_pb_transform_progress(progress)
    assert (message.bytes_done, message.bytes_total, message.kept_bytes, message.linked_bytes, message.local_bytes,
            message.remote_bytes, message.refetched_bytes, message.sliced_bytes, message.done) == \
        (1, 2, 3, 4, 5, 6, 7, 8, True)
    assert wire.from_pb_transform_progress(message) == progress
    assert progress.counts() == {"bytes_total": 2, "kept_bytes": 3, "linked_bytes": 4, "sliced_bytes": 8,
                                 "local_bytes": 5, "remote_bytes": 6, "refetched_bytes": 7}


def test_each_layout_is_encoded_once_for_the_requests_of_every_host(monkeypatch):
    """The coordinator's per-host threads encode their requests at once; each layout's JSON is made once."""
    import dataclasses
    import threading
    import time

    request = _request()
    encoded = []
    real_dumps = wire.json_bytes

    def counting_dumps(obj):
        if isinstance(obj, dict) and obj.get("format") == "tenplex.layout/1":
            encoded.append(id(obj))
            time.sleep(0.05)  # as a large layout takes a while: the other threads ask meanwhile
        return real_dumps(obj)

    monkeypatch.setattr(wire, "json_bytes", counting_dumps)
    start = threading.Barrier(8)

    def encode(host):
        start.wait()
        wire.to_pb_transform_request(dataclasses.replace(request, host=host))

    threads = [threading.Thread(target=encode, args=(f"h{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(encoded) == 2  # the old and the new layout


def test_each_host_picks_its_own_number_of_pulls_unless_told(monkeypatch, tmp_path):
    """transform() leaves the number of concurrent pulls to each destination host (None in the request, 0 on the
    wire); a host then pulls on one stream per CPU it may use (affinity and cgroup quota), at least 2, at most 4."""
    import inspect

    from tenplex.transform import coordinator, host

    old, new = gpt_layout(2, 2, 1, 2, 2), gpt_layout(1, 4, 1, 2, 2)
    stores = {"h0": "127.0.0.1:5001", "h1": "127.0.0.1:5002"}
    assert inspect.signature(coordinator.transform).parameters["streams"].default is None
    for streams, expected in ((None, None), (0, None), (3, 3)):
        requests = coordinator._requests(plan(old, new), old, new, stores, 1, 2, streams, 0, 5.0)
        assert {r.streams for r in requests.values()} == {expected}
    monkeypatch.setattr(host, "CGROUP_CPU_MAX", tmp_path / "absent")
    for cpus, expected in ((1, 2), (2, 2), (3, 3), (4, 4), (64, 4)):
        monkeypatch.setattr(host.os, "sched_getaffinity", lambda pid, n=cpus: set(range(n)))
        assert host.default_streams() == expected
    # a container's CPU limit (cgroup v2 cpu.max) counts too: 2.5 CPUs -> 3, none -> the affinity
    monkeypatch.setattr(host, "CGROUP_CPU_MAX", tmp_path / "cpu.max")
    for text, expected in (("250000 100000\n", 3), ("100000 100000\n", 2), ("max 100000\n", 4), ("", 4)):
        (tmp_path / "cpu.max").write_text(text)
        assert host.default_streams() == expected
