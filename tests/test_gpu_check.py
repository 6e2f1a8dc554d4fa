"""``scripts/gpu-check`` can run on the GPU machine, which reaches no package registry: the wheels it installs
from satisfy setup.cfg and fit CPython 3.12 on x86-64 Linux, and the benchmark's state is the size it says.
(The script itself runs end to end here as a CPU dry run: ``scripts/gpu-check --out DIR``.)"""

from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "scripts" / "gpu-check"
CARRIED = ("grpcio", "protobuf", "tqdm")  # what the GPU machine may hold in too old a version, or not at all


def load_script():
    loader = importlib.machinery.SourceFileLoader("gpu_check", str(SCRIPT))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("gpu_check", loader))
    loader.exec_module(module)
    return module


def test_the_carried_wheels_satisfy_setup_cfg_and_fit_the_gpu_machine():
    script = load_script()
    minimums = script.requirements()
    wheels = sorted(script.WHEELS.glob("*.whl"))
    assert sum(w.stat().st_size for w in wheels) < 32 << 20  # it travels with the working tree
    for name in CARRIED:
        mine = [w for w in wheels if w.name.split("-")[0].lower() == name]
        assert len(mine) == 1, f"one wheel of {name} (two stop the install), got {[w.name for w in mine]}"
        _, version, python, abi, platform = mine[0].name.removesuffix(".whl").split("-")
        assert script.version_tuple(version) >= minimums[name], f"{mine[0].name} is older than setup.cfg asks"
        assert python in ("cp312", "py3") or abi == "abi3", mine[0].name
        assert platform == "any" or "manylinux" in platform and platform.endswith("x86_64"), mine[0].name


def test_the_benchmark_state_is_about_the_size_asked_for():
    script = load_script()
    # hidden 4096, ffn 16384, vocabulary 32768: 268.5M parameters outside the layers, 201.4M per layer, 12 bytes each
    assert script.model_for(8.0)[-1] == "2"  # 671.2M parameters: 8.05 GB
    assert script.model_for(30.0)[-1] == "11"
