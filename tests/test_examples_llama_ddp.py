"""Run examples/02-llama-fsdp-tp and examples/03-ddp-elastic shortened through `tenplex run`, as their READMEs do."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _run(example: str, root: Path, nproc: int, *args: str) -> str:
    # --standalone: one node, torchrun picks a free port itself (no race with other processes on this machine).
    result = subprocess.run([sys.executable, "-m", "tenplex.cli", "run", "--host", "h0", "--store-root", str(root),
                             "--standalone", "--nproc-per-node", str(nproc), "train.py", *args],
                            env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300,
                            cwd=EXAMPLES / example)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def _stop_store(root: Path) -> None:
    """tenplex run leaves its store serving: stop it as `tenplex store stop --store-root` does."""
    from tenplex.elastic.launcher import stop_store

    if root.exists():
        stop_store(root)


def _losses(out: str) -> list[float]:
    return [float(x) for x in re.findall(r"^step\s+\d+\s+loss (\S+)", out, flags=re.M)]


def test_llama_saved_under_fsdp_restores_bit_for_bit_under_tp_and_trains_on(tmp_path):
    pytest.importorskip("transformers")
    root, dump = tmp_path / "h0", tmp_path / "dump"
    try:
        first = _run("02-llama-fsdp-tp", root, 2, "--parallel", "fsdp", "--steps", "2", "--dump", str(dump))
        second = _run("02-llama-fsdp-tp", root, 2, "--parallel", "tp", "--steps", "4", "--dump", str(dump))
    finally:
        _stop_store(root)
    assert "fsdp on 2 ranks: fresh start" in first
    assert "tp on 2 ranks: restored step 2" in second
    from safetensors.torch import load_file

    saved = load_file(str(dump / "saved_step2.safetensors"))
    restored = load_file(str(dump / "restored_step2.safetensors"))
    assert sorted(saved) == sorted(restored)
    assert any(k.startswith("optim.exp_avg_sq.") for k in saved)  # the AdamW moments are compared too
    assert [k for k in saved if not torch.equal(saved[k], restored[k])] == []
    # The losses across the change equal one process training the whole global batch without stopping.
    reference = _uninterrupted_llama_losses(4)
    assert _losses(first) + _losses(second) == pytest.approx(reference, rel=1e-5)


def _uninterrupted_llama_losses(steps: int) -> list[float]:
    from transformers import LlamaConfig, LlamaForCausalLM

    train = _load_example_module("02-llama-fsdp-tp", "train")  # the example's own constants
    CONFIG, GLOBAL_BATCH, SEQ = train.CONFIG, train.GLOBAL_BATCH, train.SEQ
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        tokens = torch.randint(0, CONFIG["vocab_size"], (GLOBAL_BATCH, SEQ + 1),
                               generator=torch.Generator().manual_seed(step))
        loss = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_ddp_script_resumes_on_another_world_size_on_the_same_global_batches(tmp_path):
    example = EXAMPLES / "03-ddp-elastic"
    subprocess.run([sys.executable, str(example / "make_data.py"), str(tmp_path / "data"), "--samples", "96"],
                   check=True, capture_output=True, timeout=120)
    data = str(tmp_path / "data" / "dataset")
    root = tmp_path / "h0"
    try:
        first = _run("03-ddp-elastic", root, 2, "--data", data, "--steps", "3", "--save-every", "0")
        second = _run("03-ddp-elastic", root, 1, "--data", data, "--steps", "6", "--save-every", "0")
    finally:
        _stop_store(root)
    assert "world 2: dp=2,tp=1,pp=1; fresh start" in first
    assert "world 1: dp=1,tp=1,pp=1; restored step 3" in second and "done at step 6" in second
    # Two replicas averaging half-batch gradients, then one replica: the losses of one replica that never stopped.
    reference = _uninterrupted_ddp_losses(tmp_path / "data" / "tokens.bin", 6)
    assert len(reference) == 6
    assert _losses(first) + _losses(second) == pytest.approx(reference, rel=1e-5)


def _uninterrupted_ddp_losses(tokens_bin: Path, steps: int) -> list[float]:
    """The example's model and optimizer trained in this process on the whole global batch of every step, read
    straight from make_data.py's token file in the order the dataset state documents (tenplex.dataset.state:
    epoch e reads ``default_rng([seed, e]).permutation(N)``, global batch k is ``order[k*B:(k+1)*B]``), with
    Job's defaults (seed 0) and the script's global batch 8: neither tenplex's reader nor a Job is involved."""
    import numpy as np
    import torch.nn.functional as F

    make_data, train = (_load_example_module("03-ddp-elastic", name) for name in ("make_data", "train"))
    tokens = np.fromfile(tokens_bin, dtype=np.uint16).reshape(-1, make_data.SEQ + 1)
    order = np.random.default_rng([0, 0]).permutation(len(tokens))
    global_batch = 8
    assert steps * global_batch <= len(tokens)  # one epoch
    torch.manual_seed(0)
    model = train.NextToken()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        batch = torch.from_numpy(tokens[order[step * global_batch:(step + 1) * global_batch]].astype(np.int64))
        loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _load_example_module(example: str, name: str):
    """An example's module under a name of its own (both examples have a train.py: no clash in sys.modules)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"example_{example[:2]}_{name}", EXAMPLES / example / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
