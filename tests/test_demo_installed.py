"""The installed package runs ``tenplex demo --elastic``: the wheel ships the training script the demo runs
(issue 31, item 8), and that script is the one ``examples/01-gpt-train`` shows users."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]
SHIPPED = ("train.py", "record.py")


def test_the_packaged_training_script_is_the_examples_copy():
    for name in SHIPPED:
        packaged = CHECKOUT / "tenplex" / "elastic" / "gpt_train" / name
        assert packaged.read_bytes() == (CHECKOUT / "examples" / "01-gpt-train" / name).read_bytes(), \
            f"{packaged} differs from examples/01-gpt-train/{name}: change both"


def _run(*argv: str | Path, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run([str(a) for a in argv], capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_an_installed_wheel_runs_a_short_elastic_demo_outside_the_checkout(tmp_path):
    # Build from a copy of what a source distribution holds, so that the checkout gets no build/ or egg-info.
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("tenplex", "fuse_vfs"):
        shutil.copytree(CHECKOUT / name, src / name, ignore=ignore)
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(CHECKOUT / name, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the checkout stays off the path
    env["OMP_NUM_THREADS"] = "1"
    _run(*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", tmp_path / "dist", src,
         timeout=300)
    (wheel,) = (tmp_path / "dist").glob("tenplex-*.whl")
    assert "tenplex/elastic/gpt_train/train.py" in zipfile.ZipFile(wheel).namelist()

    # A fresh environment with the wheel; its dependencies (torch…) come from this one's site-packages, which a
    # .pth file appends to its path (.pth files in an appended folder are not run: an editable tenplex there
    # stays out of reach). The wheel goes in first: through the .pth, pip would take this environment's tenplex
    # for an installed one.
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv, timeout=120)
    python = venv / "bin" / "python"
    _run(*pip, "--python", python, "install", "--no-deps", "--no-index", "--ignore-installed", "-q", wheel,
         env=env, cwd=tmp_path, timeout=300)
    purelib = _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
    ours = sysconfig.get_paths()  # this interpreter's, from sys.prefix (the checkout's .venv in CI)
    Path(purelib, "_deps.pth").write_text("".join(f"{p}\n" for p in dict.fromkeys((ours["purelib"],
                                                                                    ours["platlib"]))))

    where = _run(python, "-c", "import tenplex; print(tenplex.__file__)", env=env, cwd=tmp_path).stdout
    assert where.startswith(str(venv)), where
    demo = _run(venv / "bin" / "tenplex", "demo", "--elastic", "--schedule", "leave:h1@1", "--steps", "2",
                "--workdir", tmp_path / "work", env=env, cwd=tmp_path, timeout=600)
    assert demo.stdout.splitlines()[-1] == "OK", demo.stdout[-3000:]
    assert "resumed from step 2, 0 step(s) lost" in demo.stdout
