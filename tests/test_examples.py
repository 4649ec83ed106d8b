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


def test_jax_gpt_example_with_tensor_parallelism_matches_one_device():
    """examples/jax_gpt_parallel.py --tp 2: a dp x tp mesh, each block's attention and MLP
    split over tp; every step's loss and parameters agree with the single-device step."""
    pytest.importorskip("flax")
    r = subprocess.run([sys.executable, str(EXAMPLES / "jax_gpt_parallel.py"), "--steps", "2",
                        "--devices", "4", "--tp", "2", "--batch", "8"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "mesh dp=2, tp=2" in r.stdout
    assert r.stdout.count(" ok") == 2 and "matches the single-device run" in r.stdout
