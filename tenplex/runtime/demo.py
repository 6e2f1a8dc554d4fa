"""The ``tenplex demo`` scenario: train, save, rescale onto other hosts and parallelism, restore, continue; check.

May import: numpy, safetensors (numpy API), the standard library, ``tenplex.dataset``,
``tenplex.errors``, ``tenplex.models.config`` (the model's defaults, no torch) and
this package. Never torch: the training runs in worker processes
(:mod:`.demo_worker`), and their results come back as JSON and safetensors files.

Phases, each a fresh job of worker processes:

* **A** (configuration A on ``hosts_from`` hosts): train ``steps`` steps, save
  through tenplex (model, optimizer, scheduler, step and the dataset position),
  then keep training ``steps`` more steps without stopping. Those later steps
  are the *reference*: the uninterrupted run under configuration A.
* **B** (configuration B on ``hosts_to`` hosts; new hosts start with an empty
  store): restore, which plans and runs the transformation across the store
  processes, and train ``steps`` more steps.

The elastic run is A's first ``steps`` steps followed by B. Its losses equal the
reference up to float rounding (tp, pp and dp sum in different orders, so
results agree to about 1e-6 relative, not bit for bit), and it trains on
exactly the reference's global batches.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..dataset import DatasetState, pack, write_state_file
from ..errors import TenplexError, UsageError
from ..models.config import GPTConfig, Parallel
from .hosts import Hosts
from .launch import place, run_spec_job

# the workers train the reference GPT's defaults
SEQ, VOCAB, HEADS = GPTConfig().seq, GPTConfig().vocab, GPTConfig().heads
CLI = "import sys; from tenplex.cli import main; sys.exit(main())"
# Elastic run vs reference: tp, pp and dp sum in different orders, so losses agree up to float rounding,
# compounded over the steps by AdamW (in practice 0 or a few 1e-7). The demo guide and the tests use this value.
LOSS_RTOL = 1e-4


@dataclass(frozen=True)
class DemoConfig:
    steps: int = 8               # steps before the rescale, and after it
    parallel_from: str = "tp=2,dp=2"
    parallel_to: str = "pp=2,dp=2"
    hosts_from: int = 2
    hosts_to: int = 3
    global_batch: int = 8
    seed: int = 0
    fuse: bool = False           # read the data through a FUSE mount of the dataset instead of in process


def degrees(parallel: str) -> dict[str, int]:
    """``"tp=2,dp=2"`` -> {"dp": 2, "tp": 2, "pp": 1}, parsed as the workers parse it (ConfigError if malformed)."""
    par = Parallel.parse(parallel)
    return {"dp": par.dp, "tp": par.tp, "pp": par.pp}


def check_parallel(flag: str, parallel: str) -> None:
    """Refuse, before any worker starts, a tensor parallelism the reference GPT cannot be split into."""
    tp = degrees(parallel)["tp"]
    if tp < 1 or HEADS % tp:
        raise UsageError(f"{flag} {parallel}: tp={tp} must divide the reference GPT's {HEADS} attention heads; "
                         f"use tp=1, 2 or 4")


def world_of(parallel: str) -> int:
    return Parallel.parse(parallel).world


class DemoError(TenplexError, RuntimeError):
    """A step of the demo's orchestration failed (the message says which and why)."""


def _vfs(*args: str) -> None:
    """Run ``tenplex vfs ARGS`` (the FUSE view lives in its own server process)."""
    result = subprocess.run([sys.executable, "-c", CLI, "vfs", *args], capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise DemoError(f"tenplex vfs {args[0]} failed: {(result.stderr or result.stdout).strip()[-2000:]}")


def make_dataset(root: Path, num_samples: int, global_batch: int, seed: int) -> DatasetState:
    """Pack ``num_samples`` token sequences (learnable: arithmetic progressions mod the vocabulary); its start state."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, VOCAB, size=(num_samples, 1))
    strides = rng.integers(1, 4, size=(num_samples, 1))
    tokens = (starts + strides * np.arange(SEQ + 1)) % VOCAB  # (samples, seq + 1): inputs and shifted targets
    root.mkdir(parents=True, exist_ok=True)
    (root / "tokens.bin").write_bytes(tokens.astype(np.uint16).tobytes())
    info = pack(root / "tokens.bin", root / "dataset", seq_len=SEQ + 1, dtype="uint16")
    return DatasetState(dataset=info.identity, num_samples=info.num_samples, seed=seed, position=0,
                        global_batch=global_batch)


def run(cfg: DemoConfig, workdir: Path, say: Callable[[str], None]) -> dict:
    """Run both phases in ``workdir`` and return the summary (see :func:`summarize`); ``say`` prints progress."""
    world_a, world_b = world_of(cfg.parallel_from), world_of(cfg.parallel_to)
    devices_a, devices_b = place(world_a, cfg.hosts_from), place(world_b, cfg.hosts_to)
    # One epoch is exactly the demo's 2 * steps global batches: "every sample once" covers the whole dataset.
    num_samples = 2 * cfg.steps * cfg.global_batch
    state = make_dataset(workdir / "data", num_samples, cfg.global_batch, cfg.seed)
    say(f"dataset: {num_samples} samples of {SEQ + 1} tokens packed in {workdir / 'data' / 'dataset'}")
    hosts_a = sorted({d.split("/")[0] for d in devices_a})
    hosts_b = sorted({d.split("/")[0] for d in devices_b})
    joining = [h for h in hosts_b if h not in hosts_a]
    mount = workdir / "mnt"
    if cfg.fuse:
        view_state = workdir / "data" / "view-state.json"
        write_state_file(view_state, state, degrees(cfg.parallel_from)["dp"])
        mount.mkdir(exist_ok=True)
        _vfs("mount", str(workdir / "data" / "dataset"), str(mount), "--state", str(view_state),
             "--log", str(workdir / "vfs.log"))
        say(f"dataset mounted at {mount} (FUSE): one directory per data-parallel rank")
    try:
        _phases(cfg, workdir, state, devices_a, devices_b, hosts_a, joining, mount if cfg.fuse else None, say)
    finally:
        if cfg.fuse:
            try:
                _vfs("unmount", str(mount))
            except DemoError:  # a worker killed mid-read may still hold a file open for a moment
                _vfs("unmount", "--lazy", str(mount))
    return summarize(cfg, workdir, num_samples)


def _phases(cfg: DemoConfig, workdir: Path, state: DatasetState, devices_a: list[str], devices_b: list[str],
            hosts_a: list[str], joining: list[str], mount: Path | None, say) -> None:
    with Hosts(workdir / "stores") as hosts:
        hosts.start(*hosts_a, *joining)  # together: the store processes start in parallel
        say(f"hosts: {', '.join(f'{h} (store {hosts.addresses[h]})' for h in hosts_a)}"
            + (f"; idle until the rescale: {', '.join(joining)} (empty store)" if joining else ""))
        base = {"dataset": str(workdir / "data" / "dataset"), "global_batch": cfg.global_batch,
                "dataset_state": state.to_dict(), "until": 2 * cfg.steps, "mount": mount and str(mount)}
        say(f"phase A: {cfg.parallel_from} on {', '.join(devices_a)}: train {cfg.steps} steps, save, "
            f"then continue {cfg.steps} steps as the uninterrupted reference")
        _phase(workdir, "A", {**base, "parallel": cfg.parallel_from, "save_at": cfg.steps, "init_seed": 0},
               devices_a, hosts, say)
        if joining:
            say(f"rescale: host(s) {', '.join(joining)} join with empty stores")
        if mount:
            # The view follows the job: the saved position, split over the new dp degree. Each worker checks
            # that the view's state equals the dataset state it restored from the stores.
            saved = next(r["saved_state"] for r in _ranks(workdir / "A") if "saved_state" in r)
            _vfs("switch", str(mount), "--dp", str(degrees(cfg.parallel_to)["dp"]), "--position",
                 str(saved["position"]))
            say(f"dataset view switched to dp={degrees(cfg.parallel_to)['dp']} at position {saved['position']}")
        say(f"phase B: {cfg.parallel_to} on {', '.join(devices_b)}: restore, train steps "
            f"{cfg.steps + 1}..{2 * cfg.steps}")
        _phase(workdir, "B", {**base, "parallel": cfg.parallel_to, "init_seed": 1}, devices_b, hosts, say)


def _phase(workdir: Path, name: str, spec: dict, devices: list[str], hosts: Hosts, say) -> None:
    out = workdir / name
    out.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "phase": name, "out": str(out)}
    progress, shown = out / "progress.jsonl", [0]

    def poll() -> None:
        if not progress.exists():
            return
        lines = progress.read_text().splitlines()
        for line in lines[shown[0]:]:
            if line.endswith("}"):  # a line still being written is shown at the next poll
                p = json.loads(line)
                if "saved" in p:
                    say(f"  [{name}] saved step {p['step']} through tenplex as version {p['saved']}")
                else:
                    label = f"{name} ref" if p["step"] > spec.get("save_at", p["step"]) else name
                    say(f"  [{label}] step {p['step']:3d}/{spec['until']}  loss {p['loss']:.6f}")
                shown[0] += 1

    run_spec_job([sys.executable, "-m", "tenplex.runtime.demo_worker"], spec, out / "spec.json", devices,
                 {h: hosts.root(h) for h in hosts.addresses}, dict(hosts.addresses), out / "logs", poll=poll)


def _ranks(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"), key=lambda p: int(p.stem[4:]))]


def _global_batches(ranks: list[dict]) -> dict[int, list[int]]:
    """Step -> the global batch's sample ids: the dp ranks' micro-batches in dp order (first pp stage, tp 0)."""
    readers = sorted((r for r in ranks if r["coords"]["pp"] == 0 and r["coords"]["tp"] == 0),
                     key=lambda r: r["coords"]["dp"])
    batches: dict[int, list[int]] = {}
    for r in readers:
        for s in r["steps"]:
            batches.setdefault(s["step"], []).extend(s["ids"])
    return batches


def _params(out: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    full: dict[str, np.ndarray] = {}
    for f in sorted(out.glob("params-r*.safetensors")):
        full.update(load_file(str(f)))
    return full


def summarize(cfg: DemoConfig, workdir: Path, num_samples: int) -> dict:
    """Compare the elastic run (A, then B) with the reference (A throughout) and check the state and the data."""
    a, b = _ranks(workdir / "A"), _ranks(workdir / "B")
    ref_loss = {s["step"]: s["loss"] for s in a[0]["steps"]}
    elastic_loss = {**{k: v for k, v in ref_loss.items() if k <= cfg.steps},
                    **{s["step"]: s["loss"] for s in b[0]["steps"]}}
    rows = []
    for step in sorted(ref_loss):
        got, want = elastic_loss.get(step), ref_loss[step]
        diff = abs(got - want) if got is not None else None
        rows.append({"step": step, "phase": "A" if step <= cfg.steps else "B", "loss": got, "reference": want,
                     "diff": diff})
    losses_ok = all(r["loss"] is not None and math.isclose(r["loss"], r["reference"], rel_tol=LOSS_RTOL)
                    for r in rows)

    ref_batches = _global_batches(a)
    elastic = {**{k: v for k, v in ref_batches.items() if k <= cfg.steps}, **_global_batches(b)}
    for r in rows:
        r["ids"] = elastic.get(r["step"])  # the global batch the elastic run trained on at this step
    counts = Counter(i for ids in elastic.values() for i in ids)
    duplicates = sorted(i for i, n in counts.items() if n > 1)
    missing = sorted(set(range(num_samples)) - set(counts))
    samples = {"dataset": num_samples, "seen": sum(counts.values()), "distinct": len(counts),
               "duplicates": duplicates[:20], "missing": missing[:20],
               "exactly_once": not duplicates and not missing,
               "readers": sorted({r["reader"] for r in a + b}),
               "same_batches_as_reference": elastic == ref_batches}

    saved, restored = _params(workdir / "A"), _params(workdir / "B")
    differ = sorted(k for k in saved.keys() & restored.keys()
                    if saved[k].dtype != restored[k].dtype or saved[k].shape != restored[k].shape
                    or saved[k].tobytes() != restored[k].tobytes())
    params = {"tensors": len(saved), "bytes": int(sum(v.nbytes for v in saved.values())),
              "missing_after_restore": sorted(saved.keys() - restored.keys()),
              "unexpected_after_restore": sorted(restored.keys() - saved.keys()), "differ": differ}
    params["bit_equal"] = bool(saved) and not (differ or params["missing_after_restore"]
                                               or params["unexpected_after_restore"])

    b0 = b[0]
    saved_state = next(r["saved_state"] for r in a if "saved_state" in r)
    restore = {"step": b0["restored_step"], "transformed": b0["transformed"], "read_through": b0["read_through"],
               "plan": b0["plan_stats"],
               "dataset_state": b0["start_state"],
               "state_ok": b0["restored_step"] == cfg.steps and b0["start_state"] == saved_state}
    checks = {"losses_match": losses_ok, "exactly_once": samples["exactly_once"],
              "same_batches_as_reference": samples["same_batches_as_reference"],
              "params_bit_equal": params["bit_equal"], "restored_step_and_position": restore["state_ok"]}
    return {"format": "tenplex.demo/1", "config": asdict(cfg), "loss_rtol": LOSS_RTOL, "steps": rows,
            "max_loss_diff": max((r["diff"] for r in rows if r["diff"] is not None), default=None),
            "restore": restore, "samples": samples, "params": params, "checks": checks,
            "ok": all(checks.values())}
