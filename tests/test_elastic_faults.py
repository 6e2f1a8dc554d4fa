"""Classifying what ended a worker (tenplex.elastic.faults), the entry shim's exit codes for real Python
programs, the injected device fault, and a node's device set (tenplex.elastic.devices)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from tenplex.elastic import devices, faults
from tenplex.elastic.faults import CRASH, DEVICE, PEER, classify

GLOO_RESET = ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:43120: "
              "Connection reset by peer")


@pytest.mark.parametrize("error,kind", [
    (RuntimeError(faults.INJECTED_TEXT), DEVICE),
    (RuntimeError("CUDA error: unspecified launch failure\nCUDA kernel errors might be asynchronously reported"),
     DEVICE),
    (dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error (run with "
                           "NCCL_DEBUG=INFO for details), NCCL version 2.21.5"), DEVICE),
    (RuntimeError(GLOO_RESET), PEER),
    (dist.DistBackendError("[gloo/transport/tcp/pair.cc:598] Connection closed by peer [127.0.0.1]:5"), PEER),
    (dist.DistNetworkError("failed to recv, got 0 bytes"), PEER),
    (RuntimeError("[pair.cc:446] Timed out waiting 15000ms for recv operation to complete"), PEER),
    (dist.DistBackendError("NCCL error: remote process exited or there was a network error, NCCL version 2.21"),
     PEER),
    # A program's own CUDA errors and bugs are crashes: they would fail the same way anywhere.
    (RuntimeError("CUDA error: device-side assert triggered"), CRASH),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), CRASH),
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), CRASH),
    (ValueError("shapes (3,) and (4,) do not match"), CRASH),
    (KeyboardInterrupt(), CRASH),
])
def test_classify_golden(error, kind):
    assert classify(error) == kind


def test_classify_follows_the_cause():
    try:
        try:
            raise RuntimeError(GLOO_RESET)
        except RuntimeError as e:
            raise ValueError("the training step failed") from e
    except ValueError as wrapped:
        assert classify(wrapped) == PEER


def test_exit_codes_and_their_meaning():
    assert (faults.EXIT_PEER_LOST, faults.EXIT_DEVICE_FAULT) == (75, 76)
    assert [faults.of_exit(c) for c in (75, 76, 1, -9, 0)] == [PEER, DEVICE, CRASH, CRASH, CRASH]


def _entry(tmp_path, body: str, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "helper.py").write_text("VALUE = 'from the script folder'\n")
    script = tmp_path / "script.py"
    script.write_text("import sys\nimport helper\n" + body)
    env = dict(os.environ, TENPLEX_HOST="h1", LOCAL_RANK="1")
    return subprocess.run([sys.executable, "-u", "-m", "tenplex.elastic.entry", "script", str(script), *args],
                          capture_output=True, text=True, env=env, cwd="/", timeout=120)


@pytest.mark.parametrize("body,code,says", [
    (f"raise RuntimeError({faults.INJECTED_TEXT!r})\n", 76, "worker h1/1 stopped: device fault"),
    (f"raise RuntimeError({GLOO_RESET!r})\n", 75, "worker h1/1 stopped: peer lost"),
    ("raise ValueError('a bug')\n", 1, "ValueError: a bug"),
    ("sys.exit(3)\n", 3, ""),
])
def test_entry_runs_python_and_exits_with_the_class_of_its_failure(tmp_path, body, code, says):
    out = _entry(tmp_path, body)
    assert out.returncode == code, out.stderr
    assert says in out.stderr
    if code in (75, 76):
        assert "Traceback" in out.stderr  # the user still sees where it happened


def test_entry_runs_a_script_as_python_would(tmp_path):
    out = _entry(tmp_path, "print(sys.argv, helper.VALUE, __name__)\n", "--lr", "1")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"[{str(tmp_path / 'script.py')!r}, '--lr', '1'] from the script folder __main__"


def test_injected_fault_names_host_device_and_step(monkeypatch):
    assert faults.injected("h1/1@4, h0/0@9") == [("h1", "1", 4), ("h0", "0", 9)]
    with pytest.raises(ValueError, match="'h1@4' is not HOST/DEVICE@STEP"):
        faults.injected("h1@4")
    monkeypatch.setenv(faults.INJECT_ENV, "h1/1@4")
    faults.inject_device_fault("h1", "1", 3)      # before its step
    faults.inject_device_fault("h1", "0", 4)      # another device
    faults.inject_device_fault("h0", "1", 4)      # another host
    for step in (4, 7):                           # the device stays broken
        with pytest.raises(RuntimeError) as e:
            faults.inject_device_fault("h1", "1", step)
        assert classify(e.value) == DEVICE


def test_node_devices_and_what_workers_see(monkeypatch):
    assert devices.listed(2, None) == ["0", "1"]
    assert devices.listed(2, "3,5,7") == ["3", "5"]
    node = devices.NodeDevices.of_node(2, {})
    assert node.env() == {"TENPLEX_DEVICES": "0,1"}   # CPU slots: CUDA_VISIBLE_DEVICES left alone
    assert node.exclude("1", "device fault") and not node.exclude("1", "again")
    assert node.healthy == ["0"] and node.env() == {"TENPLEX_DEVICES": "0", "CUDA_VISIBLE_DEVICES": "0"}
    gpus = devices.NodeDevices.of_node(4, {"CUDA_VISIBLE_DEVICES": "2,3,6"})
    gpus.exclude("3", "probe")
    assert gpus.env() == {"TENPLEX_DEVICES": "2,6", "CUDA_VISIBLE_DEVICES": "2,6"}
    monkeypatch.setenv("TENPLEX_DEVICES", "2,6")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert devices.worker_device() == "6"


@pytest.mark.skipif(os.path.exists(devices.NVIDIA_CONTROL), reason="a machine with NVIDIA's driver")
def test_probe_without_a_gpu_driver_finds_nothing_to_exclude():
    assert devices.probe(["0", "1"]) == {}


def test_nvml_probe_reports_a_lost_gpu(tmp_path, monkeypatch):
    # nvidia-ml-py's API, as a GPU that fell off the bus answers it (no GPU here; the probe's logic is tested).
    (tmp_path / "pynvml.py").write_text(
        "class NVMLError_GpuIsLost(Exception):\n    pass\n"
        "def nvmlInit(): pass\ndef nvmlShutdown(): pass\n"
        "def nvmlDeviceGetHandleByIndex(i): return i\n"
        "def nvmlDeviceGetHandleByUUID(u): return u\n"
        "def nvmlDeviceGetMemoryInfo(h):\n"
        "    if h in (1, 'GPU-b'):\n        raise NVMLError_GpuIsLost('GPU is lost')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    try:
        assert devices.probe(["0", "1"]) == {"1": "NVML: GPU is lost"}
        assert devices.probe(["GPU-a", "GPU-b"]) == {"GPU-b": "NVML: GPU is lost"}
    finally:
        # The fake must not outlive this test: a later test in this process (the supervisor's, in process) took
        # it from sys.modules, excluded a CPU slot as a lost GPU, and waited for that slot's worker for good.
        sys.modules.pop("pynvml", None)
