"""Issue 26, item 8: a DDP script on gloo that saves with ``tenplex.save`` and ends as the elastic guide's "Ending a
script of your own on gloo" says frees every process group before interpreter shutdown: no gloo worker thread is left
to abort or hang the exit (pytorch issue 190489). Two real ranks, a real DDP model, a real store."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import sys
from pathlib import Path
import torch
import tenplex
from torch.nn.parallel import DistributedDataParallel as DDP
from tenplex.integration.process_group import init_process_group, leave_process_group

def gloo_threads():
    return sum((t / "comm").read_text().strip() == "pt_gloo_runloop" for t in Path("/proc/self/task").iterdir())

init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=int(sys.argv[2]), world_size=2)
model = DDP(torch.nn.Linear(8, 8))
optimizer = torch.optim.Adam(model.parameters())
for step in range(2):
    loss = model(torch.randn(4, 8)).sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
tenplex.save(model.module, optimizer, step=2)
during = gloo_threads()
del model, optimizer, loss
leave_process_group()
print(during, gloo_threads(), flush=True)
"""


def test_the_documented_ending_frees_every_group_before_shutdown(tmp_path):
    ranks = []
    for rank in range(2):
        env = dict(os.environ, TENPLEX_STORE_ROOT=str(tmp_path / "h0"), TENPLEX_HOST="h0", LOCAL_RANK=str(rank),
                   OMP_NUM_THREADS="1")
        ranks.append(subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path / "rendezvous"), str(rank)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [rank.communicate(timeout=300) for rank in ranks]
    for rank, (out, err) in zip(ranks, outputs):
        assert rank.returncode == 0, err[-3000:]
        during, after = map(int, out.split())
        assert during > 0 and after == 0, f"gloo threads during training {during}, after leaving {after}"
