"""The IR examples in the docs parse, verify and are printed back as written."""

from __future__ import annotations

import re
from pathlib import Path

from diphoma_compile.ir import parse, print_graph, verify

DOC = Path(__file__).parent.parent / "docs" / "architecture.md"


def test_architecture_doc_ir_example_is_canonical():
    blocks = [b for b in re.findall(r"```\n(.*?)```", DOC.read_text(), re.S)
              if b.startswith("# diphoma-ir v1")]
    assert blocks, "docs/architecture.md lost its IR example"
    for block in blocks:
        assert print_graph(verify(parse(block))) == block


def _layout_tree(text: str) -> set[str]:
    """The module paths the layout block under ``heading`` names (``ir/core.py``)."""
    found: set[str] = set()
    stack: list[tuple[int, str]] = []
    for line in text.splitlines():
        if not line.strip() or line.strip() == "diphoma_compile/":
            continue
        indent = len(line) - len(line.lstrip())
        words = line.split()
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if words[0].endswith("/"):
            stack.append((indent, words[0]))
            continue
        prefix = "".join(d for _, d in stack)
        for w in words:
            if w.endswith(".py"):
                found.add(prefix + w)
            else:
                break       # the rest of the line describes the module(s)
    return found


def test_architecture_layout_lists_every_module():
    """docs/architecture.md's layout tree names each module of the package, and no other."""
    text = DOC.read_text()
    block = re.search(r"## The layout.*?```\n(.*?)```", text, re.S).group(1)
    pkg = Path(__file__).parent.parent / "diphoma_compile"
    actual = {str(f.relative_to(pkg)) for f in pkg.rglob("*.py")
              if not (f.name == "__init__.py" and f.parent != pkg)}
    listed = _layout_tree(block)
    assert listed == actual, (f"not in the doc: {sorted(actual - listed)}; "
                              f"not in the package: {sorted(listed - actual)}")


def test_readme_layout_lists_every_module():
    """README.md's short layout names each module of the package, under its folder."""
    text = (Path(__file__).parent.parent / "README.md").read_text()
    block = re.search(r"## Layout.*?```\n(.*?)```", text, re.S).group(1)
    named, folder = set(), ""
    for line in block.splitlines()[1:]:
        if not line.startswith("   "):          # a top-level line: a folder or top modules
            first = line.split()[0] if line.split() else ""
            folder = first if first.endswith("/") else ""
        if folder == "tests/":
            break
        named.update(folder + m for m in re.findall(r"[A-Za-z_]+\.py", line))
    pkg = Path(__file__).parent.parent / "diphoma_compile"
    actual = {str(f.relative_to(pkg)) for f in pkg.rglob("*.py")
              if not (f.name == "__init__.py" and f.parent != pkg)}
    assert named == actual, (f"README's layout does not name {sorted(actual - named)}; "
                             f"names what is not there: {sorted(named - actual)}")
