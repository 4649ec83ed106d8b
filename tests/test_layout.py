"""The package's shape, checked: data flows one way (no import circles, imports inside
functions counted), private names stay inside their subpackage, the package top stays small,
and the framework-neutral core (ir/, passes/) never imports or names a framework."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import networkx as nx
import pytest

PKG = Path(__file__).resolve().parents[1] / "diphoma_compile"
FRAMEWORK_PACKAGES = {"torch", "jax", "jaxlib", "flax", "optax", "equinox", "haiku"}
NEUTRAL = ("ir", "passes")
FRAMEWORKS = ("torch", "jax")


def _modules() -> dict[str, Path]:
    """Dotted module name (``diphoma_compile.ir.core``) -> file."""
    out = {}
    for f in sorted(PKG.rglob("*.py")):
        parts = f.relative_to(PKG.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imports(name: str) -> list[tuple[str, list[str], ast.AST]]:
    """(absolute module, imported names, node) for every import in the module, at any depth."""
    tree = ast.parse(MODULES[name].read_text())
    base = name.split(".") if _is_package(name) else name.split(".")[:-1]
    found = []
    # imports under ``if TYPE_CHECKING:`` are for annotations and never run
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
            and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING"
            for n in ast.walk(node)}
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [(a.name, [], node) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base[:len(base) - node.level + 1]
                mod = ".".join(parts + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.append((mod, [a.name for a in node.names], node))
    return found


def _internal_edges(name: str) -> set[str]:
    """The package modules ``name`` imports (a submodule imported by name counts as itself),
    and those it names in a string (loaded with importlib.import_module)."""
    out = set()
    for mod, names, _ in _imports(name):
        if mod in MODULES:
            out.add(mod)
            out.update(f"{mod}.{n}" for n in names if f"{mod}.{n}" in MODULES)
    tree = ast.parse(MODULES[name].read_text())
    out.update(n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
               and isinstance(n.value, str) and n.value in MODULES)
    return out - {name}


def _subpackage(name: str) -> str:
    """``ir`` for diphoma_compile.ir.core; the module itself for a top-level module."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_import_circles():
    g = nx.DiGraph()
    for name in MODULES:
        for dep in _internal_edges(name):
            # a package's __init__ importing its own modules, and a module importing its
            # package (which runs that __init__) are how packages work, not a circle
            if name.startswith(dep + ".") or dep.startswith(name + "."):
                continue
            g.add_edge(name, dep)
    cycles = list(nx.simple_cycles(g))
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c + c[:1]) for c in cycles)


def test_no_private_name_crosses_a_subpackage():
    bad = []
    for name in MODULES:
        for mod, names, node in _imports(name):
            if mod not in MODULES or _subpackage(mod) == _subpackage(name):
                continue
            bad += [f"{name}:{node.lineno} imports {mod}.{n}" for n in names
                    if n.startswith("_") and not n.startswith("__")]
    assert not bad, "\n".join(bad)


def test_framework_packages_are_reached_only_through_the_registry():
    """Outside torch/ and jax/, no module imports them but framework.py's registry, which
    loads each one's framework module by name."""
    registry = "diphoma_compile.framework"
    bad = [f"{name} imports {dep}" for name in MODULES if _subpackage(name) not in FRAMEWORKS
           for dep in _internal_edges(name) if _subpackage(dep) in FRAMEWORKS
           and not (name == registry and dep.endswith(".framework"))]
    assert not bad, "\n".join(bad)


def test_ir_imports_nothing_above_it_but_errors_and_mesh():
    bad = [f"{name} imports {dep}" for name in MODULES if _subpackage(name) == "ir"
           for dep in _internal_edges(name) if _subpackage(dep) != "ir"
           and dep not in ("diphoma_compile.errors", "diphoma_compile.mesh")]
    assert not bad, "\n".join(bad)


def test_package_top_is_small():
    top = [f.name for f in PKG.glob("*.py")]
    assert len(top) <= 12, sorted(top)


def _strings(tree: ast.AST) -> list[ast.Constant]:
    """String constants that are not docstrings."""
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docs.add(id(body[0].value))
    return [n for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and isinstance(n.value, str) and id(n) not in docs]


OWN = {"torch": {"torch"}, "jax": {"jax", "jaxlib", "flax", "optax"}}


def test_only_a_framework_package_imports_its_framework():
    """torch is imported in torch/ only, jax/flax/optax in jax/ only; nothing else imports
    any framework (the neutral code reaches them through framework.py's registry)."""
    bad = []
    for name in MODULES:
        allowed = OWN.get(_subpackage(name), set())
        bad += [f"{name}: imports {mod}" for mod, _, _ in _imports(name)
                if mod.split(".")[0] in FRAMEWORK_PACKAGES - allowed]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("sub", NEUTRAL)
def test_neutral_core_never_names_a_framework_op_or_branches_on_a_framework(sub):
    bad = []
    for name in MODULES:
        if _subpackage(name) != sub:
            continue
        for s in _strings(ast.parse(MODULES[name].read_text())):
            text = s.value
            if "aten." in text or "jax:" in text or text.strip().lower() in FRAMEWORK_PACKAGES:
                bad.append(f"{name}:{s.lineno}: {text[:60]!r}")
    assert not bad, "\n".join(bad)


def test_the_check_sees_a_circle_and_a_framework_name(tmp_path, monkeypatch):
    """The checks above can fail: fake circles (one through importlib), a branch on "torch",
    a private import across subpackages and a framework import in ir/ are all found."""
    pkg = tmp_path / "diphoma_compile"
    (pkg / "ir").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "ir" / "__init__.py").write_text("")
    (pkg / "ir" / "a.py").write_text("def f():\n    from .b import g\n")
    (pkg / "ir" / "b.py").write_text("from .a import f\nif 'torch' == 'x':\n    pass\n")
    (pkg / "ir" / "c.py").write_text("import importlib\n"
                                     "importlib.import_module('diphoma_compile.ir.d')\n")
    (pkg / "ir" / "d.py").write_text("def g():\n    import diphoma_compile.ir.c\n"
                                     "    from ..report import _secret\n    import jax\n")
    (pkg / "report").mkdir()
    (pkg / "report" / "__init__.py").write_text("_secret = 1\n")
    here = sys.modules[__name__]
    monkeypatch.setattr(here, "PKG", pkg)
    monkeypatch.setattr(here, "MODULES", _modules())
    with pytest.raises(AssertionError, match="import circles"):
        test_no_import_circles()
    with pytest.raises(AssertionError, match="'torch'"):
        test_neutral_core_never_names_a_framework_op_or_branches_on_a_framework("ir")
    with pytest.raises(AssertionError, match="ir.c -> diphoma_compile.ir.d"):
        test_no_import_circles()
    with pytest.raises(AssertionError, match="imports diphoma_compile.report._secret"):
        test_no_private_name_crosses_a_subpackage()
    with pytest.raises(AssertionError, match="ir.d: imports jax"):
        test_only_a_framework_package_imports_its_framework()
