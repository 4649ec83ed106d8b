"""lucidrains' x-transformers decoder traces without modification and stays bit-exact. Its
bias-free LayerNorm normalizes without affine and multiplies by its gain after, so
native_layer_norm_backward keeps one of its three results (the input's gradient): the
backend must index the tuple the call returns even then."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
x_transformers = pytest.importorskip("x_transformers")
import torch.nn.functional as F  # noqa: E402

import diphoma_compile  # noqa: E402


def lm_step(model, opt, batch):
    logits = model(batch["idx"])
    loss = F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def test_decoder_bit_exact_against_eager():
    torch.manual_seed(0)
    model = x_transformers.TransformerWrapper(
        num_tokens=32, max_seq_len=16,
        attn_layers=x_transformers.Decoder(dim=16, depth=1, heads=2))
    model.train()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    data = []
    for _ in range(2):
        seq = torch.randint(0, 32, (2, 9), generator=g)
        data.append({"idx": seq[:, :-1], "targets": seq[:, 1:]})
    graph = diphoma_compile.trace(lm_step, model, opt, data[0])
    kept = {(str(op.attrs["target"]), tuple(op.attrs["outs"])) for op in graph.ops
            if op.name == "opaque" and "outs" in op.attrs}
    assert ("aten.native_layer_norm_backward.default", (0,)) in kept, sorted(kept)
    compiled = diphoma_compile.compile(lm_step, model, opt, data[0])
    for i, batch in enumerate(data):
        loss = compiled(model, opt, batch)
        assert torch.equal(loss, lm_step(ref, ref_opt, batch)), f"loss differs at step {i}"
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p, q), f"step {i}: {name}"
            for key, v in ref_opt.state[q].items():
                assert torch.equal(opt.state[p][key], v), f"step {i}: {name}.{key}"
