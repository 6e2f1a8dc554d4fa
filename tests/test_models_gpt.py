"""The reference GPT's state has exactly the names and shapes of the built-in GPT partition rules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import tenplex
from tenplex.errors import ConfigError
from tenplex.models.gpt import GPT, GPTConfig, Parallel, rules


@pytest.mark.parametrize("cfg", [GPTConfig(), GPTConfig(vocab=50, seq=5, hidden=24, heads=6, layers=3, ffn=40)])
def test_state_names_and_shapes_are_the_rules(cfg):
    torch.manual_seed(0)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, cfg.seq, dtype=torch.long)).sum().backward()
    optimizer.step()
    names = {id(p): n for n, p in model.named_parameters()}
    state = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    for param, moments in optimizer.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            state[f"optim.{key}.{names[id(param)]}"] = tuple(moments[key].shape)
    ptc = rules(cfg)
    assert state == {name: tuple(rule.shape) for name, rule in ptc.rules.items()}
    assert "layers.0.attn.qkv.weight" in state and state["layers.0.attn.qkv.weight"] == (3 * cfg.hidden, cfg.hidden)


def test_fused_qkv_rows_are_q_then_k_then_v():
    """Rows [0, h) of the fused weight make the queries: zeroing them makes every query zero (uniform attention)."""
    cfg = GPTConfig()
    torch.manual_seed(0)
    attn = GPT(cfg).layers["0"].attn
    x = torch.randn(1, cfg.seq, cfg.hidden)
    with torch.no_grad():
        attn.qkv.weight[:cfg.hidden] = 0
        attn.qkv.bias[:cfg.hidden] = 0
        v = torch.nn.functional.linear(x, attn.qkv.weight[2 * cfg.hidden:], attn.qkv.bias[2 * cfg.hidden:])
        # With zero queries, causal attention averages the values of positions 0..t.
        mean = v.cumsum(1) / torch.arange(1, cfg.seq + 1).view(1, -1, 1)
        assert torch.allclose(attn(x), attn.proj(mean), atol=1e-6)


def test_parallel_specs_use_the_one_parser():
    assert Parallel.parse("tp=2,dp=2,fsdp=1") == Parallel(dp=2, tp=2, fsdp=True)
    assert Parallel.parse("pp=2,microbatches=4").microbatches == 4
    for bad in ("tp=x", "fsdp", "zp=2", "microbatches=0"):
        with pytest.raises(ConfigError):
            Parallel.parse(bad)


def test_shipped_code_does_not_change_sys_path():
    """Nothing shipped imports ``examples/``: no module puts a folder on ``sys.path``, except the worker entry shim,
    which runs a user's script in-process as ``python TARGET`` would: the script's own folder first, nothing else."""
    root = Path(tenplex.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", None) == "sys":
                offenders.append(str(path.relative_to(root)))
    assert offenders == ["elastic/entry.py"]
    uses = [line.strip() for line in (root / "elastic" / "entry.py").read_text().splitlines() if "sys.path" in line]
    assert uses == ["sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python TARGET` puts it first"]
