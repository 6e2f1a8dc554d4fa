"""Run examples/01-gpt-train shortened through `tenplex run`: train under tp=2, stop, resume under pp=2."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "01-gpt-train"
def _train(root: Path, data: Path, pin: str, steps: int) -> str:
    # --standalone: one node, torchrun picks a free port itself (no race with other processes on this machine).
    result = subprocess.run([sys.executable, "-m", "tenplex.cli", "run", "--host", "h0", "--store-root", str(root),
                             "--standalone", "--nproc-per-node", "2", str(EXAMPLE / "train.py"), "--data", str(data),
                             "--pin", f"2:{pin}", "--steps", str(steps), "--save-every", "0"],
                            env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300,
                            cwd=EXAMPLE)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def test_example_trains_stops_and_resumes_under_another_configuration(tmp_path):
    subprocess.run([sys.executable, str(EXAMPLE / "make_data.py"), str(tmp_path / "data"), "--samples", "48"],
                   check=True, capture_output=True, timeout=120)
    root = tmp_path / "h0"
    try:
        first = _train(root, tmp_path / "data" / "dataset", "tp=2", 2)
        second = _train(root, tmp_path / "data" / "dataset", "pp=2", 4)
    finally:
        pid_file = root / ".tenplex-store.pid"  # tenplex run leaves its store serving: stop it
        if pid_file.exists():
            pid = int(pid_file.read_text())
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 30
            while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
    assert "world 2 on h0: dp=1,tp=2,pp=1 (pinned for world size 2); fresh start" in first
    assert [int(s) for s in re.findall(r"^step\s+(\d+)", first, flags=re.M)] == [1, 2]
    assert "done at step 2" in first
    assert "world 2 on h0: dp=1,tp=1,pp=2 (pinned for world size 2); restored step 2" in second
    assert [int(s) for s in re.findall(r"^step\s+(\d+)", second, flags=re.M)] == [3, 4]
    assert "done at step 4" in second
