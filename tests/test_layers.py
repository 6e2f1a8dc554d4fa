"""The pure layers import no gRPC, no torch and no I/O-level tenplex modules."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import tenplex

PURE = ["_gc", "box", "dtypes", "devices", "errors", "parallel", "partition", "ptc", "gpt", "layout", "transfer_plan",
        "planner", "apply"]
FORBIDDEN = ("grpc", "torch", "tenplex.store", "tenplex.transform", "tenplex.integration", "tenplex.dataset",
             "tenplex.cli", "tenplex.files", "google.protobuf")
# Standard-library modules that do file, process or network I/O.
IO_MODULES = {"os", "io", "pathlib", "shutil", "socket", "subprocess", "tempfile", "multiprocessing", "pickle"}
ENV_ONLY = {"parallel": {"os"}}  # detect() reads environment variables, nothing else


def test_pure_modules_do_not_load_grpc_torch_or_io_layers():
    code = (f"import sys, json\nfor m in {PURE!r}: __import__('tenplex.' + m)\n"
            "print(json.dumps(sorted(sys.modules)))")
    # Import the modules directly, not through tenplex/__init__ (which the integration may extend).
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    loaded = json.loads(proc.stdout)
    bad = [m for m in loaded if m.startswith(FORBIDDEN)]
    assert not bad, f"pure modules pulled in {bad}"


def test_pure_modules_import_only_pure_things():
    root = Path(tenplex.__file__).parent
    for name in PURE:
        tree = ast.parse((root / f"{name}.py").read_text())
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    imported |= {f"tenplex.{node.module}" if node.module else "tenplex"}
                else:
                    imported.add(node.module)
        allowed_io = ENV_ONLY.get(name, set())
        assert not {m for m in imported if m.split(".")[0] in IO_MODULES - allowed_io}, (name, imported)
        assert not {m for m in imported if m.startswith(FORBIDDEN)}, (name, imported)
        assert all(m.split(".")[0] in ("tenplex", "numpy") or m.split(".")[0] in sys.stdlib_module_names
                   for m in imported), (name, imported)
        docstring = ast.get_docstring(tree) or ""
        assert "May import" in docstring, f"tenplex/{name}.py should say what it may import"
