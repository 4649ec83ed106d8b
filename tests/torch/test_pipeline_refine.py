"""The pipeline pass's backward placement (passes/pipeline_refine.py): the backward of a
later stage's forward op that reads only what that stage received runs on that stage, so
one gradient crosses each cut and no parameter is tied across stages by accident. On a
hand-written RMSNorm model (golden IR) and unmodified Hugging Face models."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import diphoma_compile  # noqa: E402
from diphoma_compile.ir import Phase, parse, print_graph  # noqa: E402
from diphoma_compile.mesh import Mesh  # noqa: E402
from diphoma_compile.passes import PassContext, Pipeline, PipelineRecord  # noqa: E402
from models import hf_lm_step  # noqa: E402


class RMSNorm(nn.Module):
    """Llama's norm, written out: its backward reads the normalized input x itself."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class RMSLM(nn.Module):
    """Embedding, residual blocks of norm + linear, a final norm, the tied LM head."""

    def __init__(self, vocab: int = 16, d: int = 8, layers: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.norms = nn.ModuleList(RMSNorm(d) for _ in range(layers))
        self.lins = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.norm = RMSNorm(d)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.tok(idx)
        for norm, lin in zip(self.norms, self.lins):
            h = h + lin(norm(h))
        return self.norm(h) @ self.tok.weight.T


def lm_step(model, opt, idx):
    loss = F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def staged(model, step, batch, pp: int, microbatches: int = 2):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = diphoma_compile.trace(step, model, opt, batch).replace(mesh=Mesh({"pp": pp}))
    ctx = PassContext()
    out = Pipeline.from_spec(f"dce,pipeline{{axis=pp, microbatches={microbatches}}}").run(
        g, ctx)
    return out, ctx.decision(PipelineRecord)


def backward_sends(graph):
    """(source stage, shape) of each send in the backward."""
    types = graph.value_types()
    return sorted((op.stage, types[op.inputs[0]].shape) for op in graph.ops
                  if op.name == "send" and op.phase is Phase.backward)


def test_golden_rmsnorm_backward_runs_on_the_stage_that_received_its_input(golden):
    """Block 1's norm is on stage 1 and reads the activation stage 0 sent; its backward
    reads that activation alone (no value made on stage 1), and runs on stage 1 with it:
    one activation gradient crosses back, beside the tied embedding's, and no norm weight
    is held on two stages."""
    torch.manual_seed(0)
    idx = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(3))
    out, rec = staged(RMSLM(), lm_step, idx, pp=2)
    text = print_graph(out)
    assert parse(text) == out
    golden("torch_rmslm_sgd.pp2.ir", text)
    assert rec.tied == {"tok.weight": (0, 1)}
    assert backward_sends(out) == [(1, (2, 4, 8)), (1, (16, 8))]


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


def test_a_hugging_face_qwen2_ties_no_norm_weight_and_sends_one_gradient_per_cut(
        transformers):
    """Qwen2 (untied head): before, two RMSNorm weights were held on two stages each and
    seven gradients crossed back over the three cuts of pp=4; now one per cut, no ties."""
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(num_hidden_layers=4, hidden_size=32, intermediate_size=64,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=64, max_position_embeddings=16)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    out, rec = staged(transformers.Qwen2ForCausalLM(cfg), hf_lm_step, ids, pp=4)
    assert rec.tied == {}
    assert backward_sends(out) == [(1, (4, 16, 32)), (2, (4, 16, 32)), (3, (4, 16, 32))]


def test_a_hugging_face_bert_computes_its_tied_decoder_gradient_on_the_last_stage(
        transformers):
    """BERT's MLM decoder (tied to the word embedding) is on the last stage and reads the
    hidden state the stage before sent it; its weight gradient now runs there, so the
    logits' gradient (rows x vocab) no longer crosses back, only the weight gradient to
    the embedding's stage."""
    torch.manual_seed(0)
    cfg = transformers.BertConfig(num_hidden_layers=4, hidden_size=32, intermediate_size=64,
                                  num_attention_heads=4, vocab_size=64,
                                  max_position_embeddings=16)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    out, rec = staged(transformers.BertForMaskedLM(cfg), hf_lm_step, ids, pp=4)
    assert rec.tied == {"bert.embeddings.word_embeddings.weight": (0, 3)}
    sends = backward_sends(out)
    assert (3, (64, 32)) in sends and len(sends) == 4, sends
    assert all(64 not in shape[-1:] or shape == (64, 32) for _, shape in sends), sends


def forward_sends(graph):
    """(source stage, shape) of each send in the forward."""
    types = graph.value_types()
    return sorted((op.stage, types[op.inputs[0]].shape) for op in graph.ops
                  if op.name == "send" and op.phase is Phase.forward)


def test_a_hugging_face_llama_is_cut_before_a_norm_not_after_its_rsqrt(transformers):
    """Balancing flops alone cut Llama's blocks just after an RMSNorm's rsqrt, so the
    [b, s, 1] statistic crossed beside the residual stream; the cut now moves to the
    nearby point (within 1% of a stage's flops) where fewer bytes cross. Only the residual
    stream crosses forward: the rotary cos/sin every layer reads are made from a read-only
    buffer (inv_freq) and positions, so each stage computes them itself."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=128,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=1000, tie_word_embeddings=True)
    ids = torch.randint(0, 1000, (8, 32), generator=torch.Generator().manual_seed(1))
    out, rec = staged(transformers.LlamaForCausalLM(cfg), hf_lm_step, ids, pp=4)
    sends = forward_sends(out)
    assert all(shape[-1] != 1 for _, shape in sends), sends
    assert sends == [(0, (8, 32, 64)), (1, (8, 32, 64)), (2, (8, 32, 64))], sends


def test_a_hugging_face_resnet_keeps_its_batch_statistics_on_one_stage(transformers):
    """An unmodified HF ResNet (BatchNorm after every convolution): with 2 microbatches the
    pass refuses it, naming the running statistics; with one, every buffer the step
    updates is read only on the stage that writes it (else that stage's copy goes stale)."""
    from diphoma_compile.errors import PassError
    from diphoma_compile.passes.pipeline_parallel import updated_buffers
    torch.manual_seed(0)
    cfg = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                    layer_type="basic", num_labels=4)
    model = transformers.ResNetForImageClassification(cfg)

    def step(model, opt, x, y):
        loss = F.cross_entropy(model(pixel_values=x).logits, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = diphoma_compile.trace(step, model, opt, torch.randn(4, 3, 16, 16),
                              torch.randint(0, 4, (4,))).replace(mesh=Mesh({"pp": 2}))
    with pytest.raises(PassError, match="normalizes over the batch "
                                        r"\(resnet.embedder.embedder.normalization.running_mean"):
        Pipeline.from_spec("dce,pipeline{axis=pp, microbatches=2, schedule=gpipe}").run(
            g, PassContext())
    out = Pipeline.from_spec("dce,pipeline{axis=pp, microbatches=1, schedule=gpipe}").run(
        g, PassContext())
    made = {v.name: op.stage for op in out.ops for v in op.results}
    updated = updated_buffers(out)
    assert len(updated) == 18, sorted(updated)
    assert {made[new] for new in updated.values()} == {0, 1}
    for buf, new in updated.items():
        assert {op.stage for op in out.ops if buf in op.inputs} == {made[new]}, buf
