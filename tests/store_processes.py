"""Processes that share one store root, for tests/test_store_lockfree.py: ``python store_processes.py ROLE ROOT ...``.

Each role prints one JSON line per outcome. ``stop-in-commit`` and ``stop-in-gc`` stop themselves (SIGSTOP) at a
chosen point inside the operation, so that the test knows exactly where they hang:

- ``stop-in-commit ROOT VERSION POINT``: POINT ``link`` (after the first hard link of the private tree),
  ``publish`` (the tree complete, just before the publishing rename) or ``locked`` (the locked fallback
  forced, stopped while holding ``.lock``).
- ``stop-in-gc ROOT``: gc(keep=1), stopped after its first version went to ``trash/``, before removing it.
- ``commit ROOT NAME VERSION...``: stage and commit each version (part NAME), then print the outcomes.
- ``delete ROOT VERSION``, ``gc ROOT`` (keep=1).
- ``race ROOT NAME GO VERSION...``: stage each version (part NAME), wait for the file GO, commit them all.
- ``gc-loop ROOT STOP``: gc(keep=1) until the file STOP exists, looking for damaged versions after each.
- ``climb ROOT COUNT``: commit 1..COUNT in order; each must stay readable right after its commit.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

from tenplex.box import Box
from tenplex.store import Store, local
from tenplex.store.manifest import AlreadyCommitted

SHARDS = 3  # files per part: a commit links several, so "after the first link" is inside the operation


def stage(store: Store, version: int, name: str) -> None:
    """Prepare part ``name`` of ``version``: shards whose values and a JSON document say who wrote them."""
    writer = store.begin(version, part=name)
    for device in range(SHARDS):
        writer.put(f"h0/{device}", "w", Box((0,), (4,)), np.full(4, version * 10 + device, np.float32), "float32")
    writer.put_json("who", {"writer": name, "version": version})
    writer.prepare()


def commit(store: Store, version: int, name: str) -> dict:
    try:
        store.commit(version, parts=[name])
        return {"version": version, "outcome": "committed"}
    except AlreadyCommitted:
        return {"version": version, "outcome": "already"}
    except Exception as e:  # noqa: BLE001 -- the test reads the outcome
        return {"version": version, "outcome": "error", "error": f"{type(e).__name__}: {e}"}


def stop_here() -> None:
    print(json.dumps({"stopping": os.getpid()}), flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)


def stop_in_commit(root: str, version: int, point: str) -> None:
    store = Store(root, "h0")
    stage(store, version, "stopped")
    if point == "link":
        real_link, links = os.link, []

        def link(*args, **kwargs):
            real_link(*args, **kwargs)
            links.append(args)
            if len(links) == 1:
                stop_here()
        os.link = link  # type: ignore[assignment]
    elif point == "publish":
        real_rename = local.rename_noreplace

        def rename(src, dst) -> bool:
            stop_here()
            return real_rename(src, dst)
        local.rename_noreplace = rename  # type: ignore[assignment]
    else:
        real_held = local.held
        local.rename_noreplace = lambda src, dst: False  # type: ignore[assignment]  # as on a file system without

        @contextlib.contextmanager
        def held(*args, **kwargs):
            with real_held(*args, **kwargs):
                stop_here()
                yield
        local.held = held  # type: ignore[assignment]
    print(json.dumps(commit(store, version, "stopped")), flush=True)


def stop_in_gc(root: str) -> None:
    store = Store(root, "h0")
    real_rmtree, calls = local.shutil.rmtree, []

    def rmtree(path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 1:
            stop_here()
        real_rmtree(path, *args, **kwargs)
    local.shutil.rmtree = rmtree  # type: ignore[assignment]
    print(json.dumps({"gc": store.gc(keep=1)}), flush=True)


def race(root: str, name: str, go: str, versions: list[int]) -> None:
    store = Store(root, "h0")
    for v in versions:
        stage(store, v, name)
    print(json.dumps({"staged": name}), flush=True)
    while not os.path.exists(go):
        time.sleep(0.005)
    for v in versions:
        print(json.dumps(commit(store, v, name)), flush=True)


def gc_loop(root: str, stop: str) -> None:
    store, rounds, damaged = Store(root, "h0"), 0, []
    print(json.dumps({"looping": os.getpid()}), flush=True)
    while not rounds or not os.path.exists(stop):
        store.gc(keep=1)
        rounds += 1
        for entry in (store.root / "versions").iterdir():
            # no manifest while the directory is still there (not merely renamed away meanwhile) is damage
            if not (entry / "manifest.json").is_file() and entry.exists():
                damaged.append(entry.name)
    print(json.dumps({"rounds": rounds, "damaged": damaged}), flush=True)


def climb(root: str, count: int) -> None:
    store, lost = Store(root, "h0"), []
    for v in range(1, count + 1):
        stage(store, v, "climber")
        store.commit(v, parts=["climber"])
        reader = store.open(v)  # the newest version: no gc may have removed it
        if reader.verify() or reader.get_json("who") != {"writer": "climber", "version": v}:
            lost.append(v)
        reader.close()
    print(json.dumps({"climbed": count, "lost": lost}), flush=True)


def main(role: str, root: str, *args: str) -> None:
    if role == "stop-in-commit":
        stop_in_commit(root, int(args[0]), args[1])
    elif role == "stop-in-gc":
        stop_in_gc(root)
    elif role == "commit":
        store = Store(root, "h0")
        for v in map(int, args[1:]):
            stage(store, v, args[0])
            print(json.dumps(commit(store, v, args[0])), flush=True)
    elif role == "delete":
        print(json.dumps({"deleted": int(args[0]), "existed": Store(root, "h0").delete(int(args[0]))}), flush=True)
    elif role == "gc":
        print(json.dumps({"gc": Store(root, "h0").gc(keep=1)}), flush=True)
    elif role == "race":
        race(root, args[0], args[1], [int(v) for v in args[2:]])
    elif role == "gc-loop":
        gc_loop(root, args[0])
    elif role == "climb":
        climb(root, int(args[0]))
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main(*sys.argv[1:])
