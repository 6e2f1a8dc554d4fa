"""`tenplex bench compare --quick` runs every method end to end on a tiny model, and its state is checkable."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from tenplex.bench.compare import METHODS, table
from tenplex.bench.gpt_state import PRIME, values
from tenplex.box import Box

KEYS = {"change", "method", "seconds", "inter_host_bytes", "inter_host_lower_bound", "peak_rss_bytes", "hosts",
        "peak_rss", "raw_socket_file_gbps", "fresh_file_write_gbps", "file_copy_gbps", "mismatches"}


def test_values_follow_the_documented_formula():
    # global C-order index i of a [3, 5] tensor holds (i + crc32(name) % PRIME) % PRIME; crc32(b"t") = 2238339752
    seed = 2238339752 % PRIME
    box = values("t", (3, 5), Box((1, 2), (2, 3)))
    assert box.dtype == np.float32
    assert box.tolist() == [[float((seed + i) % PRIME) for i in (7, 8, 9)],
                            [float((seed + i) % PRIME) for i in (12, 13, 14)]]
    whole = values("t", (3, 5), Box((0, 0), (3, 5)))
    assert np.array_equal(whole[1:3, 2:5], box)  # any box is the same slice of the whole tensor


def test_bench_compare_quick_runs_every_method_and_checks_the_new_state(tmp_path):
    cli = "import sys; from tenplex.cli import main; sys.exit(main())"
    png = tmp_path / "compare.png"
    proc = subprocess.run([sys.executable, "-c", cli, "bench", "compare", "--quick", "--json", "--dir", str(tmp_path),
                           "--disk", str(tmp_path), "--plot", str(png)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.strip().splitlines()]
    assert [r["method"] for r in rows] == list(METHODS)
    for r in rows:
        assert KEYS <= set(r), sorted(KEYS - set(r))
        assert r["mismatches"] == [], (r["method"], r["mismatches"][:3])  # bit for bit, every method
        assert r["seconds"] > 0 and r["peak_rss_bytes"] > 0 and r["raw_socket_file_gbps"] > 0
        assert r["fresh_file_write_gbps"] > 0 and r["file_copy_gbps"] > 0
    by = {r["method"]: r for r in rows}
    # tenplex moves exactly the lower bound between hosts; the centralised transformer gathers on h0 first
    assert by["tenplex"]["inter_host_bytes"] == by["tenplex"]["inter_host_lower_bound"]
    state, target = rows[0]["state_bytes"], rows[0]["target_bytes"]
    assert by["centralised"]["hosts"]["h0"]["read"] == state  # every old byte is read once, on h0 or shipped from it
    assert by["centralised"]["inter_host_bytes"] > by["tenplex"]["inter_host_bytes"]
    # DCP on shared storage: every rank's checkpoint reads and writes cross its host's link
    for method in ("dcp_tmpfs", "dcp_disk"):
        written = sum(h["written"] for h in by[method]["hosts"].values())
        assert written >= state  # the save wrote every tensor once (replicas deduplicated, plus metadata)
        assert sum(h["read"] for h in by[method]["hosts"].values()) >= target
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = table(rows)
    assert all(m in text for m in METHODS) and rows[0]["change"] in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["compare.png"]  # stores and checkpoints removed
