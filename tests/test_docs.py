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
