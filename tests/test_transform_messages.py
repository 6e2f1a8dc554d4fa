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
    for streams, expected in ((None, None), (3, 3)):  # 0 is refused (issue 31 item 16)
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


# ---- issue 31 item 16: counts below 1 are refused by the CLI, the API and the RPC ---------------------------------
def test_requests_refuse_counts_below_one_and_timeouts_not_positive():
    import pytest

    from tenplex.errors import ConfigError

    for bad in ({"streams": -2}, {"streams": 0}, {"chunk_bytes": -1}, {"stall_timeout_s": 0.0},
                {"stall_timeout_s": -1.0}):
        with pytest.raises(ConfigError, match=f"{next(iter(bad))} must be"):
            _request(**bad)
    message = wire.to_pb_transform_request(_request())
    message.streams = -2  # what another client could send: refused on decoding, before any work
    with pytest.raises(ConfigError, match="streams must be an integer >= 1"):
        wire.from_pb_transform_request(message, "h1")


def test_the_api_refuses_bad_counts_before_touching_a_host():
    import pytest

    from tenplex.errors import ConfigError
    from tenplex.transform import transform

    old, new = gpt_layout(2, 2, 1, 2, 2), gpt_layout(1, 4, 1, 2, 2)
    stores = {"h0": "127.0.0.1:1", "h1": "127.0.0.1:1"}  # nothing listens: any call would fail otherwise
    for bad, match in (({"streams": -2}, "streams must be"), ({"streams": 0}, "streams must be"),
                       ({"chunk_bytes": -5}, "chunk_bytes must be"), ({"pull_timeout": 0}, "pull_timeout must be"),
                       ({"timeout": -1}, "timeout must be")):
        with pytest.raises(ConfigError, match=match):
            transform(plan(old, new), old, new, stores, 1, 2, **bad)


def test_the_rpc_answers_invalid_argument_for_negative_streams(tmp_path, caplog):
    import grpc

    from tenplex.store import Store
    from tenplex.store.server import serve
    from tenplex.transform.host import run_host_part

    server, port = serve(Store(tmp_path / "h1", "h1"), port=0, transformer=run_host_part, data_plane=False)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=wire.channel_options())
    try:
        message = wire.to_pb_transform_request(_request())
        message.streams = -2
        call = channel.unary_stream("/tenplex.v1.Store/Transform", request_serializer=lambda m: m.SerializeToString(),
                                    response_deserializer=pb.TransformProgress.FromString)
        try:
            with caplog.at_level("WARNING", logger="tenplex.store.server"):
                list(call(message, timeout=60))
            raise AssertionError("a Transform with streams -2 was accepted")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.details()
            assert "streams must be an integer >= 1" in e.details()
        # the store's own log says so too (its operators see no coordinator's output)
        assert any(r.getMessage().startswith("transformation to version 4 on host h1 failed: ") and
                   "streams must be an integer >= 1" in r.getMessage() for r in caplog.records)
    finally:
        channel.close()
        server.stop(grace=None)


def test_the_cli_refuses_bad_counts_with_exit_2(tmp_path):
    import subprocess
    import sys

    for flag, value in (("--streams", "-2"), ("--streams", "0"), ("--streams", "two")):
        done = subprocess.run([sys.executable, "-m", "tenplex.cli.store", "transform", "p.json", "o.json", "n.json",
                               "--stores", "h0=127.0.0.1:1", "--old-version", "1", "--new-version", "2", flag, value],
                              capture_output=True, text=True, cwd=tmp_path, timeout=120)
        assert done.returncode == 2, done.stderr
        assert f"{value!r} is not a count: use an integer >= 1" in done.stderr
        assert "Traceback" not in done.stderr
    done = subprocess.run([sys.executable, "-m", "tenplex.cli.store", "serve", "--max-streams", "0"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 2 and "'0' is not a count" in done.stderr
