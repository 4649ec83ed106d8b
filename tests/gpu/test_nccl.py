"""parallelize() on two GPUs with NCCL, one process per GPU (as under torchrun), against the
single-device step on the global batch. Skipped without two CUDA devices;
``DIPHOMA_TEST_DEVICE=cpu`` runs it on the CPU with gloo (to check the test itself)."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

DEVICE = os.environ.get("DIPHOMA_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and (not torch.cuda.is_available() or torch.cuda.device_count() < 2),
    reason="needs two CUDA devices")
WORLD = 2
HERE = Path(__file__).resolve().parent


def _rank(rank: int, port: int, codegen: str, out: dict) -> None:
    import copy

    import torch.distributed as dist
    sys.path.insert(0, str(HERE.parent / "torch"))
    import diphoma_compile
    from models import MLP, OPTIMIZERS, classify_step, mlp_batches

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = DEVICE == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=WORLD)
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    try:
        torch.manual_seed(0)
        model = MLP().to(device)
        ref = copy.deepcopy(model)
        opt = OPTIMIZERS["sgd_momentum"](model.parameters(), True)
        ref_opt = OPTIMIZERS["sgd_momentum"](ref.parameters(), True)
        step = diphoma_compile.parallelize(classify_step, {"dp": WORLD}, codegen=codegen)
        losses, ref_losses = [], []
        for b in mlp_batches(3):
            b = {k: v.to(device) for k, v in b.items()}
            mine = {k: v.chunk(WORLD)[rank] for k, v in b.items()}
            losses.append(step(model, opt, mine).item())
            ref_losses.append(classify_step(ref, ref_opt, b).item())
        dev = max((p - q).abs().max().item() for p, q in zip(model.parameters(),
                                                              ref.parameters()))
        state = [opt.state[p]["momentum_buffer"].device.type for p in model.parameters()]
        out[rank] = {"losses": losses, "ref": ref_losses, "param_dev": dev, "state": state}
    finally:
        dist.destroy_process_group()


def _worker(rank: int, port: int, codegen: str, q) -> None:
    out: dict = {}
    try:
        _rank(rank, port, codegen, out)
        q.put((rank, out[rank]))
    except Exception as e:  # noqa: BLE001 - reported to the test
        q.put((rank, f"{type(e).__name__}: {e}"))


@pytest.mark.parametrize("codegen", ["fx", "inductor"])
def test_parallelize_two_ranks_matches_single_device(codegen):
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, codegen, q)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=600) for _ in range(WORLD))
    for p in procs:
        p.join(timeout=60)
    for r in range(WORLD):
        res = results[r]
        assert isinstance(res, dict), res
        for a, b in zip(res["losses"], res["ref"]):
            assert abs(a - b) <= 1e-5
        assert res["param_dev"] <= 1e-5
        assert set(res["state"]) == {"cuda" if DEVICE == "cuda" else "cpu"}
