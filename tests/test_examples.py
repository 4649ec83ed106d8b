"""The examples run end to end and report bit-exact parity (the README's main job)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent.parent / "examples"


@pytest.mark.parametrize("script, needs", [("torch_mlp.py", "torch"),
                                           ("jax_mlp.py", "flax")])
def test_example_runs_and_matches(script, needs):
    pytest.importorskip(needs)
    r = subprocess.run([sys.executable, str(EXAMPLES / script), "--steps", "4"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("bit-exact") == 4
    assert "bit for bit" in r.stdout
