"""``tenplex status`` against real store servers: the table and --json after a save and a transformation,
discovery of the other stores from the newest save's record, a lost host, and one-line errors."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry

from tenplex.ops.metrics import ENDPOINTS_DIR, serve_worker
from tenplex.planner import plan
from tenplex.replication.stores import STORES_DOC, stores_doc
from tenplex.transform import transform

from store_helpers import StoreProcess, gpt_layout, random_globals, write_version

TENPLEX = str(Path(sys.executable).with_name("tenplex"))


def test_status_reads_the_checkpointers_state_document():
    from tenplex.cli.status import STATE_DOC as read
    from tenplex.integration.checkpointer import STATE_DOC as written

    assert read == written


def _status(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([TENPLEX, "status", *args], capture_output=True, text=True, timeout=120)


def test_status_of_two_stores_after_a_save_and_a_transformation(tmp_path):
    old, new = gpt_layout(2, 2, 1, 2, 2), gpt_layout(1, 4, 1, 2, 2)
    roots = {h: tmp_path / h for h in ("h0", "h1")}
    stores = {h: StoreProcess(roots[h], h) for h in roots}
    try:
        addresses = {h: s.address for h, s in stores.items()}
        record = stores_doc(1, addresses, 0, ["h0", "h1"])
        write_version(roots, old, 1, random_globals(old, seed=5),
                      docs={"tenplex.torch_state": {"step": 7}, STORES_DOC: record})
        transform(plan(old, new), old, new, addresses, 1, 2)  # carries the documents over

        done = _status(addresses["h0"], "--json")  # one store: it names the other in the newest save's record
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert report["format"] == "tenplex.status/1"
        assert [(h["host"], h["address"], h["reachable"], h["versions"]) for h in report["hosts"]] == \
            [("h0", addresses["h0"], True, [1, 2]), ("h1", addresses["h1"], True, [1, 2])]
        assert [(v["version"], v["step"], v["hosts"], v["missing"], v["restorable"]) for v in report["versions"]] == \
            [(2, 7, ["h0", "h1"], [], True), (1, 7, ["h0", "h1"], [], True)]
        assert report["versions"][0]["copies"] == {"h0": [], "h1": []} and report["versions"][0]["replicas"] == 0
        assert report["last_committed_step"] == 7 and report["configuration"] == {"h0": 2, "h1": 2}
        assert report["restorable"] == {"version": 2, "step": 7}
        assert [h["metrics"] for h in report["hosts"]] == [[], []]  # no worker recorded an endpoint yet

        (roots["h1"] / ".tenplex-store.port").write_text(f"{stores['h1'].port}\n")  # as tenplex run records it
        with socket.socket() as held:  # a worker of the previous world still serves h1's worker metrics port
            held.bind(("127.0.0.1", 0))
            held.listen()
            port = held.getsockname()[1]
            serve_worker(CollectorRegistry(), port, "127.0.0.1", 60.0, roots["h1"] / ENDPOINTS_DIR)
            table = _status("--root", str(roots["h1"]))
        assert table.returncode == 0, table.stderr
        assert f"metrics of h1 on port {port}: waiting for its port (in use by another process), worker pid " \
               f"{os.getpid()}" in table.stdout
        assert "last committed step: 7  (devices: h0=2, h1=2)" in table.stdout
        assert "a recovery would restore: version 2 (step 7)" in table.stdout

        stores["h1"].kill()  # a lost host without copies: nothing complete survives
        lost = json.loads(_status(addresses["h0"], "--json", "--timeout", "2").stdout)
        assert [(h["host"], h["address"], h["reachable"], h.get("error")) for h in lost["hosts"]] == \
            [("h0", addresses["h0"], True, None), ("h1", addresses["h1"], False, "unreachable")]
        assert lost["versions"][0]["missing"] == ["h1"] and lost["restorable"] is None
        assert "a recovery would restore: nothing" in _status(addresses["h0"], "--timeout", "2").stdout
    finally:
        for store in stores.values():
            store.stop()


def test_unreachable_stores_and_bad_tokens_are_one_line_errors(tmp_path):
    token = tmp_path / "token"
    token.write_text("right\n")
    wrong = tmp_path / "wrong"
    wrong.write_text("wrong\n")
    store = StoreProcess(tmp_path / "h0", "h0", token_file=token)
    try:
        refused = _status(store.address, "--token-file", str(wrong))
        assert refused.returncode == 2 and refused.stdout == ""
        assert refused.stderr.strip() == (f"tenplex status: error: store {store.address} refused the token: pass the "
                                          f"job's --token-file")
        assert _status(store.address, "--token-file", str(token)).returncode == 0
    finally:
        store.stop()
    gone = _status(store.address, "--timeout", "1")
    assert gone.returncode == 2 and gone.stderr.strip() == \
        f"tenplex status: error: no store answered: {store.address}: unreachable"
    none = _status()
    assert none.returncode == 2 and len(none.stderr.strip().splitlines()) == 1
