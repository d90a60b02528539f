"""No import circles in the package: no module imports (at the top or inside a function) one that imports it back,
through any chain, a package's __init__ included."""

import ast
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "polopt_lightning"


def imports(root: pathlib.Path) -> dict[str, set[str]]:
    """Each module of the package -> the package's modules it imports (at the top or inside a function), the
    packages whose ``__init__`` that runs included."""
    mods = {}

    for p in root.rglob('*.py'):
        rel = p.relative_to(root.parent).with_suffix('')
        name = '.'.join(rel.parts)
        mods[name[:-9] if name.endswith('.__init__') else name] = p

    def resolve(cur, node):
        pkg = cur if mods[cur].name == '__init__.py' else cur.rsplit('.', 1)[0]
        if not node.level:
            return node.module or ''
        base = pkg
        for _ in range(node.level - 1):
            base = base.rsplit('.', 1)[0]
        return base + ('.' + node.module if node.module else '')

    edges = {m: set() for m in mods}
    for m, p in mods.items():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom):
                t = resolve(m, node)
                cands = [t] + [t + '.' + a.name for a in node.names]
            elif isinstance(node, ast.Import):
                cands = [a.name for a in node.names]
            else:
                continue
            for c in cands:
                if c in mods and c != m:
                    edges[m].add(c)
                    parts = c.split('.')
                    for i in range(1, len(parts)):  # importing a.b.c runs a's and a.b's __init__ first
                        pk = '.'.join(parts[:i])
                        if pk in mods and pk != m and not m.startswith(pk + '.'):
                            edges[m].add(pk)
    return edges


def cycles(root: pathlib.Path) -> list[list[str]]:
    """The groups of modules that import each other around a circle (Tarjan's strongly connected components)."""
    edges = imports(root)
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    sys.setrecursionlimit(10000)
    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_the_package_has_no_import_circles():
    assert cycles(ROOT) == []


def test_the_check_finds_a_circle(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from .sub import b\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "b.py").write_text("def f():\n    from .. import a  # lazily\n")
    assert cycles(package) == [["pkg.a", "pkg.sub.b"]]


def test_no_test_module_imports_another():
    """Shared helpers live in tests/helpers and tests/conftest.py: a test module importing another runs (and couples to)
    its module-level code."""
    tests = pathlib.Path(__file__).resolve().parent
    offenders = []
    for path in sorted(tests.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1].startswith("test_"):
                offenders.append(f"{path.name}:{node.lineno}")
    assert offenders == []


def test_a_missing_need_skips_with_its_reason_and_an_unknown_one_is_refused():
    import pytest

    from tests.helpers import NEEDS, run_if

    mark = run_if("2 cuda", "procfs")
    expected = not NEEDS["2 cuda"][0]() or not NEEDS["procfs"][0]()
    assert mark.args == (expected,)
    if expected:
        assert "needs 2 CUDA devices" in mark.kwargs["reason"]
    with pytest.raises(KeyError, match="run_if: unknown needs"):
        run_if("avx1024")


def test_a_marker_that_selects_a_test_makes_its_missing_need_fail():
    """``-m vllm`` (``-m gpu``) runs in the environment made for those tests: there a missing vLLM (CUDA) fails
    (tests/conftest.py); a run that selects them by another mark, or deselects them, skips as before."""
    import pytest

    from tests.helpers import MARKER_NEEDS, NEEDS, failing_needs, selected_by

    assert MARKER_NEEDS == {"vllm": "vllm", "gpu": "cuda"}
    assert selected_by("vllm", {"vllm", "skipif"}) == {"vllm"}
    assert selected_by("gpu", {"gpu", "skipif", "parametrize"}) == {"gpu"}
    assert selected_by("vllm or gpu", {"gpu"}) == {"gpu"}
    assert selected_by("vllm and not slow", {"vllm"}) == {"vllm"}
    assert selected_by("not slow and not gpu and not vllm and not commands", {"vllm"}) == set()  # the default run
    assert selected_by("not slow", {"vllm"}) == set()  # selects everything: not the vLLM environment
    assert selected_by("commands", {"commands", "vllm"}) == set()
    assert selected_by("", {"vllm"}) == set() and selected_by(None, {"gpu"}) == set()

    class Item:  # a collected test's marks, as tests/conftest.py reads them
        def __init__(self, *marks):
            self.marks = [m.mark for m in marks]

        def iter_markers(self, name=None):
            return [m for m in self.marks if name in (None, m.name)]

    gpu, missing = pytest.mark.gpu, lambda *needs: pytest.mark.skipif(True, reason="", missing=needs)
    assert failing_needs("gpu", Item(gpu, missing("cuda"))) == [NEEDS["cuda"][1]]
    # a one-GPU machine is a GPU machine: the two-device tests skip there under -m gpu
    assert failing_needs("gpu", Item(gpu, missing("2 cuda"))) == []
    assert failing_needs("not gpu", Item(gpu, missing("cuda"))) == failing_needs("gpu", Item(missing("cuda"))) == []


def test_a_moved_module_still_imports_from_its_old_path_as_the_same_module_with_a_warning():
    """Saved runs name modules in their configs (``_target_: polopt_lightning.update.UpdateConfig``): each old path
    of ``MOVED_MODULES`` imports the new module itself (Hydra's too) and says where it went."""
    import subprocess

    code = """
import importlib, sys, warnings
from hydra.utils import get_class
from polopt_lightning import MOVED_MODULES
for old, new in MOVED_MODULES.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is importlib.import_module(new) and sys.modules[old] is module, old
    assert [str(w.message) for w in caught if w.category is FutureWarning] == [
        f"{old} has moved to {new}: import it from there (the old path goes in a later release)"], caught
import polopt_lightning.step.update as update
assert get_class("polopt_lightning.update.UpdateConfig") is update.UpdateConfig
print(len(MOVED_MODULES))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT.parent, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["8"], out.stderr[-2000:]
    assert not (ROOT / "update.py").exists() and (ROOT / "step" / "update.py").exists()


def test_generic_code_reaches_the_cpu_fast_path_only_through_the_accel_plugins():
    """No module outside ``accel/`` imports ``accel.cpu``: the module, the transformers backend and the model loader
    ask :mod:`polopt_lightning.accel` (its ``PLUGINS``), which imports the CPU plugin when first used."""
    from polopt_lightning import accel

    reach = {m: sorted(t for t in targets if t.startswith("polopt_lightning.accel.cpu"))
             for m, targets in imports(ROOT).items() if not m.startswith("polopt_lightning.accel")}
    assert {m: t for m, t in reach.items() if t} == {}
    cpu = accel.plugin("cpu")
    assert type(accel.training({"keep_host_memory": False})) is cpu.CPUFastPath
    assert type(accel.decoding(None)) is cpu.CPUDecoding
    with pytest.raises(ValueError, match=r"no accel plugin 'tpu'; registered: \['cpu'\]"):
        accel.plugin("tpu")


def test_the_objectives_stand_below_the_step():
    """The step (experience, advantages, update) uses the objectives; the objectives import nothing of the step, nor of
    the module, the rollouts or the CLI: a loss is pure tensor arithmetic (issue 50: the advantage scale's names moved
    from ``step.advantages`` to ``objectives.base``, whose objectives name the scale they want)."""
    above = ("polopt_lightning.step", "polopt_lightning.module", "polopt_lightning.rollout", "polopt_lightning.cli")
    reach = {m: sorted(t for t in targets if t.startswith(above))
             for m, targets in imports(ROOT).items() if m.startswith("polopt_lightning.objectives")}
    assert not any(reach.values()), reach


def test_the_tests_reach_the_fast_path_through_its_public_names():
    """No test imports a private name of ``accel/`` or reads one off a module of it (``cpu_linear._product``): the
    kernel tests observe which route ran through :mod:`polopt_lightning.accel.trace`, so the plugin's insides can
    change without its tests being rewritten."""
    reached = []
    for path in sorted((ROOT.parent / "tests").rglob("*.py")):
        tree = ast.parse(path.read_text())
        modules = set()  # local names bound to a module of accel/ (lean_step also by its old top-level name)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(("polopt_lightning.accel",
                                                                                   "polopt_lightning")):
                in_accel = node.module.startswith("polopt_lightning.accel")
                for alias in node.names:
                    if in_accel and alias.name.startswith("_"):
                        reached.append(f"{path.name}:{node.lineno} imports {node.module}.{alias.name}")
                    if in_accel or alias.name == "lean_step":
                        modules.add(alias.asname or alias.name)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                reached.append(f"{path.name}:{node.lineno} reads {node.value.id}.{node.attr}")
    assert not reached, reached


def test_the_wheel_lists_every_package():
    """pyproject.toml lists the packages a wheel holds by name: a folder of the package missing there would be missing
    from a (non-editable) install, however green an editable checkout's tests are."""
    import re

    text = (ROOT.parent / "pyproject.toml").read_text()
    listed = set(re.findall(r'"(polopt_lightning[\w.]*)"', re.search(r"packages = \[(.*?)\]", text, re.S).group(1)))
    folders = {".".join(p.parent.relative_to(ROOT.parent).parts) for p in ROOT.rglob("__init__.py")}
    assert folders - listed == set(), f"packages missing from pyproject.toml's [tool.setuptools] packages: {folders - listed}"
