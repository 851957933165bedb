"""The package's import graph, read from the source with `ast` (nothing is imported): no cycle, and the
modules meant to be light stay light."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from evictlab.store import REPO_ROOT

SRC = REPO_ROOT / "src"


def module_name(path: Path, src: Path = SRC) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its file (top level, inside functions, and
    under `if TYPE_CHECKING:` alike), `from a import b` counted as a.b when a.b is a module, else as a.
    A top-level `if __name__ == "__main__":` block is left out: it runs only when the file is a script
    (`python -m`), as a module object of its own, so its imports cannot close a cycle."""
    files = {module_name(p, src): p for p in src.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        deps = set()
        tree = ast.parse(path.read_text(), str(path))
        tree.body = [n for n in tree.body if not is_main_guard(n)]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                names = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                continue
            for name in names:
                while name and name not in files:
                    name = name.rpartition(".")[0]
                if name and name != mod:
                    deps.add(name)
                    break
        graph[mod] = deps
    return graph


def is_main_guard(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test).replace("'", '"') == '__name__ == "__main__"'


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_the_cycle_finder_finds_a_cycle_and_nothing_else():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_relative_function_level_and_type_checking_imports(tmp_path: Path):
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from . import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.a import f\n")
    (pkg / "c.py").write_text("import p.b\nif __name__ == '__main__':\n    from p import d\n")
    (pkg / "d.py").write_text("from p import c\n")
    graph = import_graph(tmp_path)
    assert graph["p.a"] == {"p.b"} and graph["p.b"] == {"p.a"}
    assert graph["p.c"] == {"p.b"}  # the script-only block is not an import of the module
    assert cycles(graph) == [["p.a", "p.b"]]


def test_the_package_has_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_config_schema_imports_neither_evaluation_tracking_nor_the_sweeper():
    deps = import_graph()["evictlab.config"]
    heavy = {"evictlab.eval.evaluate", "evictlab.tracking", "evictlab.run", "evictlab.train"}
    assert not deps & heavy
    assert not {d for d in deps if d.startswith("hydra_plugins")}


def test_the_sweeper_reads_run_identity_without_the_engine():
    graph = import_graph()
    sweeper = graph["hydra_plugins.evictlab_sweeper.evictlab_sweeper"]
    assert "evictlab.identity" in sweeper and "evictlab.run" not in sweeper

    def reach(mod: str) -> set[str]:
        seen, todo = set(), [mod]
        while todo:
            for d in graph[todo.pop()] - seen:
                seen.add(d)
                todo.append(d)
        return seen

    assert not reach("evictlab.identity") & {"evictlab.run", "evictlab.train", "evictlab.eval.evaluate"}


def test_a_run_reaches_training_only_through_the_checkpoint_store():
    """run.py asks the store for its model (checkpoints.get_checkpoint, which trains on a miss); the
    subject's facts are computed there, and train.py imports neither the store nor the evaluation."""
    graph = import_graph()
    assert "evictlab.train" not in graph["evictlab.run"]
    assert "evictlab.checkpoints" in graph["evictlab.run"]
    assert not graph["evictlab.train"] & {"evictlab.checkpoints", "evictlab.eval.sinks", "evictlab.run"}


@pytest.mark.parametrize("module", ["evictlab.config", "evictlab.identity"])
def test_importing_the_config_or_the_run_identity_loads_neither_the_engine_nor_training(module):
    """At run time, not only in the source: a package's __init__ runs when one of its modules is imported
    (`evictlab.eval.spec` runs `evictlab/eval/__init__.py`), which the AST graph above does not follow."""
    code = (
        f"import sys, {module}; "
        "print(sorted({'evictlab.eval.engine', 'evictlab.eval.loop', 'evictlab.train'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_shared_statistics_draw_nothing():
    """analysis/stats.py (the report tables' and the figures' statistics) runs without matplotlib."""
    import subprocess
    import sys

    code = (
        "import sys, evictlab.analysis.stats; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'matplotlib', 'seaborn', 'torch'}))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr


def _functions(src: Path = SRC):
    for path in src.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                yield path, node


def test_no_function_in_the_package_runs_over_60_lines():
    long = [
        f"{p.relative_to(SRC)}:{n.lineno} {n.name}" for p, n in _functions() if n.end_lineno - n.lineno >= 60
    ]
    assert long == []


def test_the_package_keeps_formatter_exemptions_to_five():
    count = sum(p.read_text().count("# fmt: skip") for p in SRC.rglob("*.py"))
    assert count <= 5


def _has_doc(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef) and ast.get_docstring(node) is not None
    )


def test_no_policy_name_is_a_string_literal_outside_the_policies():
    """Figures and the engine ask a policy what they need (a flag, an order), never its name. Exempt: the
    lazy-import table of evictlab.eval (module names) and the ablation arms' names (conf/arm/<name>.yaml)."""
    from evictlab.analysis.figures import ARMS
    from evictlab.cache import POLICIES

    found = []
    for path in SRC.rglob("*.py"):
        if "cache/policies" in path.as_posix():
            continue
        tree = ast.parse(path.read_text(), str(path))
        docstrings = {
            id(ast.get_docstring(n, clean=False) and n.body[0].value) for n in ast.walk(tree) if _has_doc(n)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in POLICIES and id(node) not in docstrings:
                found.append((path.relative_to(SRC).as_posix(), node.value))
    lazy = {("evictlab/eval/__init__.py", m) for m in ("full",)}
    arms = {
        ("evictlab/analysis/figures.py", a)
        for a in ARMS
        if (REPO_ROOT / "conf" / "arm" / f"{a}.yaml").exists()
    }
    assert [f for f in found if f not in lazy | arms] == []
