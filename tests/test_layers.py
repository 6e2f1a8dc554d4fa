"""The pure layers import no gRPC, no torch and no I/O-level tenplex modules."""

import ast
import re
import json
import subprocess
import sys
from pathlib import Path

import tenplex

PURE = ["_gc", "box", "dtypes", "devices", "errors", "parallel", "partition", "ptc", "gpt", "layout", "transfer_plan",
        "planner", "apply", "regions", "plan_index", "share_planner"]
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


# ---------------------------------------------------------------- "May import:" contracts
# Every module's docstring (or, for a package, its __init__'s) says what it may import. This test holds the
# contracts to the code: every tenplex or fuse_vfs module a file imports must be named there (a package's
# modules may always import each other, and "every tenplex layer" / "every lower layer" allow any), and so
# must every third-party library it imports.
THIRD_PARTY = {"numpy": "numpy", "torch": "torch", "grpc": "grpc", "google": "protobuf", "xxhash": "xxhash",
               "safetensors": "safetensors", "tqdm": "tqdm", "mfusepy": "mfusepy", "fuse": "fusepy",
               "kopf": "kopf", "kubernetes": "kubernetes", "yaml": "yaml", "orjson": "orjson"}
ROOTS = ("tenplex", "fuse_vfs")


def _contract(tree: ast.Module) -> str | None:
    doc = ast.get_docstring(tree) or ""
    match = re.search(r"May import:(.*?)(?:\n\s*\n|$)", doc, re.S)
    return " ".join(match.group(1).split()) if match else None


def _imports(tree: ast.Module, package: str) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if not node.level:
                found.add(node.module or "")
                continue
            parts = package.split(".")
            base = parts[:len(parts) - node.level + 1]
            if node.module:
                found.add(".".join([*base, node.module]))
            else:  # from . import x: x may be a module of the package
                found |= {".".join([*base, alias.name]) for alias in node.names}
    return found


def _violations(path: Path, repo: Path) -> list[str]:
    module = ".".join(path.relative_to(repo).with_suffix("").parts).removesuffix(".__init__")
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    text = _contract(tree)
    if text is None:
        return [f"{module}: no 'May import:' line in its docstring"]
    if (ast.get_docstring(tree) or "").count("May import:") > 1:
        # A second paragraph drifts from the first unseen (only the first is checked): one contract per module.
        return [f"{module}: more than one 'May import:' paragraph in its docstring"]
    allowed = set(re.findall(r"(?<![\w.])((?:tenplex|fuse_vfs)(?:\.[a-z_]+)*)", text))
    anything = re.search(r"every (?:tenplex |lower )?(?:layer|module)", text) is not None
    # The top-level subpackage: tenplex.store.server may import tenplex.store.local.
    own = ".".join(module.split(".")[:2]) if module.count(".") else module
    problems = []
    for name in sorted(_imports(tree, package)):
        top = name.split(".")[0]
        if top in ROOTS:
            if name == own or name.startswith(own + ".") or anything:
                continue
            if not any(name == a or name.startswith(a + ".") for a in allowed if a != "tenplex") \
                    and name != "tenplex":
                problems.append(f"{module} imports {name}, which its 'May import:' line does not name")
            elif name == "tenplex" and "tenplex" not in allowed:
                problems.append(f"{module} imports tenplex, which its 'May import:' line does not name")
        elif top in THIRD_PARTY and THIRD_PARTY[top] not in text.lower() and top not in text.lower():
            problems.append(f"{module} imports {top}, which its 'May import:' line does not name")
    return problems


def test_may_import_lines_are_true():
    repo = Path(tenplex.__file__).parents[1]
    files = [p for root in ROOTS for p in sorted((repo / root).rglob("*.py")) if "_proto" not in p.parts]
    problems = [v for path in files for v in _violations(path, repo)]
    assert not problems, "\n".join(problems)


def test_the_contract_check_catches_a_drifted_line(tmp_path):
    """A module that imports what its line does not name is reported (the check can fail)."""
    pkg = tmp_path / "tenplex" / "box.py"
    pkg.parent.mkdir()
    pkg.write_text('"""Boxes.\n\nMay import: only the standard library.\n"""\nimport numpy\nfrom .store import Store\n')
    problems = _violations(pkg, tmp_path)
    assert any("numpy" in p for p in problems) and any("tenplex.store" in p for p in problems)


def test_the_contract_check_rejects_a_second_may_import_paragraph(tmp_path):
    """Two contracts in one docstring (the second unchecked, and drifting) are reported."""
    pkg = tmp_path / "tenplex" / "box.py"
    pkg.parent.mkdir()
    pkg.write_text('"""Boxes.\n\nMay import: numpy.\n\nMore.\n\nMay import: the standard library.\n"""\n'
                   "import numpy\n")
    assert _violations(pkg, tmp_path) == ["tenplex.box: more than one 'May import:' paragraph in its docstring"]


# ---------------------------------------------------------------- rooms: who may import whom
# Benchmarks sit on top: no runtime module may depend on one (the emulated cluster is tenplex.cluster, not a
# benchmark). And no module may import one that imports it back, however indirectly: a circle means two modules
# that are really one, or a helper that belongs below both.
def _module_graph(repo: Path) -> dict[str, set[str]]:
    """{module: the tenplex modules it imports}, from the source (imports inside functions count too). An import
    of a package's name (its __init__'s re-exports) is not an edge: a package's __init__ gathers its modules."""
    modules = {}
    for path in sorted((repo / "tenplex").rglob("*.py")):
        if "_proto" in path.parts:
            continue
        module = ".".join(path.relative_to(repo).with_suffix("").parts).removesuffix(".__init__")
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        modules[module] = (path.name == "__init__.py", _imports(ast.parse(path.read_text()), package))
    return {m: {i for i in imported if i in modules and i != m and not modules[i][0]}
            for m, (_, imported) in modules.items()}


def _bench_importers(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} imports {i}" for m, imported in graph.items() if not m.startswith("tenplex.bench")
                  for i in imported if i == "tenplex.bench" or i.startswith("tenplex.bench."))


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected sets of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = []
            while not members or members[-1] != v:
                members.append(stack.pop())
            if len(members) > 1:
                circles.append(sorted(members))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_runtime_module_imports_a_benchmark():
    graph = _module_graph(Path(tenplex.__file__).parents[1])
    assert not _bench_importers(graph)
    # the modules that moved out of tenplex.bench are where their users import them from
    assert "tenplex.cluster.emulated" in graph and "tenplex.bench.cluster" not in graph


def test_no_import_circles():
    assert _circles(_module_graph(Path(tenplex.__file__).parents[1])) == []


def test_the_room_checks_catch_a_runtime_bench_import_and_a_circle(tmp_path):
    """The checks can fail: an elastic module importing a benchmark, and three bench modules in a circle (the
    shape of the old compare -> compare_linked -> simulate -> compare)."""
    files = {"__init__.py": "", "bench/__init__.py": "", "elastic/__init__.py": "",
             "elastic/nodes.py": "def f():\n    from ..bench.cluster import EmulatedCluster\n",
             "bench/cluster.py": "",
             "bench/compare.py": "def f():\n    from .compare_linked import run\n",
             "bench/compare_linked.py": "def run():\n    from .simulate import central_layout\n",
             "bench/simulate.py": "def central_layout():\n    from . import compare\n"}
    for name, text in files.items():
        (tmp_path / "tenplex" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "tenplex" / name).write_text(text)
    graph = _module_graph(tmp_path)
    assert _bench_importers(graph) == ["tenplex.elastic.nodes imports tenplex.bench.cluster"]
    assert _circles(graph) == [["tenplex.bench.compare", "tenplex.bench.compare_linked", "tenplex.bench.simulate"]]


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for imported in graph[todo.pop()] - seen:
            seen.add(imported)
            todo.append(imported)
    return seen


def test_the_worker_api_does_not_import_the_command_line_launcher():
    """A training script's Job sits below ``tenplex run``: nothing it imports, however indirectly, loads the
    launcher (its exit codes come from tenplex.elastic.faults)."""
    graph = _module_graph(Path(tenplex.__file__).parents[1])
    assert "tenplex.elastic.launcher" not in _reachable(graph, "tenplex.elastic.job")
