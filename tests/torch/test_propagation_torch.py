"""Sharding propagation over a traced PyTorch training step: Megatron's splits fixed on
the weights of a transformer block complete, through the torch op rules (addmm, layer norm,
SDPA and their backwards), into exactly Megatron's communication."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import diphoma_compile  # noqa: E402
from diphoma_compile.ir import Phase, verify  # noqa: E402
from diphoma_compile.ir.propagate import apply_assignment, complete  # noqa: E402
from diphoma_compile.ir.types import REPLICATE, Partial, Shard  # noqa: E402
from diphoma_compile.mesh import Mesh  # noqa: E402
from diphoma_compile.torch.collectives import Comm, as_partial  # noqa: E402


class Block(nn.Module):
    """Pre-norm attention (SDPA, causal) and a gelu MLP, with biases everywhere."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, s, d = x.shape
        y = self.ln1(x)
        q, k, v = (m(y).view(b, s, self.heads, d // self.heads).transpose(1, 2)
                   for m in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def step(model, opt, x):
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


# Megatron: q, k, v and fc1 split by output features (rows of torch's weight), their
# biases with them; o and fc2 split by input features (columns)
MEGATRON = {**{f"{m}.weight": Shard(0) for m in ("q", "k", "v", "fc1")},
            **{f"{m}.bias": Shard(0) for m in ("q", "k", "v", "fc1")},
            "o.weight": Shard(1), "fc2.weight": Shard(1)}


@pytest.mark.parametrize("make_opt", [lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                                      lambda p: torch.optim.AdamW(p, lr=1e-3)],
                         ids=["sgd-momentum", "adamw"])
def test_megatron_block_gets_exactly_megatrons_collectives(make_opt):
    torch.manual_seed(0)
    model = Block()
    graph = diphoma_compile.trace(step, model, make_opt(model.parameters()),
                                  torch.randn(2, 8, 16))
    graph = graph.replace(mesh=Mesh({"tp": 2}))
    a = complete(graph, "tp", MEGATRON)

    def kinds(phase):
        return [r.collective for r in a.collectives(phase, graph)]
    assert kinds(Phase.forward) == ["all_reduce", "all_reduce"]
    assert kinds(Phase.backward) == ["all_reduce", "all_reduce"]
    assert len(a.collectives()) == 4
    assert all(r.src == Partial("sum") and r.dst == REPLICATE for r in a.collectives())
    # the row-parallel layers' biases are added once: kept on one device as a partial sum
    assert sorted(r.value for r in a.reshards if r.collective == "as_partial") == \
        ["fc2.bias", "o.bias"]
    placed = apply_assignment(graph, a)
    verify(placed)
    types = placed.value_types()
    for o in placed.outputs:
        if o.role.target in MEGATRON:
            assert types[o.name].placement("tp") == MEGATRON[o.role.target]
    # attention runs split by heads: SDPA takes q, k, v split on dim 1
    sdpa = next(op for op in placed.ops if "scaled_dot_product" in op.attrs.get("target", "")
                and op.phase is Phase.forward)
    assert [types[x].placement("tp") for x in sdpa.inputs[:3]] == [Shard(1)] * 3


def test_as_partial_keeps_the_value_on_rank_zero_only():
    x = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(as_partial(Comm("tp", 2, 0), x), x)
    assert torch.equal(as_partial(Comm("tp", 2, 1), x), torch.zeros_like(x))


def test_tensor_parallel_pass_finds_the_pairs_of_a_pytorch_block():
    from diphoma_compile.passes import PassContext, Pipeline, TensorParallelRecord
    from diphoma_compile.passes.megatron import LayerPair
    from diphoma_compile.passes.tensor_parallel import collectives_by_phase
    torch.manual_seed(0)
    model = Block()
    graph = diphoma_compile.trace(step, model, torch.optim.AdamW(model.parameters()),
                                  torch.randn(2, 8, 16))
    ctx = PassContext()
    placed = Pipeline.from_spec("tensor-parallel{axis=tp}").run(
        graph.replace(mesh=Mesh({"tp": 2})), ctx)
    verify(placed)
    rec = ctx.decision(TensorParallelRecord)
    assert rec.pairs == (LayerPair(("q.weight", "k.weight", "v.weight"), "o.weight"),
                         LayerPair(("fc1.weight",), "fc2.weight"))
    assert {p: s for p, s in rec.splits} == {**{k: str(v) for k, v in MEGATRON.items()}}
    assert collectives_by_phase(rec) == {"forward": ["all_reduce"] * 2,
                                         "backward": ["all_reduce"] * 2}


def test_torch_plans_tensor_parallelism_and_needs_a_process_group_to_run_it():
    """The plan is made for the torch runtime (which runs it: tests/distributed); run
    outside torch.distributed, it says how to launch the mesh's processes."""
    from diphoma_compile.errors import BackendError, DiphomaError
    torch.manual_seed(0)
    model = Block()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    par = diphoma_compile.parallelize(step, {"dp": 1, "tp": 2})
    par.trace(model, opt, torch.randn(2, 8, 16))
    assert "cannot run" not in par.plan.backend
    assert par.plan.backend.startswith("torch.distributed per-rank program")
    assert "tensor parallel over tp=2: 2 layer pair(s)" in par.plan.to_text()
    with pytest.raises(DiphomaError, match="has not run yet"):
        par.state_dict()
    with pytest.raises(BackendError, match="not initialized") as e:
        par(model, opt, torch.randn(2, 8, 16))
    assert "torchrun --nproc_per_node=2" in str(e.value)
    # nothing was split: the module keeps its whole parameters
    assert tuple(model.q.weight.shape) == (16, 16)
