"""Runs a function on N gloo ranks (processes on this machine) and returns what each rank
returned. A launch costs seconds here, so the distributed tests launch once per session and
run every check in that one launch (the session fixture in conftest.py), then assert on the
results.

Where a launch's own time went on this 2-core machine: four fresh (spawned) interpreters
importing torch and diphoma_compile at once took about 11 s before any check ran (20-30 s
while other jobs shared the cores), and four interpreters tearing torch down about 4 s
more. So the ranks are forked from a fork server that has imported the checks' module
(torch included) once, and a rank leaves with os._exit once its result is on disk."""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

TESTS = str(Path(__file__).resolve().parents[1] / "torch")
if TESTS not in sys.path:        # the workers import tests/torch/models.py
    sys.path.insert(0, TESTS)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable, rank: int, world: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    path = Path(out) / f"rank{rank}.pt"
    code = 0
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        result = fn(rank, world)
        torch.save({"ok": result}, path)
    except BaseException:   # noqa: B036 (report anything, then exit nonzero)
        torch.save({"error": traceback.format_exc()}, path)
        code = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        # the result is on disk: skip the interpreter's slow teardown of torch
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _fork_server(module: str):
    """A fork server that has imported ``module`` (started by the first launch; a later
    launch of another module imports that one in each rank)."""
    import multiprocessing.forkserver as forkserver

    import torch.multiprocessing as mp
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([module])
    # Python 3.11's fork server ignores the parent's sys.path (so a module found through
    # pytest's rootdir would silently not be preloaded): hand it over as PYTHONPATH
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    return ctx


def launch(fn: Callable[[int, int], Any], world: int = 4, timeout: float = 300.0) -> list[Any]:
    """``fn(rank, world)`` on ``world`` gloo ranks (process group initialized, one thread
    each); the list of their return values (plain data and tensors), by rank."""
    import torch
    ctx = _fork_server(fn.__module__)
    with tempfile.TemporaryDirectory() as out:
        port = _free_port()
        procs = [ctx.Process(target=_entry, args=(fn, r, world, port, out), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout      # for all ranks together
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results, errors = [], []
        for r in range(world):
            f = Path(out) / f"rank{r}.pt"
            got = torch.load(f, weights_only=False) if f.exists() else \
                {"error": f"rank {r} left no result (exit code {procs[r].exitcode})"}
            if "error" in got:
                errors.append(f"--- rank {r}:\n{got['error']}")
            results.append(got.get("ok"))
        if hung:
            errors.insert(0, f"ranks {hung} did not finish within {timeout:.0f} s")
        if errors:
            raise RuntimeError("distributed run failed\n" + "\n".join(errors))
        return results

