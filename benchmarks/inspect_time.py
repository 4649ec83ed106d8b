"""Wall time and peak memory of `diphoma inspect` planning a GPT-2-small-sized model
(124M parameters, AdamW) for dp=64, next to the bytes its parameters alone would take.

    python benchmarks/inspect_time.py [--runs 5] [--mesh dp=64] [--layers 12]

Each run is a fresh `python -m diphoma_compile inspect` process, as a user would start it;
its wall time includes starting Python and importing torch. Prints every run, the median,
the stages `--timings` reports for the median run, and the ratio of the process's peak
resident memory to the parameters' bytes (below 1: the parameters were never allocated).
No asserts: the machine is noisy; read the numbers. The target (issue 6) is under 15 s."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "tests" / "inspect_models" / "gpt" / "model.py"


def run_once(cmd: list[str]) -> tuple[float, float, str]:
    """(wall seconds, this child's peak RSS in bytes, its stderr)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        sys.exit(f"inspect failed ({done.returncode}):\n{done.stderr}")
    peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    # ru_maxrss of children is the largest of any child so far: a run that peaks below an
    # earlier one reports the earlier peak, so the figure printed is an upper bound
    return wall, max(peak_kb, before) * 1024, done.stderr


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--mesh", default="dp=64")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--batch", type=int, default=512, help="global batch")
    p.add_argument("--seq", type=int, default=128)
    a = p.parse_args()
    init = f"GPT(GPTConfig(vocab_size=50257, n_layer={a.layers}))"
    tokens = f"int64[{a.batch},{a.seq}]<50257"
    report = Path(tempfile.mkdtemp()) / "plan.json"
    cmd = [sys.executable, "-m", "diphoma_compile", "inspect", str(MODEL), "--init", init,
           "--input", tokens, "--input", tokens, "--mesh", a.mesh, "--timings",
           "--format", "json", "--out", str(report)]
    print("command:", " ".join(cmd[1:]))
    print(f"machine: {os.cpu_count()} CPUs")
    runs = []
    for i in range(a.runs):
        wall, peak, err = run_once(cmd)
        runs.append((wall, peak, err))
        print(f"run {i + 1}: {wall:6.2f} s wall")
    walls = sorted(w for w, _, _ in runs)
    median = statistics.median(walls)
    _, peak, err = min(runs, key=lambda r: abs(r[0] - median))
    n_params = json.loads(report.read_text())["param_count"]
    print(f"wall: median {median:.2f} s, min {walls[0]:.2f} s, max {walls[-1]:.2f} s "
          f"over {a.runs} runs (target: under 15 s)")
    print("stages of the median run:")
    for line in err.splitlines():
        if line.startswith("#"):
            print("  " + line)
    print(f"peak memory of the process: {peak / 1e6:.0f} MB; the model's {n_params / 1e6:.1f}M "
          f"parameters in float32: {n_params * 4 / 1e6:.0f} MB; ratio "
          f"{peak / (n_params * 4):.2f}")


if __name__ == "__main__":
    main()
