"""The durable tier against a real S3 server (moto's, in its own process on loopback), reached only through
obstore as in production: flush from two hosts, lose every store, restore bit for bit into three."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from tenplex.box import Box
from tenplex.durable import Bucket, DurableError, durable_versions, flush_host, restore_host
from tenplex.durable.flush import assignment, version_key
from tenplex.durable.testserver import free_port, start_s3_server, stop
from tenplex.layout import Layout, Shard, TensorSpec
from tenplex.store import Store
from tenplex.store.manifest import CorruptShard

KEY, SECRET = "AKIATENPLEXTEST00001", "tenplex-test-secret"


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server with authentication on: its first three requests (IAM) are unauthenticated and make
    the one user whose key the tests use, so that wrong credentials are refused as by a real S3."""
    boto3 = pytest.importorskip("boto3")  # the admin side only (IAM, buckets): data goes through obstore
    proc, url = start_s3_server({"INITIAL_NO_AUTH_ACTION_COUNT": "3"})
    iam = boto3.client("iam", endpoint_url=url, region_name="us-east-1", aws_access_key_id="x",
                       aws_secret_access_key="x")
    iam.create_user(UserName="tenplex")
    made = iam.create_access_key(UserName="tenplex")["AccessKey"]
    iam.put_user_policy(UserName="tenplex", PolicyName="all", PolicyDocument=json.dumps(
        {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
    yield {"url": url, "key": made["AccessKeyId"], "secret": made["SecretAccessKey"], "boto3": boto3}
    stop(proc)


@pytest.fixture
def s3(s3_server, monkeypatch, request):
    """A fresh bucket for the test, credentials and endpoint in the standard environment variables."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server["secret"])
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server["url"])
    name = "t-" + request.node.name.lower().replace("_", "-")[:40] + f"-{os.getpid()}"
    s3_server["boto3"].client("s3", endpoint_url=s3_server["url"], region_name="us-east-1",
                              aws_access_key_id=s3_server["key"],
                              aws_secret_access_key=s3_server["secret"]).create_bucket(Bucket=name)
    return {**s3_server, "bucket": name, "location": f"s3://{name}/job-a"}


# ------------------------------------------------------------------ a saved version on two hosts
TENSORS = {"emb": TensorSpec((96, 40), "float32"), "w": TensorSpec((64, 48), "bfloat16"),
           "step": TensorSpec((), "int64")}


def old_layout() -> Layout:
    """Two hosts, two devices each: ``emb`` split by rows over h0 and replicated on h1 (dp), ``w`` split by
    columns on every device (tp 4), the scalar on h0/0."""
    devices: dict[str, list[Shard]] = {}
    for i, device in enumerate(["h0/0", "h0/1", "h1/0", "h1/1"]):
        devices[device] = [Shard("w", Box((0, 12 * i), (64, 12)))]
    devices["h0/0"] += [Shard("emb", Box((0, 0), (48, 40))), Shard("step", Box((), ()))]
    devices["h0/1"] += [Shard("emb", Box((48, 0), (48, 40)))]
    devices["h1/0"] += [Shard("emb", Box((0, 0), (96, 40)))]
    return Layout.build(TENSORS, devices)


def new_layout() -> Layout:
    """Three hosts, one device each: ``emb`` split by rows in three, ``w`` by rows in two plus a full copy."""
    return Layout.build(TENSORS, {
        "n0/0": [Shard("emb", Box((0, 0), (32, 40))), Shard("w", Box((0, 0), (32, 48))), Shard("step", Box((), ()))],
        "n1/0": [Shard("emb", Box((32, 0), (32, 40))), Shard("w", Box((32, 0), (32, 48)))],
        "n2/0": [Shard("emb", Box((64, 0), (32, 40))), Shard("w", Box((0, 0), (64, 48)))]})


def full_tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {"emb": rng.standard_normal((96, 40)).astype(np.float32),
            "w": rng.integers(0, 1 << 16, (64, 48), dtype=np.uint16),  # bfloat16 as its bits
            "step": np.array(1234, np.int64)}


def save(roots, layout: Layout, version: int, full: dict[str, np.ndarray]) -> dict[str, Store]:
    stores = {}
    for host in layout.hosts():
        store = stores[host] = Store(roots / host, host)
        with store.begin(version, part="rank0") as writer:
            for device, shard in layout.iter_shards():
                if device.startswith(host + "/"):
                    spec = layout.tensors[shard.tensor]
                    writer.put(device, shard.tensor, shard.box, np.array(full[shard.tensor][
                        shard.box.slices()]), spec.dtype, spec.shape)
            writer.put_layout(layout)
            writer.put_json("tenplex.torch_state", {"step": 1234, "position": 5678})
            writer.commit()
    return stores


def flush_all(stores: dict[str, Store], version: int, bucket: Bucket) -> list:
    return [flush_host(store, version, bucket) for _, store in sorted(stores.items())]


def test_whole_job_loss_restores_bit_for_bit_into_three_hosts(s3, tmp_path):
    """Flush from two hosts, delete every store directory, restore into three hosts of another layout."""
    full = full_tensors()
    bucket = Bucket(s3["location"])
    stores = save(tmp_path / "old", old_layout(), 3, full)
    results = flush_all(stores, 3, bucket)
    assert [r.durable for r in results] == [False, True]  # h1 finished last and wrote the marker
    assert durable_versions(bucket) == [3]
    # each region went up once: the bytes uploaded are the tensors' bytes, no more
    assert sum(r.bytes for r in results) == sum(spec.nbytes for spec in TENSORS.values())
    # the planner spreads the replicated emb over both of its holders: h1 uploads one half of it
    assert {h: sorted((t, str(b)) for _, t, b in items) for h, items in assignment(old_layout()).items()} == {
        "h0": [("emb", "[0:48, 0:40]"), ("step", "[]"), ("w", "[0:64, 0:12]"), ("w", "[0:64, 12:24]")],
        "h1": [("emb", "[48:96, 0:40]"), ("w", "[0:64, 24:36]"), ("w", "[0:64, 36:48]")]}
    for store in stores.values():
        import shutil
        shutil.rmtree(store.root)
    new = new_layout()
    fetched = {}
    for host in new.hosts():
        fetched[host] = restore_host(Bucket(s3["location"]), 3, new, Store(tmp_path / "new" / host, host))
    for device, shard in new.iter_shards():
        store = Store(tmp_path / "new" / device.split("/")[0], device.split("/")[0])
        reader = store.open(3)
        got = reader.read(device, shard.tensor, shard.box)
        np.testing.assert_array_equal(got, full[shard.tensor][shard.box.slices()])
        assert reader.get_json("tenplex.torch_state") == {"step": 1234, "position": 5678}
        assert reader.layout() == new
    # each host fetched only its own regions: n2's full copy of w is all of w
    assert fetched == {"n0": 32 * 40 * 4 + 32 * 48 * 2 + 8, "n1": 32 * 40 * 4 + 32 * 48 * 2,
                       "n2": 32 * 40 * 4 + 64 * 48 * 2}


def test_objects_are_safetensors_files(s3, tmp_path):
    """An object is a safetensors file that the official reader opens: its header names the tensor."""
    from safetensors.numpy import load

    full = full_tensors()
    bucket = Bucket(s3["location"])
    flush_all(save(tmp_path, old_layout(), 1, full), 1, bucket)
    manifest = json.loads(bucket.get(version_key(1, "manifest.json")))
    for row in manifest["shards"]:
        if row["dtype"] == "float32":
            loaded = load(bucket.get(version_key(1, row["file"])))
            box = Box(tuple(row["offsets"]), tuple(row["lengths"]))
            np.testing.assert_array_equal(loaded[row["tensor"]], full[row["tensor"]][box.slices()])


def test_damaged_object_is_detected_and_never_restored(s3, tmp_path):
    full = full_tensors()
    bucket = Bucket(s3["location"])
    flush_all(save(tmp_path / "old", old_layout(), 2, full), 2, bucket)
    manifest = json.loads(bucket.get(version_key(2, "manifest.json")))
    row = next(r for r in manifest["shards"] if r["tensor"] == "emb")
    data = bytearray(bucket.get(version_key(2, row["file"])))
    data[row["data_offset"] + 100] ^= 0xFF
    bucket.put(version_key(2, row["file"]), bytes(data))
    store = Store(tmp_path / "new" / "n0", "n0")
    with pytest.raises(CorruptShard, match=f"object {row['file']}.*block 0 has xxh3"):
        restore_host(bucket, 2, new_layout(), store)
    assert store.versions() == []  # nothing committed


def test_wrong_credentials_one_line_naming_the_bucket(s3, monkeypatch, tmp_path):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(DurableError) as err:
        flush_all(save(tmp_path, old_layout(), 1, full_tensors()), 1, Bucket(s3["location"]))
    text = str(err.value)
    assert "\n" not in text and f"bucket {s3['bucket']}: access denied" in text and not err.value.retryable


def test_flusher_with_wrong_credentials_logs_one_error_line_and_stops(s3, monkeypatch, tmp_path, caplog):
    from tenplex.durable.uploader import Flusher

    store = save(tmp_path, one_host_layout(), 1, full_tensors())["h0"]
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    flusher = Flusher(store, Bucket(s3["location"]), poll_s=0.05, backoff_s=0.05).start()
    with caplog.at_level("WARNING", logger="tenplex.durable"):
        wait_for(lambda: flusher.state == "stopped", "the flusher to stop")
        flusher.close()
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("tenplex.durable")]
    assert len(lines) == 1 and f"bucket {s3['bucket']}: access denied" in lines[0] and "\n" not in lines[0]


# ------------------------------------------------------------------ the background policy and its faults
def one_host_layout() -> Layout:
    return Layout.build(TENSORS, {"h0/0": [Shard(t, Box((0,) * len(s.shape), s.shape)) for t, s in TENSORS.items()]})


def wait_for(check, what: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_flusher_every_n_versions_newest_first_keeps_two(s3, tmp_path):
    from tenplex.durable.uploader import Flusher

    full, bucket = full_tensors(), Bucket(s3["location"])
    for v in (1, 2, 3, 4):
        store = save(tmp_path, one_host_layout(), v, full)["h0"]
    flusher = Flusher(store, bucket, every_versions=2, keep=2, poll_s=0.05).start()
    try:
        wait_for(lambda: flusher.done == 4, "version 4")
        assert durable_versions(bucket) == [4]  # newest first: 2 was never uploaded
        for v in (5, 6):
            save(tmp_path, one_host_layout(), v, full)
        flusher.notify()
        wait_for(lambda: flusher.done == 6, "version 6")
        save(tmp_path, one_host_layout(), 8, full)
        wait_for(lambda: flusher.done == 8, "version 8")
        assert durable_versions(bucket) == [6, 8]  # keep=2; 5 does not qualify
        assert not bucket.keys("versions/4/")      # the older one's objects went with its marker
        # done is set just before the thread turns idle: wait for the state it settles in, not the next instant
        wait_for(lambda: flusher.status()["state"] == "idle", "the flusher idle after version 8")
        assert flusher.status()["durable"] == 8
    finally:
        flusher.close()


def test_unreachable_bucket_saving_goes_on_retries_one_log_line(s3, tmp_path, caplog):
    from tenplex.durable.uploader import Flusher

    full = full_tensors()
    store = save(tmp_path, one_host_layout(), 1, full)["h0"]
    bucket = Bucket(s3["location"], endpoint=f"http://127.0.0.1:{free_port()}", timeout_s=2, retries=0)
    flusher = Flusher(store, bucket, poll_s=0.05, backoff_s=0.05, max_backoff_s=0.2).start()
    try:
        with caplog.at_level("WARNING", logger="tenplex.durable"):
            wait_for(lambda: flusher.failures >= 3, "three failed attempts")
            save(tmp_path, one_host_layout(), 2, full)  # saving goes on meanwhile
            failed = flusher.failures
            wait_for(lambda: flusher.failures >= failed + 2, "retries after the save")
        # what the flusher promises, not which instant of its upload/back-off cycle this line lands in: it keeps
        # retrying (never stops), nothing became durable, the local versions stay, one outage, one warning
        assert store.versions() == [1, 2] and flusher.done == 0 and flusher.durable is None
        assert flusher.state != "stopped" and flusher.outages == 1
        lines = [r.getMessage() for r in caplog.records if r.name.startswith("tenplex.durable")]
        assert len(lines) == 1 and f"bucket {s3['bucket']} unreachable" in lines[0] and "back-off" in lines[0]
    finally:
        flusher.close()


KILLED_FLUSH = """
import sys
from tenplex.durable import Bucket, RateLimit, flush_host
from tenplex.store import Store
flush_host(Store(sys.argv[1], "h0"), 1, Bucket(sys.argv[2], limit=RateLimit(2000)))
"""


def test_upload_killed_midway_leaves_nothing_durable(s3, tmp_path):
    full, bucket = full_tensors(), Bucket(s3["location"])
    stores = save(tmp_path, old_layout(), 1, full)
    assert not flush_host(stores["h1"], 1, bucket).durable  # h1's part is in; h0's would complete the version
    child = subprocess.Popen([sys.executable, "-c", KILLED_FLUSH, str(stores["h0"].root), s3["location"]])
    try:
        wait_for(lambda: any(k.startswith("versions/1/objects/h0-") for k in bucket.keys("versions/1/")),
                 "h0's first object")
    finally:
        child.kill()
        child.wait()
    assert durable_versions(bucket) == [] and not bucket.exists("versions/1/parts/h0.json")
    with pytest.raises(DurableError, match="no object 'versions/1/manifest.json'"):
        restore_host(bucket, 1, new_layout(), Store(tmp_path / "n0", "n0"))
    assert flush_host(stores["h0"], 1, bucket).durable  # flushing again completes it
    assert durable_versions(bucket) == [1]


# ------------------------------------------------------------------ a whole job lost, restored through Checkpointer
def _full_state(out, stem: str, results: list[list[dict]]) -> dict:
    """Each rank's dumped local state put together: rows of w and its moments; b from rank 0."""
    import torch
    from safetensors.torch import load_file

    parts = sorted(((next(o for o in ops if o["op"] == "save")["rows"][0],
                     load_file(str(out / f"{stem}_r{rank}.safetensors"))) for rank, ops in enumerate(results)),
                   key=lambda p: p[0])
    state = {k: v for k, v in parts[0][1].items() if k.endswith("b")}
    for key in [k for k in parts[0][1] if not k.endswith("b")]:
        state[key] = torch.cat([p[key] for _, p in parts])
    return state


def test_a_job_lost_whole_restores_from_the_bucket_into_three_hosts_and_continues(s3, tmp_path, monkeypatch):
    """Two hosts save at steps 2 and 4; step 2's version is flushed; every store directory is deleted; a job of
    four ranks on three hosts restores step 2 from the bucket (TENPLEX_DURABLE) and trains on to step 4, where
    its state equals the first job's bit for bit."""
    import shutil

    from store_helpers import StoreProcess, assert_bit_equal, run_replica_job

    roots = tmp_path / "stores"
    procs = {h: StoreProcess(roots / h, h) for h in ("h0", "h1")}
    try:
        first = run_replica_job(tmp_path, "first", ["h0/0", "h1/0"], procs,
                                [{"op": "train", "steps": 2}, {"op": "save"}, {"op": "train", "steps": 2},
                                 {"op": "save"}], replicas=0, keep=3)
    finally:
        for proc in procs.values():
            proc.stop()
    bucket = Bucket(s3["location"])
    assert [flush_host(Store(roots / h, h), 1, bucket).durable for h in ("h0", "h1")] == [False, True]
    shutil.rmtree(roots)
    monkeypatch.setenv("TENPLEX_DURABLE", s3["location"])
    procs = {h: StoreProcess(roots / h, h) for h in ("n0", "n1", "n2")}
    try:
        second = run_replica_job(tmp_path, "second", ["n0/0", "n0/1", "n1/0", "n2/0"], procs,
                                 [{"op": "restore"}, {"op": "train", "steps": 2}, {"op": "save"}], replicas=0)
    finally:
        for proc in procs.values():
            proc.stop()
    assert [ops[0].get("step") for ops in second] == [2, 2, 2, 2], second[0][0].get("message")
    assert [ops[0]["versions"] for ops in second] == [[1]] * 4  # the durable version, committed on every host
    assert_bit_equal(_full_state(tmp_path / "first", "saved_step4", first),
                     _full_state(tmp_path / "second", "saved_step4", second))


# ------------------------------------------------------------------ the command line
def test_tenplex_run_durable_option_reaches_the_workers():
    from tenplex.elastic.launcher import parse, worker_env
    from tenplex.errors import ConfigError

    spec = parse(["--host", "h0", "--store-root", "/tmp/s", "--durable", "s3://bkt/job-a", "--nproc-per-node", "1",
                  "train.py", "--lr", "1"])
    assert spec.durable == "s3://bkt/job-a" and spec.args == ["--lr", "1"] and "--durable" not in spec.torchrun
    assert worker_env(spec, "127.0.0.1:1", None)["TENPLEX_DURABLE"] == "s3://bkt/job-a"
    with pytest.raises(ConfigError, match="is not s3://BUCKET/PREFIX"):
        parse(["--host", "h0", "--store-root", "/tmp/s", "--durable", "bkt/job-a", "train.py"])


def _tenplex(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tenplex.cli", *args], capture_output=True, text=True, timeout=120)


def test_tenplex_durable_status_lists_durable_versions_and_unfinished_flushes(s3, tmp_path):
    bucket = Bucket(s3["location"])
    stores = save(tmp_path, old_layout(), 1, full_tensors())
    flush_all(stores, 1, bucket)
    save(tmp_path, old_layout(), 2, full_tensors())
    flush_host(stores["h0"], 2, bucket)  # h1 never flushes 2: unfinished
    proc = _tenplex("durable", "status", s3["location"], "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["durable"] == [{"version": 1, "step": 1234, "objects": 7,
                               "bytes": sum(spec.nbytes for spec in TENSORS.values())}]
    assert doc["unfinished"] == [2]
    bad = _tenplex("durable", "status", "bucket-without-scheme")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "s3://BUCKET/PREFIX" in bad.stderr


def test_bench_durable_json_keys(s3):
    proc = _tenplex("bench", "durable", "--json", "--mib", "1", "--endpoint", s3["url"], "--bucket", s3["bucket"])
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["state_bytes"] == 8 * 24 * 1024 * 4  # eight float32 tensors of 24 rows (1 MiB, cut to 12s) x 1024
    for key in ("flush_MBps", "restore_MBps", "raw_upload_MBps", "raw_download_MBps", "flush_vs_raw",
                "restore_vs_raw"):
        assert doc[key] > 0, key


# ------------------------------------------------------------------ Checkpointer: flusher after saves, which state wins
CHECKPOINTER_JOB = """
import json, sys
import torch, torch.distributed as dist
import tenplex
from tenplex.integration.process_group import init_process_group, leave_process_group
base, location = sys.argv[1], sys.argv[2]
# the documented ending of a gloo script (the elastic guide, "Ending a script of your own on gloo"): a plain
# destroy_process_group can abort the interpreter's exit ("terminate called without an active exception",
# pytorch issue 190489)
init_process_group("gloo", init_method=f"file://{base}/pg", rank=0, world_size=1)
torch.manual_seed(0)
model = torch.nn.Linear(4, 3)
optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
ckpt = tenplex.Checkpointer(store_root=f"{base}/h0", host="h0", replicas=0, durable=location)
weights = {}
for step in (1, 2, 3):
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    version = ckpt.save(model, optimizer, step=step)
    weights[step] = model.weight.detach().clone()
    if step == 2:
        assert ckpt.durable.wait(version, timeout=60), ckpt.durable.flusher.status()
ckpt.close()
out = {}
for name, root in (("hosts_newer", f"{base}/h0"), ("hosts_lost", f"{base}/h0-new")):
    fresh = torch.nn.Linear(4, 3)
    again = tenplex.Checkpointer(store_root=root, host="h0", replicas=0, durable=location)
    step = again.restore(fresh, torch.optim.Adam(fresh.parameters(), lr=0.1))
    out[name] = {"step": step, "equal": bool(torch.equal(fresh.weight, weights[step])),
                 "versions": again.store.versions()}
    again.close()
print(json.dumps(out))
leave_process_group()
"""


def test_checkpointer_flushes_in_the_background_and_a_newer_host_version_wins(s3, tmp_path, monkeypatch):
    """Every 2nd version is flushed (TENPLEX_DURABLE_EVERY=2): the bucket holds step 2 while the host holds step 3.
    With the host's store, its step 3 wins; with every store lost, step 2 comes back from the bucket."""
    monkeypatch.setenv("TENPLEX_DURABLE_EVERY", "2")
    proc = subprocess.run([sys.executable, "-c", CHECKPOINTER_JOB, str(tmp_path), s3["location"]],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["hosts_newer"] == {"step": 3, "equal": True, "versions": [2, 3]}
    assert out["hosts_lost"] == {"step": 2, "equal": True, "versions": [2]}
    assert durable_versions(Bucket(s3["location"])) == [2]


def test_upload_cap_is_a_token_bucket_of_one_seconds_burst(monkeypatch):
    """Golden waits: 1000 B/s, a burst of one second's worth; a take beyond the tokens sleeps for the debt."""
    from tenplex.durable import RateLimit
    from tenplex.durable import bucket as bucket_module

    clock, slept = [100.0], []
    monkeypatch.setattr(bucket_module.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(bucket_module.time, "sleep", slept.append)
    limit = RateLimit(1000)
    limit.take(600)      # 1000 tokens at the start: no wait
    limit.take(900)      # 400 left: 0.5 s of debt
    clock[0] += 10.0     # idle time refills at most one second's worth
    limit.take(1000)     # the bucket was at 1000 again (not 9500): no wait
    limit.take(250)
    assert slept == [0.5, 0.25]
    RateLimit(None).take(1 << 40)  # no cap: never waits
    assert slept == [0.5, 0.25]


def test_tenplexjob_spec_durable_reaches_tenplex_run_and_the_crd_accepts_it():
    import jsonschema
    import yaml

    from tenplex.operator.pods import worker_command
    from tenplex.operator.settings import WorkerSettings
    from tenplex.operator.spec import SpecError, parse_spec

    root = os.path.join(os.path.dirname(__file__), "..", "k8s")
    base = {"image": "i", "command": ["train.py"], "minNodes": 1, "maxNodes": 2}
    spec = parse_spec({**base, "durable": "s3://bkt/job-a"})
    command = worker_command(spec, "uid", WorkerSettings(), spec.gpus_per_node)
    assert command[command.index("--durable") + 1] == "s3://bkt/job-a" and command[-1] == "train.py"
    assert "--durable" not in worker_command(parse_spec(base), "uid", WorkerSettings(), 8)
    with pytest.raises(SpecError, match=r"spec.durable: must be s3://BUCKET/PREFIX"):
        parse_spec({**base, "durable": "bkt/job-a"})
    with open(os.path.join(root, "crd.yaml")) as f:
        crd = next(d for d in yaml.safe_load_all(f) if d and d["kind"] == "CustomResourceDefinition")
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    jsonschema.validate({**base, "durable": "s3://bkt/job-a"}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**base, "durable": "bkt/job-a"}, schema)
