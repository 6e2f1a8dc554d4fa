"""Classify what ended a worker, once, where it surfaces: a device fault, a lost peer, or a crash.

May import: the standard library only (:mod:`tenplex.elastic.entry` uses it before the user's program runs,
and ``tenplex run``'s agent reads the exit codes it defines).

* **device fault**: the worker's GPU failed (an uncorrectable ECC error, a launch failure after an Xid, NCCL
  unable to call CUDA). The worker exits with :data:`EXIT_DEVICE_FAULT`; its agent excludes that device and
  re-joins the job with the others (:mod:`tenplex.elastic.restarts`).
* **peer lost**: a collective failed because another rank is gone (its node died, left, or lost a device).
  The worker exits with :data:`EXIT_PEER_LOST`; the next world goes on without that peer.
* **crash**: anything else, a bug in the user's code included. Only crashes count toward ``--max-restarts``.

Errors are recognised by the text torch, gloo and NCCL put in them (torch raises both device faults and
distributed errors as ``RuntimeError`` subclasses). A CUDA error that a program causes itself (a device-side
assert, an illegal address, out of memory) is a crash: restarting it elsewhere would fail the same way.
"""

from __future__ import annotations

import os

# Exit code of a rank that stopped because a peer is gone or was asked to stop (a membership change): non-zero,
# so that its agent restarts it in the next world instead of treating the job as finished.
EXIT_PEER_LOST = 75
# Exit code of a rank whose own device failed: its agent excludes the device (sysexits' EX_PROTOCOL is unused
# by Python and torch).
EXIT_DEVICE_FAULT = 76

DEVICE, PEER, CRASH = "device fault", "peer lost", "crash"

# cudaGetErrorString texts of hardware faults, as torch words them ("CUDA error: <text>"), and NCCL's
# wording of a CUDA call that failed under it.
DEVICE_FAULT_TEXTS = (
    "CUDA error: uncorrectable ECC error encountered",
    "CUDA error: uncorrectable NVLink error",
    "CUDA error: unspecified launch failure",
    "CUDA error: hardware stack error",
    "CUDA error: CUDA-capable device(s) is/are busy or unavailable",
    "CUDA error: no CUDA-capable device is detected",
    "unhandled cuda error",
    "ncclUnhandledCudaError",
)
# A peer's process or host is gone: gloo's and the TCP store's socket errors, NCCL's remote and watchdog errors.
PEER_LOST_TEXTS = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "Connection refused",
    "ncclRemoteError",
    "remote process exited or there was a network error",
    "NCCL communicator was aborted",
    "Watchdog caught collective operation timeout",
    "ms for recv operation to complete",   # gloo: a peer that sends no reset (a cut link, a frozen host)
    "ms for send operation to complete",
)
# Exception types of torch.distributed that only a lost connection raises (matched by name: no torch here).
PEER_LOST_TYPES = ("DistNetworkError",)


def classify(error: BaseException) -> str:
    """:data:`DEVICE`, :data:`PEER` or :data:`CRASH` for an exception (its causes and context included)."""
    seen: set[int] = set()
    chain: list[BaseException] = []
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or e.__context__
    text = "\n".join(str(x) for x in chain)
    if any(t in text for t in DEVICE_FAULT_TEXTS):
        return DEVICE
    names = {c.__name__ for x in chain for c in type(x).__mro__}
    if names.intersection(PEER_LOST_TYPES) or any(t in text for t in PEER_LOST_TEXTS):
        return PEER
    return CRASH


def exit_code(kind: str) -> int | None:
    """The worker exit code of a classified failure; None for a crash (it exits as Python would)."""
    return {DEVICE: EXIT_DEVICE_FAULT, PEER: EXIT_PEER_LOST}.get(kind)


def of_exit(code: int) -> str:
    """What a worker's exit code says: a device fault, a lost peer, or a crash (any other failure, a signal's
    negative code included)."""
    return {EXIT_DEVICE_FAULT: DEVICE, EXIT_PEER_LOST: PEER}.get(code, CRASH)


# Tests and demos on CPU: "HOST/DEVICE@STEP[,…]" makes the worker on that device of that host fail with a device
# fault at the step boundary after STEP (Job.step_done), raised as torch raises it, so that the classifier is
# what decides. The device stays broken: a worker that is started on it again fails again.
INJECT_ENV = "TENPLEX_INJECT_DEVICE_FAULT"
INJECTED_TEXT = ("CUDA error: uncorrectable ECC error encountered\nCUDA kernel errors might be asynchronously "
                 "reported at some other API call, so the stacktrace below might be incorrect.")


def injected(spec: str) -> list[tuple[str, str, int]]:
    """``"h1/1@4,h0/0@9"`` -> [(host, device, step), …]; raises ValueError naming a malformed item."""
    out = []
    for item in filter(None, (x.strip() for x in spec.split(","))):
        where, at, step = item.rpartition("@")[0], "@" in item, item.rpartition("@")[2]
        host, slash, device = where.partition("/")
        if not (at and slash and host and device and step.isdigit()):
            raise ValueError(f"{INJECT_ENV} item {item!r} is not HOST/DEVICE@STEP (e.g. h1/1@4)")
        out.append((host, device, int(step)))
    return out


def inject_device_fault(host: str, device: str | None, step: int) -> None:
    """Raise the injected device fault if :data:`INJECT_ENV` names this host, device and step (after ``step``
    steps; the worker is still on the device, or started on it again)."""
    spec = os.environ.get(INJECT_ENV)
    if spec and device is not None and any((h, d) == (host, device) and step >= s for h, d, s in injected(spec)):
        raise RuntimeError(INJECTED_TEXT)
