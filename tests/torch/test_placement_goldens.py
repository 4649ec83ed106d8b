"""Placement passes on traced PyTorch steps, as golden IR. shard-params: parameters held as
their update's pieces, gathered where read. tensor-parallel: a Megatron MLP, and an
attention whose query, key and value come from one fused projection (its weight split in
three groups of rows, ``S(0,3)``: each device its heads of all three; the heads merged with
the batch for the matmuls split in two groups, ``S(0,2)``), both at tp=2. Hugging Face
GPT-2 runs such a plan on 4 ranks against one device in tests/distributed."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402

import diphoma_compile  # noqa: E402
from diphoma_compile.ir import verify  # noqa: E402
from diphoma_compile.ir.types import Shard  # noqa: E402
from diphoma_compile.mesh import Mesh  # noqa: E402
from diphoma_compile.passes import PassContext, Pipeline, TensorParallelRecord  # noqa: E402
from test_propagation_torch import step  # noqa: E402


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class FusedAttention(nn.Module):
    """GPT-2's attention shape: one projection computes [q | k | v], then heads."""

    def __init__(self, d: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.d, self.heads = d, heads
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2)
                   for t in self.qkv(x).split(d, dim=2))
        a = torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
        return self.o(a.transpose(1, 2).reshape(b, s, d))


def _placed(model, x):
    torch.manual_seed(0)
    graph = diphoma_compile.trace(step, model, torch.optim.SGD(model.parameters(), lr=0.1), x)
    ctx = PassContext()
    placed = Pipeline.from_spec("tensor-parallel{axis=tp}").run(
        graph.replace(mesh=Mesh({"tp": 2})), ctx)
    verify(placed)
    return placed, ctx.decision(TensorParallelRecord)


def test_megatron_mlp_golden(golden):
    torch.manual_seed(0)
    placed, rec = _placed(MLP(), torch.randn(4, 8))
    assert dict(rec.splits) == {"fc1.weight": "S(0)", "fc1.bias": "S(0)", "fc2.weight": "S(1)"}
    golden("torch_mlp_sgd.tp.ir", str(placed))


class ThreeLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def centralised_step(model, opt, x):
    """Gradient centralisation (each weight's gradient less its rows' mean), AdamW."""
    opt.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    for p in model.parameters():
        if p.grad.dim() > 1:
            p.grad.sub_(p.grad.mean(1, keepdim=True))
    opt.step()
    return loss


_PLAN = """import sys
import diphoma_compile.torch.op_rules
from diphoma_compile.ir import parse
from diphoma_compile.ir.printer import program_digest
from diphoma_compile.mesh import Mesh
from diphoma_compile.passes import PassContext, Pipeline
g = parse(open(sys.argv[1]).read()).replace(mesh=Mesh({"tp": 2}))
print(program_digest(Pipeline.from_spec("tensor-parallel{axis=tp}").run(g, PassContext())))
"""


def test_tensor_parallel_plan_is_the_same_in_every_process(tmp_path):
    """Each torchrun process plans the step by itself: the solver's program was built
    from a set of names, in an order PYTHONHASHSEED changes, and its ties broke per
    process (dp=2 x tp=2 with gradient centralisation hung, or trained 7e-3 off, by the
    seeds; a review's probe, 2026-12-07). Two seeds that planned differently then."""
    import os
    import subprocess
    import sys
    torch.manual_seed(0)
    model = ThreeLayers()
    graph = diphoma_compile.trace(centralised_step, model,
                                  torch.optim.AdamW(model.parameters(), lr=0.1),
                                  torch.randn(8, 8))
    (tmp_path / "step.ir").write_text(str(graph))
    (tmp_path / "plan.py").write_text(_PLAN)
    digests = set()
    for seed in ("0", "2"):
        done = subprocess.run([sys.executable, str(tmp_path / "plan.py"),
                               str(tmp_path / "step.ir")], capture_output=True, text=True,
                              env={**os.environ, "PYTHONHASHSEED": seed}, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        digests.add(done.stdout.strip())
    assert len(digests) == 1, digests


def test_the_program_digest_ignores_source_lines_and_device_indices():
    """The digest every rank compares: a step that makes a tensor on ``x.device``
    (``torch.arange(t, device=idx.device)``, in GPT-2 and nanoGPT) names rank r's GPU,
    cuda:r, in its text, and the ranks' digests all differed (a review's probe,
    2026-12-07); so do source locations where the ranks' files lie apart. Another op
    still changes it."""
    from diphoma_compile.ir import parse
    from diphoma_compile.ir.printer import program_digest
    from models import GPT, lm_step
    torch.manual_seed(0)
    model = GPT(vocab=16, d=8, layers=1, heads=2, block=4)
    seq = torch.randint(0, 16, (2, 5))
    text = str(diphoma_compile.trace(lm_step, model, torch.optim.SGD(model.parameters(),
                                                                     lr=0.1),
                                     {"idx": seq[:, :-1], "targets": seq[:, 1:]}))
    assert '"device:cpu"' in text and " loc=" in text
    on = [parse(text.replace('"device:cpu"', f'"device:cuda:{r}"').replace(
        " loc=\"", f" loc=\"/rank{r}/")) for r in range(2)]
    assert str(on[0]) != str(on[1])
    assert program_digest(on[0]) == program_digest(on[1])
    assert program_digest(on[0]) != program_digest(parse(text.replace(
        '"device:cpu"', '"device:meta"')))


def test_fused_attention_splits_in_groups_golden(golden):
    torch.manual_seed(0)
    placed, rec = _placed(FusedAttention(), torch.randn(2, 4, 8))
    assert dict(rec.splits) == {"qkv.weight": "S(0,3)", "qkv.bias": "S(0,3)",
                                "o.weight": "S(1)"}
    weight = next(i for i in placed.inputs if i.name == "qkv.weight").value.type
    assert weight.placement("tp") == Shard(0, 3)
    text = str(placed)
    assert "{tp: S(0,3)}" in text
    golden("torch_fused_attention_sgd.tp.ir", text)


def _data_parallel(spec: str, opt=torch.optim.AdamW):
    """The MLP's step at dp=2 after ``dce,data-parallel{axis=dp},`` + spec, verified, and
    the shard-params record it left (None if none)."""
    torch.manual_seed(0)
    model = MLP()
    graph = diphoma_compile.trace(step, model, opt(model.parameters(), lr=0.1),
                                  torch.randn(8, 8))
    ctx = PassContext()
    out = Pipeline.from_spec("dce,data-parallel{axis=dp}," + spec).run(
        graph.replace(mesh=Mesh({"dp": 2})), ctx)
    verify(out)
    return out, ctx.decisions.get("shard-params")


def test_shard_params_golden(golden):
    # parameters held as their update's flat pieces: gathered before their first forward
    # use, and again (with the forward's views of them made again) before backward
    out, rec = _data_parallel("weight-update-sharding{axis=dp},dce,shard-params{axis=dp},dce")
    assert set(rec.sharded) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    assert rec.gathers == {"forward": 4, "backward": 1}
    text = str(out)
    assert "%3.again" in text and "= all_gather(%fc2.weight)" in text
    golden("torch_mlp_adamw.shard-params.ir", text)


def test_shard_params_needs_a_sharded_update():
    with pytest.raises(diphoma_compile.DiphomaError, match="weight-update-sharding"):
        _data_parallel("shard-params{axis=dp}", torch.optim.SGD)


def test_gather_at_next_forward_golden(golden):
    # weight-update-sharding{gather=next-forward}: the new pieces are returned as they are;
    # each parameter is gathered once, before its first use, and kept through backward
    out, rec = _data_parallel("weight-update-sharding{axis=dp, gather=next-forward},dce")
    assert rec.backward == "keep" and rec.gathers == {"forward": 4}
    assert ".again" not in str(out)
    golden("torch_mlp_adamw.wus-next-forward.ir", str(out))
    with pytest.raises(diphoma_compile.DiphomaError, match="gather='later' is not one of"):
        _data_parallel("weight-update-sharding{axis=dp, gather=later}")
