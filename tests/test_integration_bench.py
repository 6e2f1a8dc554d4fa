"""`tenplex bench restore` runs end to end (shortened: a tiny model) and prints the documented keys."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

KEYS = {"state_bytes", "tenplex_save_s", "tenplex_restore_s", "dcp_tmpfs_save_s", "dcp_tmpfs_load_s",
        "dcp_disk_save_s", "dcp_disk_load_s"}


def test_bench_restore_prints_one_json_object_with_every_key(tmp_path):
    cli = "import sys; from tenplex.cli import main; sys.exit(main())"
    proc = subprocess.run([sys.executable, "-c", cli, "bench", "restore", "--json", "--layers", "1", "--hidden", "32",
                           "--ffn", "64", "--vocab", "50", "--new-hosts", "2", "--tmpfs", str(tmp_path),
                           "--disk", str(tmp_path), "--repeat", "2", "--warmup", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert KEYS <= set(result) and result["state_bytes"] > 0
    # every measure: the median of the timed rounds, with their [min, max] and the rounds themselves
    ratios = {f"dcp_{where}_{what}_over_tenplex" for where in ("tmpfs", "disk") for what in ("save", "load")}
    assert set(result["spread"]) == KEYS - {"state_bytes"} | ratios and set(result["rounds"]) == KEYS - {"state_bytes"}
    for key, (low, high) in result["spread"].items():
        assert low <= result[key] <= high, key
    for key, seconds in result["rounds"].items():
        assert len(seconds) == 2 and result[key] == round(statistics.median(seconds), 4), key
    protocol = result["protocol"]
    assert (protocol["repeat"], protocol["warmup_rounds"]) == (2, 1) and protocol["warm_gb"] == round(
        result["state_bytes"] / (1 << 30), 2)  # by default the state's size, before every timed step
    # The second host's store starts empty; its one rank reads its FSDP shards from h0's store (nothing fans out).
    assert result["tenplex_read_through"] is True and result["tenplex_transformed"] is False
    assert list(tmp_path.iterdir()) == []  # every store and checkpoint directory was removed
