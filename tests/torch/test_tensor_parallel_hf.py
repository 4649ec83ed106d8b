"""The tensor-parallel pass on Hugging Face models as people bring them: Llama (RoPE, gated
MLP) and OPT (separate q/k/v projections, a key/value cache concatenated to an empty one)
get Megatron's pairs in every layer and exactly Megatron's all-reduces; so does GPT-2,
whose fused query/key/value projection splits in three groups of columns."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import diphoma_compile  # noqa: E402
from diphoma_compile.ir import verify  # noqa: E402
from diphoma_compile.mesh import Mesh  # noqa: E402
from diphoma_compile.passes import PassContext, Pipeline, TensorParallelRecord  # noqa: E402
from diphoma_compile.passes.tensor_parallel import collectives_by_phase  # noqa: E402
from models import hf_lm_step  # noqa: E402

LAYERS = 2


def _plan(model, tp: int = 4):
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 16))
    graph = diphoma_compile.trace(hf_lm_step, model, torch.optim.AdamW(model.parameters()), ids)
    ctx = PassContext()
    placed = Pipeline.from_spec("tensor-parallel{axis=tp}").run(
        graph.replace(mesh=Mesh({"tp": tp})), ctx)
    verify(placed)
    rec = ctx.decision(TensorParallelRecord)
    params = {i.name: i.value.type.numel for i in graph.inputs if i.role.kind.value == "param"}
    split = dict(rec.splits)
    held = sum(n / tp if k in split else n for k, n in params.items()) / sum(params.values())
    return rec, held


def _layers(prefix: str, attn: tuple[str, ...], out: str, mlp: tuple[str, ...], down: str):
    pairs = []
    for i in range(LAYERS):
        p = f"{prefix}.{i}."
        pairs.append(((tuple(p + a + ".weight" for a in attn)), p + out + ".weight"))
        pairs.append(((tuple(p + m + ".weight" for m in mlp)), p + down + ".weight"))
    return pairs


@pytest.mark.parametrize("name", ["llama", "opt"])
def test_attention_and_mlp_of_every_layer_are_split(name):
    if name == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_hidden_layers=LAYERS, hidden_size=64, intermediate_size=128,
            num_attention_heads=4, num_key_value_heads=4, vocab_size=64))
        want = _layers("model.layers", ("self_attn.q_proj", "self_attn.k_proj",
                                        "self_attn.v_proj"), "self_attn.o_proj",
                       ("mlp.gate_proj", "mlp.up_proj"), "mlp.down_proj")
    else:
        model = transformers.OPTForCausalLM(transformers.OPTConfig(
            vocab_size=64, hidden_size=64, num_hidden_layers=LAYERS, ffn_dim=256,
            num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=64,
            dropout=0.0, attention_dropout=0.0))
        want = _layers("model.decoder.layers", ("self_attn.q_proj", "self_attn.k_proj",
                                                "self_attn.v_proj"), "self_attn.out_proj",
                       ("fc1",), "fc2")
    rec, held = _plan(model)
    assert [(p.column, p.row) for p in rec.pairs] == want
    four = ["all_reduce"] * (2 * LAYERS)
    assert collectives_by_phase(rec) == {"forward": four, "backward": four}
    assert held <= 0.40, held


def test_gpt2s_fused_projection_splits_by_heads_in_groups():
    # GPT-2's c_attn computes [q | k | v] in one matmul; each device takes its heads of all
    # three (the columns split in 3 groups, S(1,3)), so attention is a Megatron pair too
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=LAYERS, n_embd=64, n_head=4, vocab_size=64, n_positions=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    rec, held = _plan(model)
    want = []
    for i in range(LAYERS):
        p = f"transformer.h.{i}."
        want += [((p + "attn.c_attn.weight",), p + "attn.c_proj.weight"),
                 ((p + "mlp.c_fc.weight",), p + "mlp.c_proj.weight")]
    assert [(p.column, p.row) for p in rec.pairs] == want
    splits = dict(rec.splits)
    assert splits["transformer.h.0.attn.c_attn.weight"] == "S(1,3)"
    assert splits["transformer.h.0.attn.c_attn.bias"] == "S(0,3)"
    four = ["all_reduce"] * (2 * LAYERS)
    assert collectives_by_phase(rec) == {"forward": four, "backward": four}
    assert held <= 0.40, held
