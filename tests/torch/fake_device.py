"""Run as a script by test_devices.py: steps traced with parameters on an accelerator this
machine does not have. A CPU-only torch aborts the process when autograd meets a fake CUDA
tensor (it has no CUDA device guard), so the accelerator is torch's Python-defined
PrivateUse1 device, renamed ``fakegpu``: a device other than the CPU, as CUDA is, whose
tensors are FakeTensors (shapes, dtypes and devices, no memory). That is irreversible for
the process, hence a subprocess. Prints one JSON object: case -> "ok" or the error."""

from __future__ import annotations

import json
import sys

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

import diphoma_compile
from diphoma_compile.errors import DiphomaError

MODE = FakeTensorMode()
DEVICE: torch.device = torch.device("cpu")   # fakegpu:0 once registered (in main only)


def fake(t: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """A fake tensor shaped like ``t`` on ``device``."""
    meta = torch.empty_like(t, device="meta")
    return MODE.fake_tensor_converter.from_meta_and_device(MODE, meta, device or DEVICE)


def model_on(device: torch.device, second: torch.device | None = None) -> torch.nn.Module:
    """A two-layer MLP whose parameters are fake tensors on ``device`` (the second layer's
    on ``second`` when given: a model split over two devices)."""
    with torch.device("meta"):
        m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    for i, layer in enumerate((m[0], m[2])):
        where = second if (i == 1 and second is not None) else device
        for n, p in list(layer._parameters.items()):
            layer._parameters[n] = torch.nn.Parameter(fake(p, where))
    return m


OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam_foreach": lambda ps: torch.optim.Adam(ps, lr=0.1, foreach=True),
    "adam_single": lambda ps: torch.optim.Adam(ps, lr=0.1, foreach=False),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=0.1, foreach=True),
    "adamw_single": lambda ps: torch.optim.AdamW(ps, lr=0.1, foreach=False),
    # traced in its capturable form, the step count widened to float64
    "radam": lambda ps: torch.optim.RAdam(ps, lr=0.1),
}


def step(model, opt, x):
    # a constant with a shape: the program must make it on the parameters' device
    loss = (model(x) * torch.ones(2, device=x.device)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def run(case: str) -> str:
    try:
        if case in OPTIMIZERS:
            m = model_on(DEVICE)
            opt = OPTIMIZERS[case](m.parameters())
            x = fake(torch.empty(3, 4))
            g = diphoma_compile.trace(step, m, opt, x)
            if not g.ops:
                return "empty graph"
            compiled = diphoma_compile.compile(step, m, opt, x)
            if case == "sgd_momentum":
                # runs on fake tensors: every op of the program meets tensors of one device
                with MODE:
                    loss = compiled(m, opt, x)
                if loss.device != DEVICE:
                    return f"loss on {loss.device}"
                bufs = [opt.state[p]["momentum_buffer"].device for p in m.parameters()]
                if any(d != DEVICE for d in bufs):
                    return f"momentum buffers on {bufs}"
            return "ok"
        if case == "split_model":
            m = model_on(DEVICE, torch.device("cpu"))
            x = fake(torch.empty(3, 4))
        else:                       # batch_on_cpu
            m = model_on(DEVICE)
            x = torch.randn(3, 4)
        diphoma_compile.trace(step, m, torch.optim.SGD(m.parameters(), lr=0.1), x)
        return "no error"
    except DiphomaError as e:
        return f"DiphomaError: {e} | hint: {e.hint}"
    except Exception as e:   # noqa: BLE001 - reported to the test
        return f"{type(e).__name__}: {str(e)[:400]}"


if __name__ == "__main__":
    _setup_privateuseone_for_python_backend("fakegpu")
    DEVICE = torch.device("fakegpu:0")
    print(json.dumps({c: run(c) for c in sys.argv[1:]}))
