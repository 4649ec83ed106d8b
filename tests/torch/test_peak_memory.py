"""The plan's peak (liveness over the program, ``analysis.peak_memory``) against the peak a
process reaches running the compiled step on CPU: the resident set's high-water mark above
what it held before the step, measured in a fresh process whose allocator returns freed
tensors to the system (``MALLOC_MMAP_THRESHOLD_``, as in benchmarks/dp_vs_ddp_fsdp.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, os, re, sys
import torch
import diphoma_compile
from diphoma_compile.ir.analysis import peak_memory
torch.set_num_threads(1)
torch.manual_seed(0)

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

def high_water():
    text = open("/proc/self/status").read()
    return int(re.search(r"VmHWM:\s+(\d+) kB", text).group(1)) * 1024

model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(),
                            torch.nn.Linear(2048, 2048), torch.nn.GELU(),
                            torch.nn.Linear(2048, 10))
batch = (torch.randn(256, 512), torch.randint(0, 10, (256,)))

def step(model, opt, batch):
    x, y = batch
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss

opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
compiled = diphoma_compile.compile(step, model, opt, batch)
compiled(model, opt, batch)
compiled(model, opt, batch)          # state exists, allocator warm
before = rss()
open("/proc/self/clear_refs", "w").write("5")    # the high-water mark restarts here
compiled(model, opt, batch)
from diphoma_compile.torch.build import updates_in_place, written_by_kernels
peak = peak_memory(compiled.graph, set(updates_in_place(compiled.graph)),
                   written=written_by_kernels(compiled.graph))
print(json.dumps({"measured": high_water() - before,
                  "planned": peak.bytes - peak.inputs_bytes}))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_planned_peak_is_within_15_percent_of_the_measured_one():
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    if done.returncode != 0 and "clear_refs" in done.stderr:
        pytest.skip("this kernel does not let a process reset its high-water mark")
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    # about 33 MB of activations and gradients above what the step holds (84 MB while
    # AdamW's new state was made beside the old and copied in: now its kernels write it
    # in place, as eager's do)
    assert got["measured"] > 25e6
    assert abs(got["planned"] - got["measured"]) <= 0.15 * got["measured"], got


# ------------------------------------------------------- the live-tensor counter (in-process)

def test_the_counter_sees_what_is_made_and_freed():
    from diphoma_compile.torch.live_memory import measure_peak
    held = torch.zeros(1000)                      # 4,000 bytes held before

    def run():
        a = torch.ones(2000)                      # 8,000
        b = torch.ones(3000)                      # 12,000: 20,000 alive with a
        del a, b
        c = torch.ones(4000)                      # 16,000 alone: below the peak
        return c.sum()

    got = measure_peak(run, [held, held[:10]])    # a view of a held tensor counts once
    assert got.held == 4000
    assert got.transient == 20000
    assert got.peak_op == "ones"
    assert got.by_op == {"held": 4000, "ones": 20000}


def test_a_compiled_step_reaches_the_planned_peak():
    """The running program frees each value where the plan's liveness says it dies: the
    measured tensor peak of a compiled AdamW step equals the planned one."""
    import diphoma_compile
    from diphoma_compile.ir.analysis import peak_memory
    from diphoma_compile.torch.build import updates_in_place, written_by_kernels
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 10))
    batch = (torch.randn(128, 64), torch.randint(0, 10, (128,)))

    def step(model, opt, batch):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = diphoma_compile.compile(step, model, opt, batch)
    compiled(model, opt, batch)
    got = compiled.measure_memory(model, opt, batch)
    peak = peak_memory(compiled.graph, set(updates_in_place(compiled.graph)),
                       written=written_by_kernels(compiled.graph))
    # the step's inputs: the counter misses only 0-d hyperparameters made per call
    assert 0 <= peak.inputs_bytes - got.held <= 64, (got, peak)
    assert abs(got.peak - peak.bytes) <= 0.02 * peak.bytes, (got, peak)
