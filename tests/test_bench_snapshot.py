"""`tenplex bench snapshot` runs end to end (shortened: a tiny model) and prints the documented keys."""

from __future__ import annotations

import json
import subprocess
import sys

KEYS = {"state_bytes", "memcpy_s", "tenplex_save_s", "tenplex_snapshot_first_blocking_s",
        "tenplex_snapshot_blocking_s", "tenplex_snapshot_commit_s", "tenplex_staging_bytes", "dcp_save_s",
        "dcp_async_blocking_s", "dcp_async_commit_s", "dcp_async_extra_rss_bytes", "train_step_s",
        "train_step_snapshot_s", "snapshot_slowdown", "snapshot_over_memcpy", "snapshot_over_dcp_async",
        "snapshot_commit_over_save", "tenplex_snapshot_fixed_s", "tenplex_snapshot_fixed_cpu_s",
        "tenplex_snapshot_exchange_fixed_s", "tenplex_snapshot_exchange_fixed_cpu_s", "tenplex_snapshot_s_per_mb",
        "paced_20ms_blocking_s", "paced_20ms_interval", "paced_20ms_step_wait_s", "tenplex_snapshot_staged_s"}


def test_bench_snapshot_prints_one_json_object_with_every_key(tmp_path):
    cli = "import sys; from tenplex.cli import main; sys.exit(main())"
    proc = subprocess.run([sys.executable, "-c", cli, "bench", "snapshot", "--json", "--layers", "1", "--hidden", "32",
                           "--ffn", "64", "--vocab", "50", "--repeat", "1", "--steps", "1", "--tmpfs", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert KEYS <= set(result)
    # Staging holds one copy of the state: both ranks are on one host, where each box is written once.
    assert result["tenplex_staging_bytes"] == result["state_bytes"]
    assert result["tenplex_snapshot_failed"] == 0
    # The exchanging measure's snapshots all exchanged (the all-gather at the boundary); the fixed cost's none did.
    exchanged, fixed, rounds = result["tenplex_snapshot_exchange_rounds"]
    assert (exchanged, fixed) == (rounds, 0)
    assert list(tmp_path.iterdir()) == []  # every store and checkpoint directory was removed
