"""Layouts and plans written through the fast JSON path stay standard JSON that the json module reads back."""

from __future__ import annotations

import json

import pytest

from tenplex import files
from tenplex.files import load_layout, load_plan, save_layout, save_plan
from tenplex.gpt import gpt
from tenplex.parallel import ParallelConfig
from tenplex.planner import plan
from tenplex.ptc import layout


@pytest.fixture(params=["orjson", "json"])
def encoder(request, monkeypatch):
    if request.param == "orjson":
        pytest.importorskip("orjson")
    else:
        monkeypatch.setattr(files, "orjson", None)  # the standard library's path
    return request.param


def test_layout_and_plan_files_are_compact_standard_json(tmp_path, encoder):
    model = gpt(2, 64, 4, 100, optimizer="adam")
    old = layout(model, ParallelConfig.on_hosts(2, 2, 2, 2, 4))
    new = layout(model, ParallelConfig.on_hosts(1, 4, 1, 2, 2, sharding="optimizer"))
    the_plan = plan(old, new)
    save_layout(old, tmp_path / "old.json")
    save_plan(the_plan, tmp_path / "plan.json")
    for path, doc in ((tmp_path / "old.json", old.to_dict()), (tmp_path / "plan.json", the_plan.to_dict())):
        text = path.read_text()
        assert json.loads(text) == doc  # the json module reads it, and it says exactly what to_dict says
        assert text == json.dumps(doc, separators=(",", ":"))  # byte for byte the compact form, either encoder
    assert load_layout(tmp_path / "old.json") == old
    assert load_plan(tmp_path / "plan.json") == the_plan


def test_malformed_json_is_a_layout_error_with_either_parser(tmp_path, encoder):
    (tmp_path / "bad.json").write_text('{"format": "tenplex.layout/1", ')
    with pytest.raises(files.LayoutError, match="not valid JSON"):
        load_layout(tmp_path / "bad.json")
