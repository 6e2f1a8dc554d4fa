"""The DCP side of ``tenplex bench compare``: ``dcp.save`` under one layout, ``dcp.load`` with resharding under another.

May import: torch, numpy, ``tenplex.layout``, ``tenplex.box``, ``tenplex.devices``,
``tenplex.files``, ``tenplex.ports`` (a free port), ``tenplex.integration.process_group``, this
package's ``gpt_state`` and ``restore`` and the standard library.

One process per device of the layout, one real gloo process group
(``python -m tenplex.bench.compare_dcp SPEC RANK``; rank r is the r-th device
in sorted order). Each rank's part of every tensor is a ``ShardedTensor``
made of that device's boxes of the layout, so DCP sees exactly the layout's
sharding: replicas of a box are deduplicated by DCP's save planner, and on
load each rank reads only the saved chunks overlapping its boxes. The
timing runs from a barrier before the call to a barrier after it, so it
measures the slowest rank. Each rank writes ``result-<rank>.json``: seconds,
peak RSS, and the bytes it read and wrote (``/proc/self/io`` rchar/wchar
deltas around the call, which count the checkpoint files' reads and writes).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from ..devices import host_of
from ..ports import free_port


def run_dcp(layout_path: Path, mode: str, checkpoint: Path, work: Path, verify: bool = False,
            drop_cache: bool = False, timeout: float = 1800.0) -> dict:
    """Run ``mode`` (``save`` or ``load``) with one process per device of the layout in ``layout_path``.

    Returns seconds (slowest rank), per-host bytes read and written, peak RSS per
    process (device -> bytes) and the shards that loaded wrong values (``verify``)."""
    from ..files import load_layout

    devices = sorted(load_layout(layout_path).devices)
    work.mkdir(parents=True, exist_ok=True)
    spec_path = work / f"dcp-{mode}.json"
    spec_path.write_text(json.dumps({"layout": str(layout_path), "mode": mode, "checkpoint": str(checkpoint),
                                     "result_dir": str(work), "verify": verify, "drop_cache": drop_cache}))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = []
    for rank in range(len(devices)):
        with open(work / f"dcp-{mode}-{rank}.log", "w") as rank_log:  # the child keeps its own descriptor
            procs.append(subprocess.Popen([sys.executable, "-m", "tenplex.bench.compare_dcp", str(spec_path),
                                           str(rank)], env=env, stdout=subprocess.DEVNULL, stderr=rank_log))
    try:
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    failed = [rank for rank, proc in enumerate(procs) if proc.returncode != 0]
    if failed:
        log = (work / f"dcp-{mode}-{failed[0]}.log").read_text()[-2000:]
        raise RuntimeError(f"DCP {mode} failed on rank(s) {failed} (log of rank {failed[0]}):\n{log}")
    results = [json.loads((work / f"result-{rank}.json").read_text()) for rank in range(len(devices))]
    hosts: dict[str, dict[str, int]] = {}
    for r in results:
        per_host = hosts.setdefault(host_of(r["device"]), {"read": 0, "written": 0})
        per_host["read"] += r["read_bytes"]
        per_host["written"] += r["written_bytes"]
    return {"seconds": max(r["seconds"] for r in results), "hosts": hosts,
            "peak_rss": {r["device"]: r["peak_rss_bytes"] for r in results},
            "mismatches": [m for r in results for m in r["mismatches"]]}


def _io() -> dict[str, int]:
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return {"read": int(fields["rchar"]), "written": int(fields["wchar"])}


def _sharded(tensor: str, shape, boxes, rank: int, world: int, fill: bool):
    """``rank``'s ShardedTensor of ``tensor`` made of ``boxes`` (values of gpt_state, or zeros to load into)."""
    import torch
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    from ..box import Box, subtract_all
    from .gpt_state import values

    def meta(box: Box, owner: int) -> ShardMetadata:
        return ShardMetadata(shard_offsets=list(box.offsets), shard_sizes=list(box.lengths),
                             placement=f"rank:{owner}/cpu")

    mine = [meta(b, rank) for b in boxes]
    local = [Shard(torch.from_numpy(values(tensor, shape, b)) if fill else torch.zeros(b.lengths), m)
             for b, m in zip(boxes, mine)]
    # ShardedTensor insists that its metadata covers the tensor exactly once; the rest of the tensor is
    # nominally on the next rank. DCP itself uses only the local shards and the global size: no rank
    # needs to know what the others hold, and replicas of a box are deduplicated by DCP's save planner.
    rest = [meta(b, (rank + 1) % world) for b in subtract_all(Box.whole(shape), boxes)]
    global_metadata = ShardedTensorMetadata(shards_metadata=mine + rest, size=torch.Size(shape),
                                            tensor_properties=TensorProperties(dtype=torch.float32))
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, global_metadata)


def _worker(spec_path: str, rank: int) -> None:
    import warnings

    import numpy as np
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from ..integration.process_group import init_process_group, leave_process_group

    from ..box import Box
    from ..layout import from_dict
    from .gpt_state import values

    warnings.filterwarnings("ignore")  # ShardedTensor's deprecation notice, once per tensor
    spec = json.loads(Path(spec_path).read_text())
    layout = from_dict(json.loads(Path(spec["layout"]).read_text()))
    device = sorted(layout.devices)[rank]
    init_process_group("gloo", rank=rank, world_size=len(layout.devices))
    saving = spec["mode"] == "save"
    boxes: dict[str, list] = {}
    for shard in layout.devices[device]:
        boxes.setdefault(shard.tensor, []).append(shard.box)
    state = {name: _sharded(name, layout.tensors[name].shape, held, rank, len(layout.devices), fill=saving)
             for name, held in sorted(boxes.items())}
    if not saving and rank == 0 and spec.get("drop_cache"):
        from .restore import _drop_page_cache  # as bench restore does: the disk load reads the disk

        _drop_page_cache(Path(spec["checkpoint"]))
    dist.barrier()
    before = _io()
    start = time.perf_counter()
    if saving:
        dcp.save(state, checkpoint_id=spec["checkpoint"])
    else:
        dcp.load(state, checkpoint_id=spec["checkpoint"])
    dist.barrier()
    seconds = time.perf_counter() - start
    after = _io()
    wrong = []
    if spec.get("verify") and not saving:
        for name, sharded in state.items():
            for shard in sharded.local_shards():
                box = Box(tuple(shard.metadata.shard_offsets), tuple(shard.metadata.shard_sizes))
                if not np.array_equal(shard.tensor.numpy(), values(name, layout.tensors[name].shape, box)):
                    wrong.append(f"{device} {name} {box}")
    result = {"rank": rank, "device": device, "seconds": seconds,
              "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
              "read_bytes": after["read"] - before["read"], "written_bytes": after["written"] - before["written"],
              "mismatches": wrong}
    Path(spec["result_dir"], f"result-{rank}.json").write_text(json.dumps(result))
    leave_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]))
