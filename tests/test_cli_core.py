"""`tenplex layout` and `tenplex plan` from the command line."""

import json
import subprocess
import sys

import pytest

from tenplex.cli import main
from tenplex.files import load_layout
from tenplex.transfer_plan import plan_from_dict

GPT = ["--layers", "4", "--hidden", "32", "--heads", "4", "--vocab", "50", "--optimizer", "adam"]


def layout_cmd(path, parallel, hosts, per_host, *extra):
    return ["layout", *GPT, "--parallel", parallel, "--hosts", str(hosts), "--devices-per-host", str(per_host),
            "-o", str(path), *extra]


def test_layout_then_plan_summary_and_json(tmp_path, capsys):
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    assert main(layout_cmd(old, "dp=2,tp=2,pp=2", 2, 4)) == 0
    assert "wrote" in capsys.readouterr().out
    assert main(layout_cmd(new, "dp=3,tp=2,pp=1", 3, 2, "--sharding", "full", "--vocab-pad-multiple", "4")) == 0
    capsys.readouterr()
    assert len(load_layout(new).devices) == 6

    assert main(["plan", str(old), str(new)]) == 0
    summary = capsys.readouterr().out
    for words in ("kept in place", "copied within hosts", "sent between hosts", "lower bound",
                  "busiest sender", "busiest receiver", "transfers", "planned in"):
        assert words in summary

    assert main(["plan", str(old), str(new), "--json", "-o", str(tmp_path / "plan.json")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == "tenplex.plan/1"
    result = plan_from_dict(doc)
    assert result.stats.inter_host_bytes == result.stats.inter_host_lower_bound > 0
    assert json.loads((tmp_path / "plan.json").read_text()) == doc


def test_layout_to_stdout_is_a_layout_document(capsys):
    assert main(["layout", *GPT, "--parallel", "tp=2", "--hosts", "1", "--devices-per-host", "2", "--tied"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == "tenplex.layout/1" and "head.weight" not in doc["tensors"]


@pytest.mark.parametrize("args, message", [
    (["layout", *GPT, "--parallel", "dp=2,tp=2", "--hosts", "1", "--devices-per-host", "2"],
     "needs 4 devices, but --hosts 1 x --devices-per-host 2 gives 2"),
    (["layout", *GPT, "--parallel", "tp=3", "--hosts", "1", "--devices-per-host", "3"], "cannot be split over tp=3"),
    (["layout", *GPT, "--parallel", "pp=8", "--hosts", "1", "--devices-per-host", "8"], "use pp <= 4"),
    (["layout", *GPT, "--parallel", "dp=two", "--hosts", "1", "--devices-per-host", "2"], "cannot parse 'dp=two'"),
    (["layout", *GPT, "--parallel", "pp=2", "--stages", "1,x", "--hosts", "1", "--devices-per-host", "2"],
     "--stages"),
    (["plan", "/nonexistent/old.json", "/nonexistent/new.json"], "no such file"),
])
def test_bad_arguments_give_one_line_errors(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_console_script_exits_non_zero_without_traceback(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "tenplex.layout/1", "tensors": {"w": {"shape": [2], "dtype": "float32"}},
                               "devices": {"h0/0": [{"tensor": "w", "offsets": [1], "lengths": [2]}]}}))
    entry = "import sys; from tenplex.cli import main; sys.exit(main())"  # what the console script runs
    proc = subprocess.run([sys.executable, "-c", entry, "plan", str(bad), str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "lies outside its shape [2]" in proc.stderr


def test_bench_plan_prints_json_rows_with_baselines(capsys):
    assert main(["bench", "plan", "--json", "--devices", "256", "--layers", "16", "--hidden", "64", "--heads", "8",
                 "--vocab", "300", "--series-devices", "128", "--series-layers", "", "--rank-series", "256"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    ranked = [r for r in rows if r["scenario"].startswith("per-rank: ")]
    rows = rows[:len(rows) - len(ranked)]
    assert [r["scenario"] for r in rows] == ["dp/pp change", "tp/dp change", "ZeRO-1 on", "lose one dp replica",
                                             "series: 128 devices"]
    assert [r["scenario"] for r in ranked] == [f"per-rank: {r['scenario']} at 256 devices" for r in rows[:4]]
    for row in ranked:  # one rank's share: a small part of the global plan, beside it
        assert 0 < row["rank"]["transfers"] < row["global"]["transfers"] // 16
        assert row["rank"]["peak_traced_bytes"] > 0 and row["global"]["peak_traced_bytes"] > 0
        assert (row["rank"]["union_max_source_device_bytes"] > 0) == (row["global"]["max_source_device_bytes"] > 0)
    for row in rows:
        assert row["inter_host_bytes"] == row["inter_host_lower_bound"] <= row["baseline"]["reload_bytes"]
        assert row["transfers"] > 0 and row["plan_seconds"] >= 0
    assert rows[0]["baseline"]["floor_cpu_seconds"] >= 0 and rows[0]["inter_host_bytes"] > 0


def test_a_bug_keeps_its_traceback_while_user_errors_are_one_line(monkeypatch, capsys):
    import tenplex.cli.plan as plan_cli
    from tenplex.cli import user_error
    from tenplex.errors import UsageError

    def broken(path):
        raise KeyError("internal bug")

    monkeypatch.setattr(plan_cli, "load_layout", broken)
    with pytest.raises(KeyError, match="internal bug"):
        main(["plan", "old.json", "new.json"])
    assert "error:" not in capsys.readouterr().err
    assert user_error(UsageError("--steps must be at least 1")) and user_error(FileNotFoundError(2, "gone", "x.json"))
    assert not user_error(ValueError("a bug's ValueError")) and not user_error(OSError("socket closed"))
