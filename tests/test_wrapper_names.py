"""DDP, torch.compile and activation checkpointing save and restore under the bare model's names (2 gloo ranks)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tenplex.runtime.launch import run_spec_job

CASES = [("ddp", "bare"), ("bare", "ddp"), ("compile", "bare"), ("bare", "compile"), ("ckpt", "bare"),
         ("bare", "ckpt"), ("compile+ddp", "ddp"), ("container", "bare")]
BARE_NAMES = ["block.0.bias", "block.0.weight", "block.2.bias", "block.2.weight", "embed.bias", "embed.weight",
              "norm.bias", "norm.weight"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    base = tmp_path_factory.mktemp("wrappers")
    cases = [{"save": s, "restore": r, "root": str(base / f"{s}-{r}")} for s, r in CASES]
    worker = Path(__file__).parent / "mp" / "wrapper_worker.py"
    run_spec_job([sys.executable, str(worker)], {"cases": cases, "out": str(base / "out")}, base / "spec.json",
                 ["h0/0", "h0/1"], {"h0": base}, {}, base / "logs", timeout=300)
    per_rank = [json.loads((base / "out" / f"r{r}.json").read_text()) for r in range(2)]
    assert per_rank[0].keys() == per_rank[1].keys()
    return per_rank


@pytest.mark.parametrize("save,restore", CASES[:-1])
def test_wrapped_state_is_saved_under_bare_names_and_restores_bit_for_bit(results, save, restore):
    for rank in results:
        result = rank[f"{save}->{restore}"]
        assert "error" not in result, result.get("error")
        expected = BARE_NAMES + [f"optim.{k}.{n}" for k in ("exp_avg", "exp_avg_sq") for n in BARE_NAMES]
        assert result["saved_names"] == sorted(expected)
        assert result["step"] == 2
        assert result["compared"] == 3 * len(BARE_NAMES)
        assert result["different"] == []


def test_a_real_prefix_mismatch_leads_with_the_likely_cause(results):
    # A user's container with an attribute named `module` is no wrapper: its names keep the prefix, and
    # restoring into the bare model is a mismatch whose message starts with the cause, not a list of names.
    for rank in results:
        result = rank["container->bare"]
        assert all(n.startswith(("module.", "optim.exp_avg.module.", "optim.exp_avg_sq.module."))
                   for n in result["saved_names"])
        message = result["error"]
        assert message.startswith("all unmatched saved names start with `module.` and the restored job's names lack it")
        # 24 saved names and the 8 parameters: the restored optimizer gets state only for the parameters
        # saved with state, and no saved name matches a restored one
        assert "(32 differences)" in message


def test_likely_cause_on_either_side_and_none_for_unrelated_names():
    from tenplex.integration.names import likely_cause

    saved = {"w", "b", "optim.exp_avg.w"}
    restored = {"_orig_mod.w", "_orig_mod.b", "optim.exp_avg._orig_mod.w"}
    assert likely_cause(saved, restored, "optim.").startswith(
        "all unmatched restored job's names start with `_orig_mod.` and the saved names lack it")
    assert likely_cause(restored, saved, "optim.").startswith("all unmatched saved names start with `_orig_mod.`")
    assert likely_cause({"a.w", "a.b"}, {"c.w", "d.b"}, "optim.") is None
    assert likely_cause({"a.w"}, {"a.w", "x"}, "optim.") is None   # only a missing tensor: no prefix story


def test_bare_name_keeps_a_user_attribute_called_module():
    import torch
    from tenplex.integration.names import bare_name

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.module = torch.nn.Linear(2, 2)

    assert bare_name(Holder(), "module.weight") == "module.weight"
    compiled = torch.compile(Holder(), backend="eager")
    assert bare_name(compiled, "_orig_mod.module.weight") == "module.weight"
