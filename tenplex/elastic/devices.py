"""The devices of one node under ``tenplex run``: which it has, which failed, which its workers use.

May import: the standard library; ``pynvml`` (the ``nvidia-ml-py`` package) where it is installed. The
torch.cuda probe runs in a child process, so that the agent never holds a CUDA context of its own.

A node's devices are the first ``--nproc-per-node`` entries of ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs),
or ``0 … nproc-1`` without it (on CPU these are worker slots). A device leaves the set when its worker exits
with a device fault (:mod:`tenplex.elastic.faults`) or when it fails the health probe that runs before every
(re)start of the workers; it stays excluded for the life of that ``tenplex run``, so a broken device is
never retried in a loop (a new ``tenplex run``, e.g. a recreated pod, probes it afresh). Worker ``LOCAL_RANK``
``i`` uses the ``i``-th healthy device: ``tenplex run`` exports them in ``CUDA_VISIBLE_DEVICES`` (so
``cuda:LOCAL_RANK`` is that device) and ``TENPLEX_DEVICES``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field

NVIDIA_CONTROL = "/dev/nvidiactl"  # exists where NVIDIA's driver is loaded
# The torch.cuda probe: touch every visible device (a tiny kernel and a synchronize); print those that fail.
_TORCH_PROBE = """
import sys, torch
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        try:
            torch.ones(1, device=f"cuda:{i}").add_(1)
            torch.cuda.synchronize(i)
        except Exception as e:
            print(i, str(e).splitlines()[0] if str(e) else type(e).__name__, sep="\\t")
"""


def listed(nproc: int, visible: str | None) -> list[str]:
    """The node's devices: the first ``nproc`` of ``CUDA_VISIBLE_DEVICES``, else ``0 … nproc-1``."""
    given = [d.strip() for d in (visible or "").split(",") if d.strip()]
    return given[:nproc] if given else [str(i) for i in range(nproc)]


def probe_nvml(devices: list[str]) -> dict[str, str] | None:
    """The devices NVML reports unusable, with why; None where NVML is not installed or not working."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 -- no nvidia-ml-py, or no driver: another probe decides
        return None
    failed: dict[str, str] = {}
    try:
        for device in devices:
            try:
                handle = (pynvml.nvmlDeviceGetHandleByIndex(int(device)) if device.isdigit()
                          else pynvml.nvmlDeviceGetHandleByUUID(device))
                pynvml.nvmlDeviceGetMemoryInfo(handle)  # fails on a GPU that is lost or needs a reset
            except Exception as e:  # noqa: BLE001 -- NVMLError_GpuIsLost and friends
                failed[device] = f"NVML: {e}"
    finally:
        pynvml.nvmlShutdown()
    return failed


def probe_torch(devices: list[str], timeout: float = 60.0) -> dict[str, str]:
    """The devices on which a tiny CUDA kernel fails (a child process with only ``devices`` visible); none
    without CUDA."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(devices))
    try:
        out = subprocess.run([sys.executable, "-c", _TORCH_PROBE], env=env, capture_output=True, text=True,
                             timeout=timeout, check=False).stdout
    except subprocess.TimeoutExpired:  # a hung driver: every device is suspect, but say so rather than guess
        return {d: f"the torch.cuda probe hung for {timeout:g} s" for d in devices}
    failed = {}
    for line in out.splitlines():
        index, _, why = line.partition("\t")
        failed[devices[int(index)]] = f"torch.cuda: {why}"
    return failed


def probe(devices: list[str]) -> dict[str, str]:
    """The devices that fail a health probe (NVML where present, else torch.cuda), with why; none on a machine
    without NVIDIA's driver (no ``/dev/nvidiactl``: nothing to probe, and no torch import per restart)."""
    nvml = probe_nvml(devices)
    if nvml is not None:
        return nvml
    return probe_torch(devices) if os.path.exists(NVIDIA_CONTROL) else {}


@dataclass
class NodeDevices:
    """A node's devices and the ones excluded from it (device -> why)."""

    devices: list[str]
    excluded: dict[str, str] = field(default_factory=dict)
    gpus: bool = False        # whether the devices are CUDA_VISIBLE_DEVICES entries (else worker slots)

    @classmethod
    def of_node(cls, nproc: int, environ: dict[str, str] | os._Environ) -> "NodeDevices":
        visible = environ.get("CUDA_VISIBLE_DEVICES")
        return cls(listed(nproc, visible), gpus=bool(visible))

    @property
    def healthy(self) -> list[str]:
        return [d for d in self.devices if d not in self.excluded]

    def exclude(self, device: str, why: str) -> bool:
        """Exclude ``device``; whether it was in use until now."""
        if device in self.excluded:
            return False
        self.excluded[device] = why
        return True

    def env(self) -> dict[str, str]:
        """What the workers see: the healthy devices, in ``LOCAL_RANK`` order."""
        healthy = ",".join(self.healthy)
        env = {"TENPLEX_DEVICES": healthy}
        if self.gpus or self.excluded:
            env["CUDA_VISIBLE_DEVICES"] = healthy
        return env


def worker_device() -> str | None:
    """The device this worker runs on (``TENPLEX_DEVICES[LOCAL_RANK]``); None outside ``tenplex run``."""
    devices = os.environ.get("TENPLEX_DEVICES")
    local = os.environ.get("LOCAL_RANK")
    if not devices or local is None:
        return None
    listed_ = devices.split(",")
    return listed_[int(local)] if int(local) < len(listed_) else None
