"""The read-through restore of the sent-bytes test, in a gloo world of one process.

Usage: ``python readthrough_sent_worker.py DIR``. It saves a tensor on h0's store (served in this process, its
sent bytes counted by ``StoreMetrics``), restores it into device h1/0 with ``read_plan_through`` (h1's own store
under DIR/h1) and prints one JSON line: whether every rank read through, whether the values arrived, and the
bytes h0 counted as sent, by peer host.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tenplex.box import Box
from tenplex.integration.moves import read_plan_through
from tenplex.integration.pieces import tensor_pieces
from tenplex.layout import Layout, Shard, TensorSpec
from tenplex.ops.metrics import StoreMetrics
from tenplex.planner import plan
from tenplex.store import Store
from tenplex.integration.process_group import init_process_group, leave_process_group
from tenplex.store.server import serve

SHAPE = (64, 64)


def main() -> None:
    base = Path(sys.argv[1])
    init_process_group("gloo", init_method=f"file://{base / 'init'}", rank=0, world_size=1)
    values = torch.arange(SHAPE[0] * SHAPE[1], dtype=torch.float32).reshape(SHAPE)
    h0 = Store(base / "h0", "h0")
    with h0.begin(1) as writer:
        writer.put("h0/0", "w", Box((0, 0), SHAPE), values.numpy(), "float32", shape=SHAPE)
        writer.commit()
    spec = {"w": TensorSpec(SHAPE, "float32")}
    old = Layout.build(spec, {"h0/0": [Shard("w", Box((0, 0), SHAPE))]})
    new = Layout.build(spec, {"h1/0": [Shard("w", Box((0, 0), SHAPE))]})
    metrics = StoreMetrics(h0.versions, h0.free_bytes, lambda: {})
    server, port = serve(h0, on_sent=metrics.count_sent)
    restored = torch.zeros(SHAPE)
    ok = read_plan_through(plan(old, new), old, 1, tensor_pieces("w", restored), {"h0": f"127.0.0.1:{port}"},
                           store=Store(base / "h1", "h1"), device="h1/0", token=None, group=dist.group.WORLD)
    sent = {s.labels["peer_host"]: s.value for family in metrics.registry.collect()
            if family.name == "tenplex_store_sent_bytes" for s in family.samples if s.name.endswith("_total")}
    print(json.dumps({"ok": ok, "equal": torch.equal(restored, values), "sent": sent}), flush=True)
    server.stop(None)
    leave_process_group()  # the documented ending of a gloo script (pytorch issue 190489)


if __name__ == "__main__":
    main()
