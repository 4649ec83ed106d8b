"""The rules of the aten ops the torch frontend keeps opaque (torch/op_rules.py): every op of
small Hugging Face, CNN and x-transformers training steps has one; every split a rule lists
is exact (each device runs the aten op on its pieces, the pieces combined as the result
placements say equal the whole call); flops match hand counts and torch's flop counter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import diphoma_compile  # noqa: E402
from diphoma_compile.ir.analysis import graph_cost  # noqa: E402
from diphoma_compile.ir.core import Attrs, Op, Value  # noqa: E402
from diphoma_compile.ir.framework_ops import FRAMEWORK_OPS, framework_rule  # noqa: E402
from diphoma_compile.ir.opdef import op_def  # noqa: E402
from diphoma_compile.ir.strategies import candidates, strategies_of  # noqa: E402
from diphoma_compile.ir.types import REPLICATE, DType, Partial, Shard, TensorType  # noqa: E402
from diphoma_compile.torch.op_rules import with_local_arguments  # noqa: E402
from diphoma_compile.torch.ops import (decode_arg, encode_arg, ir_dtype,  # noqa: E402
                                       resolve_target)

from models import CNN, classify_step, cnn_batches  # noqa: E402

aten = torch.ops.aten
F64 = torch.float64
ROOT = Path(__file__).resolve().parents[2]
N = 2   # devices on the axis the strategies are checked over


# ------------------------------------------------------------------ census

def _hf_step(model, opt, batch):
    out = model(**batch)
    out.loss.backward()
    opt.step()
    opt.zero_grad()
    return out.loss


def _lm_step(model, opt, batch):
    logits = model(batch["idx"])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _hf(name):
    transformers = pytest.importorskip("transformers")
    ids = torch.randint(0, 64, (2, 8))
    text = {"input_ids": ids, "labels": ids}
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16)), text
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=64)), text
    if name == "bert":
        return transformers.BertForMaskedLM(transformers.BertConfig(
            num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2,
            vocab_size=64)), text
    if name == "t5":
        return transformers.T5ForConditionalGeneration(transformers.T5Config(
            num_layers=1, num_decoder_layers=1, d_model=16, d_ff=32, num_heads=2, d_kv=8,
            vocab_size=64, decoder_start_token_id=0)), text
    return transformers.ViTForImageClassification(transformers.ViTConfig(
        num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2,
        image_size=8, patch_size=4, num_labels=4)), {
            "pixel_values": torch.randn(2, 3, 8, 8), "labels": torch.randint(0, 4, (2,))}


def _traced(name):
    torch.manual_seed(0)
    if name == "cnn":
        model = CNN()
        return diphoma_compile.trace(classify_step, model,
                                     torch.optim.AdamW(model.parameters()), cnn_batches(1)[0])
    if name == "x-transformers":
        xt = pytest.importorskip("x_transformers")
        model = xt.TransformerWrapper(num_tokens=32, max_seq_len=16,
                                      attn_layers=xt.Decoder(dim=16, depth=1, heads=2))
        seq = torch.randint(0, 32, (2, 9))
        return diphoma_compile.trace(_lm_step, model, torch.optim.AdamW(model.parameters()),
                                     {"idx": seq[:, :-1], "targets": seq[:, 1:]})
    model, batch = _hf(name)
    model.train()
    return diphoma_compile.trace(_hf_step, model, torch.optim.AdamW(model.parameters()), batch)


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "t5", "vit", "cnn",
                                  "x-transformers"])
def test_every_opaque_op_of_a_training_step_has_a_rule(name):
    graph = _traced(name)
    types = graph.value_types()
    opaque = [op for op in graph.walk() if op.name == "opaque"]
    assert opaque
    missing = sorted({str(op.attrs["target"]) for op in opaque if framework_rule(op) is None})
    assert not missing, f"{name}: no rule for {missing}"
    assert graph_cost(graph)[0].unknown == ()
    for op in opaque:     # every menu is well formed on the real ops
        ins = [types[i] for i in op.inputs]
        outs = [v.type for v in op.results]
        menu = strategies_of(op, ins, outs)
        assert menu[0].inputs == (REPLICATE,) * len(ins)
        for s in menu:
            assert (len(s.inputs), len(s.outputs)) == (len(ins), len(outs)), (op, s)
        candidates(op, ins, outs, N)


def test_the_rules_are_registered_when_the_framework_is_looked_up():
    code = ("import diphoma_compile.framework as f\n"
            "from diphoma_compile.ir.framework_ops import FRAMEWORK_OPS\n"
            "assert 'aten.addmm.default' not in FRAMEWORK_OPS\n"
            "f.get('torch')\n"
            "assert 'aten.addmm.default' in FRAMEWORK_OPS\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# ------------------------------------------------------------------ ops from aten calls

def _ttype(t: torch.Tensor) -> TensorType:
    # the CUDA flash kernel's random state is uint64, which the frontend does not map
    dtype = DType.u64 if t.dtype == torch.uint64 else ir_dtype(t.dtype)
    return TensorType(tuple(t.shape), dtype)


def _results(out) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _call(target: str, args, kwargs):
    return REFERENCE.get(target, resolve_target(target))(*args, **kwargs)


def make_op(target: str, args, kwargs, call=None):
    """The opaque op the importer makes of this aten call (tensors numbered in order of
    first use), its operands, and the whole call's tensor results (of ``call``, default
    the aten op or its stand-in)."""
    tensors: list[torch.Tensor] = []

    def enc(v):
        if isinstance(v, torch.Tensor):
            for i, t in enumerate(tensors):
                if t is v:
                    return f"%{i}"
            tensors.append(v)
            return f"%{len(tensors) - 1}"
        if isinstance(v, (list, tuple)):
            return tuple(enc(x) for x in v)
        return encode_arg(v, None)
    attrs = {"target": target, "args": enc(tuple(args))}
    attrs.update({f"kw_{k}": enc(v) for k, v in kwargs.items()})
    whole = call(*args, **kwargs) if call else _call(target, args, kwargs)
    results = _results(whole)
    positions = [i for i, r in enumerate(results) if isinstance(r, torch.Tensor)]
    if isinstance(whole, (tuple, list)):
        attrs["outs"] = tuple(positions)
    op = Op("opaque", tuple(f"x{i}" for i in range(len(tensors))),
            tuple(Value(f"y{j}", _ttype(results[p])) for j, p in enumerate(positions)),
            Attrs(attrs))
    return op, tensors, [results[p] for p in positions]


# ------------------------------------------------------------------ running a strategy

def _piece(t: torch.Tensor, p, k: int, parts: list[torch.Tensor] | None) -> torch.Tensor:
    if isinstance(p, Shard):
        # a split of k groups: this device's piece of every group, in group order
        return torch.cat([g.chunk(N, p.dim)[k] for g in t.chunk(p.groups, p.dim)],
                         p.dim).contiguous()
    if isinstance(p, Partial):
        return parts[k]
    return t


def _partial_parts(t: torch.Tensor, g: torch.Generator) -> list[torch.Tensor]:
    """N random pieces that sum to t."""
    parts = [torch.randn(t.shape, generator=g, dtype=t.dtype) for _ in range(N - 1)]
    return parts + [t - sum(parts)]


def _local_shape(t: torch.Tensor, p) -> tuple[int, ...]:
    shape = list(t.shape)
    if isinstance(p, Shard):
        shape[p.dim] //= N
    return tuple(shape)


def _masked_embedding(args, kwargs, k):
    w, idx = args[0], args[1]
    off = k * w.shape[0]
    mine = (idx >= off) & (idx < off + w.shape[0])
    local = torch.where(mine, idx - off, torch.zeros_like(idx))
    return aten.embedding(w, local, *args[2:], **kwargs) * mine.unsqueeze(-1)


def _masked_embedding_backward(args, kwargs, k):
    g, idx, rows, pad, by_freq = args
    off = k * rows
    mine = (idx >= off) & (idx < off + rows)
    local = torch.where(mine, idx - off, torch.zeros_like(idx))
    pad = pad - off if off <= pad < off + rows else -1
    return aten.embedding_dense_backward(g * mine.unsqueeze(-1), local, rows, pad, by_freq)


MASKED = {"aten.embedding.default": _masked_embedding,
          "aten.embedding_dense_backward.default": _masked_embedding_backward}

UNDEFINED = {"aten.empty_like.default"}    # results whose values are not defined


def run_strategy(target, op, tensors, whole, s, g):
    """Run the op on each device's pieces as the strategy says; compare the combined pieces
    with the whole results."""
    parts = {i: _partial_parts(t, g) for i, (t, p) in enumerate(zip(tensors, s.inputs))
             if isinstance(p, Partial)}
    local_outs = [TensorType(_local_shape(w, p), ir_dtype(w.dtype))
                  for w, p in zip(whole, s.outputs)]
    devices = []
    for k in range(N):
        local = [_piece(t, p, k, parts.get(i)) for i, (t, p) in enumerate(zip(tensors, s.inputs))]
        args = decode_arg(op.attrs["args"], local)
        kwargs = {name[3:]: decode_arg(v, local) for name, v in op.attrs.items()
                  if name.startswith("kw_")}
        # the arguments that name a whole shape take the local one, as the backend does
        args, kwargs = with_local_arguments(op, args, kwargs, [_ttype(t) for t in local],
                                            local_outs)
        if s.masked:
            out = MASKED[target](args, kwargs, k)
        else:
            out = _call(target, args, kwargs)
        results = [r for r in _results(out) if isinstance(r, torch.Tensor)]
        devices.append(results)
    for j, (w, p) in enumerate(zip(whole, s.outputs)):
        pieces = [d[j] for d in devices]
        if isinstance(p, Shard):
            per_device = [x.chunk(p.groups, p.dim) for x in pieces]
            got = torch.cat([d[g] for g in range(p.groups) for d in per_device], p.dim)
        elif isinstance(p, Partial) and p.op in ("max", "min"):
            got = getattr(torch.stack(pieces), f"a{p.op}")(0)
        elif isinstance(p, Partial):
            got = sum(pieces)       # (an integer count's partial sums stay integers)
            got = got / N if p.op == "avg" else got
        else:
            for piece in pieces:
                _same(target, piece, w, f"{s}: result {j} on a device")
            continue
        _same(target, got, w, f"{s}: result {j}")


def _same(target, got, want, what):
    if target in UNDEFINED:
        assert (got.shape, got.dtype) == (want.shape, want.dtype), what
    else:
        torch.testing.assert_close(got, want, msg=lambda m: f"{what}: {m}")


# ------------------------------------------------------------------ samples

class _Rand:
    def __init__(self, seed: int) -> None:
        self.g = torch.Generator().manual_seed(seed)

    def __call__(self, *shape) -> torch.Tensor:
        return torch.randn(shape, generator=self.g, dtype=F64)

    def ints(self, high: int, *shape) -> torch.Tensor:
        return torch.randint(0, high, shape, generator=self.g)

    def bools(self, *shape) -> torch.Tensor:
        return torch.rand(shape, generator=self.g) < 0.5


def _attend(q, k, v, bias=None, causal=False, scale=None):
    """Attention in plain math (the CUDA kernels' stand-in): out and logsumexp."""
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    s = q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if bias is not None:
        s = s + bias
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v, s.logsumexp(-1)


def _attend_backward(g, q, k, v, bias, causal, scale):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    b = None if bias is None else bias.detach().requires_grad_()
    with torch.enable_grad():
        out, _ = _attend(*leaves, b, causal, scale)
        grads = torch.autograd.grad(out, leaves + ([b] if b is not None else []), g)
    return tuple(grads) + ((None,) if b is None else ())


def _ref_flash(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    out, lse = _attend(q, k, v, None, is_causal, scale)
    i64 = dict(dtype=torch.int64)
    return (out, lse, None, None, q.shape[2], k.shape[2], torch.zeros(2, **i64),
            torch.zeros((), **i64), torch.empty(0, dtype=q.dtype))


def _ref_flash_backward(g, q, k, v, out, lse, cq, ck, mq, mk, dropout_p, is_causal, seed,
                        offset, *, scale=None):
    return _attend_backward(g, q, k, v, None, is_causal, scale)


def _ref_efficient(q, k, v, bias, compute_lse, dropout_p=0.0, is_causal=False, *, scale=None):
    out, lse = _attend(q, k, v, bias, is_causal, scale)
    padded = -(-q.shape[2] // 32) * 32        # the kernel pads logsumexp's rows to 32
    lse = torch.nn.functional.pad(lse, (0, padded - q.shape[2]))
    return out, lse, torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)


def _ref_efficient_backward(g, q, k, v, bias, out, lse, seed, offset, dropout_p, mask,
                            is_causal=False, *, scale=None):
    dq, dk, dv, db = _attend_backward(g, q, k, v, bias, is_causal, scale)
    return dq, dk, dv, db if mask[3] else None


def _ref_cudnn(q, k, v, bias, compute_lse, dropout_p=0.0, is_causal=False,
               return_debug_mask=False, *, scale=None):
    out, lse = _attend(q, k, v, bias, is_causal, scale)
    i64 = dict(dtype=torch.int64)
    return (out, lse.unsqueeze(-1), None, None, q.shape[2], k.shape[2], torch.zeros((), **i64),
            torch.zeros((), **i64), None)


def _ref_cudnn_backward(g, q, k, v, out, lse, seed, offset, bias, cq, ck, mq, mk, dropout_p,
                        is_causal, *, scale=None):
    return _attend_backward(g, q, k, v, bias, is_causal, scale)[:3]


# CUDA kernels cannot run here: their stand-ins have the same arguments and results
REFERENCE = {
    "aten._scaled_dot_product_flash_attention.default": _ref_flash,
    "aten._scaled_dot_product_flash_attention_backward.default": _ref_flash_backward,
    "aten._scaled_dot_product_efficient_attention.default": _ref_efficient,
    "aten._scaled_dot_product_efficient_attention_backward.default": _ref_efficient_backward,
    "aten._scaled_dot_product_cudnn_attention.default": _ref_cudnn,
    "aten._scaled_dot_product_cudnn_attention_backward.default": _ref_cudnn_backward,
}


def _softmax_backward_sample(log: bool):
    def sample(r):
        x = r(2, 4, 6)
        y = aten._log_softmax(x, 1, False) if log else aten._softmax(x, 1, False)
        return [r(2, 4, 6), y, 1, F64], {}
    return sample


def _nll(reduction: int, weighted: bool, backward: bool, spatial: tuple[int, ...] = ()):
    """nll_loss (rows of 6 classes) or, with ``spatial`` dims, nll_loss2d over a map."""
    forward = aten.nll_loss2d_forward if spatial else aten.nll_loss_forward

    def sample(r):
        x = aten._log_softmax(r(4, 6, *spatial), 1, False)
        t = r.ints(6, 4, *spatial)
        t[1] = -100
        w = r(6).abs() if weighted else None
        out, total = forward(x, t, w, reduction, -100)
        if not backward:
            return [x, t, w, reduction, -100], {}
        return [r(*out.shape), x, t, w, reduction, -100, total], {}
    return sample


def _margin(reduction: int, weighted: bool, backward: bool):
    def sample(r):
        x, t, w = r(4, 6), r.ints(6, 4), (r(6).abs() if weighted else None)
        if not backward:
            return [x, t, 1, 1.0, w, reduction], {}
        g = r(4) if reduction == 0 else r()
        return [g, x, t, 1, 1.0, w, reduction], {}
    return sample


def _layer_norm_backward(mask, affine: bool):
    def sample(r):
        x = r(2, 4, 6)
        w, b = (r(6), r(6)) if affine else (None, None)
        _, mean, rstd = aten.native_layer_norm(x, [6], w, b, 1e-5)
        return [r(2, 4, 6), x, [6], mean, rstd, w, b, mask], {}
    return sample


def _batch_norm(training: bool):
    def sample(r):
        return [r(4, 6, 2, 2), r(6), r(6), r(6), r(6).abs(), training, 0.1, 1e-5], {}
    return sample


def _batch_norm_backward(training: bool, mask):
    def sample(r):
        x, w, rm, rv = r(4, 6, 2, 2), r(6), r(6), r(6).abs()
        _, sm, si, _, _ = aten._native_batch_norm_legit_functional(x, w, r(6), rm, rv,
                                                                    training, 0.1, 1e-5)
        return [r(4, 6, 2, 2), x, w, rm, rv, sm, si, training, 1e-5, mask], {}
    return sample


def _group_norm_backward(r):
    x, w = r(4, 6, 3), r(6)
    _, mean, rstd = aten.native_group_norm(x, w, r(6), 4, 6, 3, 2, 1e-5)
    return [r(4, 6, 3), x, mean, rstd, w, 4, 6, 3, 2, [True, True, True]], {}


def _conv(transposed=False, bias=True, groups=1):
    def sample(r):
        w = r(4, 6 // groups, 3, 3) if transposed else r(6, 4 // groups, 3, 3)
        return [r(2, 4, 6, 6), w, r(6) if bias else None, [1, 1], [1, 1], [1, 1], transposed,
                [0, 0], groups], {}
    return sample


def _conv_backward(transposed=False, mask=(True, True, True), groups=1):
    def sample(r):
        x = r(2, 4, 6, 6)
        w = r(4, 6 // groups, 3, 3) if transposed else r(6, 4 // groups, 3, 3)
        out = aten.convolution(x, w, None, [1, 1], [1, 1], [1, 1], transposed, [0, 0], groups)
        return [r(*out.shape), x, w, [6], [1, 1], [1, 1], [1, 1], transposed, [0, 0], groups,
                list(mask)], {}
    return sample


def _mse_backward(reduction: int):
    def sample(r):
        g = r(2, 4) if reduction == 0 else r()
        return [g, r(2, 4), r(2, 4), reduction], {}
    return sample


def _max_pool_backward(r):
    x = r(2, 4, 6, 6)
    out, idx = aten.max_pool2d_with_indices(x, [2, 2], [2, 2])
    return [r(*out.shape), x, [2, 2], [2, 2], [0, 0], [1, 1], False, idx], {}


def _sdpa(mask_shape=None, causal=False, kv_heads=4, **kw):
    def sample(r):
        q, k, v = r(2, 4, 6, 8), r(2, kv_heads, 6, 8), r(2, kv_heads, 6, 8)
        mask = {"attn_mask": r(*mask_shape)} if mask_shape else {}
        return [q, k, v, 0.0, causal], {**kw, **mask}
    return sample


def _sdpa_backward(mask_shape=None, causal=False, kv_heads=4):
    def sample(r):
        q, k, v = r(2, 4, 6, 8), r(2, kv_heads, 6, 8), r(2, kv_heads, 6, 8)
        kw = {"attn_mask": r(*mask_shape)} if mask_shape else {}
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, **kw)
        return [r(*out.shape), q, k, v, out, lse, 0.0, causal], kw
    return sample


def _cuda_forward(kind: str, causal=False, bias=True):
    def sample(r):
        q, k, v = r(2, 4, 6, 8), r(2, 4, 6, 8), r(2, 4, 6, 8)
        if kind == "flash":
            return [q, k, v, 0.0, causal], {"scale": 0.5}
        return [q, k, v, r(2, 4, 6, 6) if bias else None, True, 0.0, causal], {}
    return sample


def _cuda_backward(kind: str, causal=False):
    def sample(r):
        q, k, v, b, g = r(2, 4, 6, 8), r(2, 4, 6, 8), r(2, 4, 6, 8), r(2, 4, 6, 6), r(2, 4, 6, 8)
        out, lse = _attend(q, k, v, None if kind == "flash" else b, causal)
        e, z = torch.empty(0, dtype=F64), torch.zeros((), dtype=torch.int64)
        if kind == "flash":
            return [g, q, k, v, out, lse, e, e, 6, 6, 0.0, causal, z, z], {}
        if kind == "efficient":
            return [g, q, k, v, b, out, lse, z, z, 0.0, [True, True, True, True], causal], {}
        return [g, q, k, v, out, lse.unsqueeze(-1), z, z, b, e, e, 6, 6, 0.0, causal], {}
    return sample


def _one(*shapes, extra=()):
    return lambda r: ([r(*s) for s in shapes] + list(extra), {})


SAMPLES: dict[str, list] = {
    "ones_like.default": [_one((2, 4))],
    "zeros_like.default": [_one((2, 4))],
    "empty_like.default": [_one((2, 4))],
    "full_like.default": [_one((2, 4), extra=[3.0])],
    "slice.Tensor": [_one((2, 4, 6), extra=[2, 1, 5]), _one((4, 6), extra=[0, 0, 2])],
    "select.int": [_one((2, 4, 6), extra=[1, 2]), _one((4, 2, 6), extra=[0, 1])],
    "squeeze.dim": [_one((2, 1, 4), extra=[1]), _one((2, 4), extra=[1])],
    "unsqueeze.default": [_one((2, 4), extra=[1]), _one((2, 4), extra=[-1])],
    "split.Tensor": [_one((4, 6), extra=[2, 1])],
    "unbind.int": [_one((2, 4, 6), extra=[1])],
    "clone.default": [lambda r: ([r(2, 4)], {"memory_format": torch.contiguous_format})],
    "_to_copy.default": [lambda r: ([r(2, 4)], {"dtype": torch.float32})],
    "copy.default": [_one((2, 4, 6), (4, 6))],
    "cat.default": [lambda r: ([[r(2, 4), r(2, 6)], 1], {}),
                    lambda r: ([[r(2, 4), r(2, 4)]], {}),
                    # an empty 1-d operand (a key/value cache before its first entry)
                    lambda r: ([[r(0), r(2, 4, 6)], -2], {})],
    "stack.default": [lambda r: ([[r(2, 4), r(2, 4)], 1], {})],
    "constant_pad_nd.default": [_one((2, 4, 6), extra=[[1, 1]]),
                                _one((2, 4, 6), extra=[[0, 0, 1, 2], 3.0])],
    "slice_backward.default": [_one((2, 2, 6), extra=[[2, 4, 6], 1, 1, 3, 1])],
    "select_backward.default": [_one((2, 6), extra=[[2, 4, 6], 1, 2])],
    "slice_scatter.default": [_one((2, 4, 6), (2, 2, 6), extra=[1, 1, 3])],
    "select_scatter.default": [_one((2, 4, 6), (2, 6), extra=[1, 2])],
    "fill.Tensor": [lambda r: ([r(2, 4), r()], {})],
    "gather.default": [lambda r: ([r(4, 6), 1, r.ints(6, 4, 2)], {}),
                       lambda r: ([r(4, 6), 0, r.ints(4, 2, 6)], {}),
                       lambda r: ([r(5), 0, r.ints(5, 8)], {})],    # a weight per target
    "mul.Scalar": [_one((2, 4), extra=[3.0])],
    "div.Scalar": [_one((2, 4), extra=[3.0])],
    "pow.Tensor_Scalar": [_one((2, 4), extra=[2])],
    "cos.default": [_one((2, 4))],
    "sin.default": [_one((2, 4))],
    "clamp.default": [_one((2, 4), extra=[-0.5, 0.5])],
    "clamp_min.default": [_one((2, 4), extra=[0.1])],
    "clamp_max.default": [_one((2, 4), extra=[0.1])],
    "masked_fill.Scalar": [lambda r: ([r(2, 4, 6), r.bools(4, 6), -1.0], {}),
                           lambda r: ([r(2, 4, 6), r.bools(2, 1, 6), 0.0], {})],
    "tril.default": [_one((2, 4, 4))],
    "triu.default": [_one((2, 4, 4), extra=[1])],
    "gelu.default": [_one((2, 4)), lambda r: ([r(2, 4)], {"approximate": "tanh"})],
    "gelu_backward.default": [_one((2, 4), (2, 4)),
                              lambda r: ([r(2, 4), r(2, 4)], {"approximate": "tanh"})],
    "silu.default": [_one((2, 4))],
    "silu_backward.default": [_one((2, 4), (2, 4))],
    "tanh_backward.default": [_one((2, 4), (2, 4))],
    "threshold_backward.default": [_one((2, 4), (2, 4), extra=[0.0])],
    "native_dropout_backward.default": [lambda r: ([r(2, 4), r.bools(2, 4), 2.0], {})],
    "_softmax.default": [_one((2, 4, 6), extra=[1, False])],
    "_safe_softmax.default": [lambda r: ([r(2, 4, 6).masked_fill(r.bools(2, 4, 1),
                                                                 float("-inf")), -1], {})],
    "_log_softmax.default": [_one((2, 4, 6), extra=[2, False])],
    "_softmax_backward_data.default": [_softmax_backward_sample(False)],
    "_log_softmax_backward_data.default": [_softmax_backward_sample(True)],
    "nll_loss_forward.default": [_nll(red, w, False) for red in (0, 1, 2) for w in (0, 1)],
    "nll_loss_backward.default": [_nll(red, w, True) for red in (0, 1, 2) for w in (0, 1)],
    "mse_loss.default": [_one((2, 4), (2, 4), extra=[red]) for red in (0, 1, 2)],
    "mse_loss_backward.default": [_mse_backward(red) for red in (0, 1, 2)],
    "nll_loss2d_forward.default": [_nll(red, w, False, (2, 3)) for red in (0, 1, 2)
                                   for w in (0, 1)],
    "nll_loss2d_backward.default": [_nll(red, w, True, (2, 3)) for red in (0, 1, 2)
                                    for w in (0, 1)],
    # losses of each element then reduced: (self, target, reduction, beta or delta)
    **{t: [lambda r, red=red: ([r(4, 6), r(4, 6), red, 0.5], {}) for red in (0, 1, 2)]
       for t in ("smooth_l1_loss.default", "huber_loss.default")},
    **{t: [lambda r, red=red: ([r(4, 6) if red == 0 else r(), r(4, 6), r(4, 6), red, 0.5], {})
           for red in (0, 1, 2)]
       for t in ("smooth_l1_loss_backward.default", "huber_loss_backward.default")},
    "soft_margin_loss.default": [lambda r, red=red: ([r(4, 6), r(4, 6).sign(), red], {})
                                 for red in (0, 1, 2)],
    "soft_margin_loss_backward.default": [
        lambda r, red=red: ([r(4, 6) if red == 0 else r(), r(4, 6), r(4, 6).sign(), red], {})
        for red in (0, 1, 2)],
    # (self, target, weight, reduction); the weight broadcast along the rows or whole
    "binary_cross_entropy.default": [
        lambda r, red=red, w=w: ([r(4, 6).sigmoid(), r(4, 6).sigmoid(), w(r), red], {})
        for red in (0, 1, 2) for w in (lambda r: None, lambda r: r(6).abs(),
                                       lambda r: r(4, 6).abs())],
    "binary_cross_entropy_backward.default": [
        lambda r, red=red, w=w: ([r(4, 6) if red == 0 else r(), r(4, 6).sigmoid(),
                                  r(4, 6).sigmoid(), w(r), red], {})
        for red in (0, 1, 2) for w in (lambda r: None, lambda r: r(6).abs())],
    # (self, target, weight, pos_weight, reduction)
    "binary_cross_entropy_with_logits.default": [
        lambda r, red=red, w=w, pw=pw: ([r(4, 6), r(4, 6).sigmoid(), w(r), pw(r), red], {})
        for red in (0, 1, 2) for w, pw in ((lambda r: None, lambda r: None),
                                           (lambda r: r(4, 6).abs(), lambda r: r(6).abs()))],
    "multi_margin_loss.default": [_margin(red, w, False) for red in (0, 1, 2) for w in (0, 1)],
    "multi_margin_loss_backward.default": [_margin(red, w, True) for red in (0, 1, 2)
                                           for w in (0, 1)],
    "count_nonzero.default": [lambda r: ([r(2, 4, 6).relu()], {})],
    "count_nonzero.dim_IntList": [lambda r: ([r(2, 4, 6).relu(), [0, 2]], {}),
                                  lambda r: ([r(2, 4, 6).relu(), [1]], {})],
    "prod.default": [_one((2, 4, 6))],
    "sigmoid_backward.default": [_one((2, 4), (2, 4))],
    "fill.Scalar": [_one((2, 4), extra=[3.0])],
    "argmax.default": [_one((2, 4, 6), extra=[1]), _one((2, 4, 6), extra=[2, True])],
    # reductions over named dims, sorts and scans along them (the batch analysis's
    # couplings: tests/torch/test_batch_coupling.py)
    **{t: [_one((2, 4, 6), extra=[[0, 2]]),
           lambda r: ([r(2, 4, 6), 1], {"correction": 0, "keepdim": True}),
           _one((2, 4, 6))]
       for t in ("var.correction", "std.correction", "var_mean.correction",
                 "std_mean.correction")},
    "logsumexp.default": [_one((2, 4, 6), extra=[[1]]), _one((2, 4, 6), extra=[[0, 2], True])],
    "norm.ScalarOpt_dim": [_one((2, 4, 6), extra=[2.0, [1]]),
                           _one((2, 4, 6), extra=[1.0, [0, 2], True])],
    "linalg_vector_norm.default": [_one((2, 4, 6), extra=[2.0, [2]]), _one((2, 4, 6))],
    **{t: [_one((2, 4, 6), extra=[1]), _one((2, 4, 6), extra=[-1, True])]
       for t in ("max.dim", "min.dim", "median.dim", "nanmedian.dim", "mode.default",
                 "prod.dim_int")},
    "max.default": [_one((2, 4, 6))],
    "min.default": [_one((2, 4, 6))],
    "median.default": [_one((2, 4, 6))],
    "nanmedian.default": [_one((2, 4, 6))],
    "kthvalue.default": [_one((2, 4, 6), extra=[2, 1]), _one((2, 4, 6), extra=[3, -1, True])],
    **{t: [lambda r: ([r.bools(2, 4, 6), 1], {}),
           lambda r: ([r.bools(2, 4, 6), 2, True], {})]
       for t in ("any.dim", "all.dim")},
    **{t: [lambda r: ([r.bools(2, 4, 6), [0, 2]], {}),
           lambda r: ([r.bools(2, 4, 6)], {})]
       for t in ("any.dims", "all.dims")},
    "nansum.default": [lambda r: ([r(2, 4, 6).masked_fill(r.bools(2, 4, 6), float("nan")),
                                   [1]], {}),
                       _one((2, 4, 6), extra=[[0, 2], True])],
    "sort.default": [_one((2, 4, 6), extra=[1]), _one((2, 4, 6))],
    **{t: [_one((2, 4, 6), extra=[1]), _one((2, 4, 6), extra=[-1])]
       for t in ("cummax.default", "cummin.default", "cumprod.default",
                 "logcumsumexp.default", "cumsum.default")},
    "sort.stable": [lambda r: ([r(2, 4, 6)], {"stable": True, "dim": 1})],
    "topk.default": [_one((2, 4, 6), extra=[2, 1]), _one((2, 4, 6), extra=[3])],
    "roll.default": [_one((2, 4, 6), extra=[[1], [1]]), _one((2, 4, 6), extra=[[1, 2], [0, 2]]),
                     _one((2, 4, 6), extra=[[3]])],
    "flip.default": [_one((2, 4, 6), extra=[[1]]), _one((2, 4, 6), extra=[[0, 2]])],
    "unfold.default": [_one((2, 4, 6), extra=[2, 2, 2])],
    "_cdist_forward.default": [_one((4, 6), (2, 6), extra=[2.0, None]),
                               _one((2, 4, 6), (2, 2, 6), extra=[1.0, None])],
    "_pdist_forward.default": [_one((4, 6))],
    "index.Tensor": [lambda r: ([r(4, 6), [r.ints(4, 2, 4)]], {}),
                     lambda r: ([r(2, 4, 6), [None, r.ints(4, 4, 2)]], {}),
                     lambda r: ([r(4, 6, 2), [r.ints(4, 4), r.ints(6, 4)]], {})],
    **{f"{t}.default": [_one((2, 4))]
       for t in ("isnan", "logical_not", "ceil", "floor", "round", "trunc", "sign", "sgn")},
    "add.Scalar": [_one((2, 4), extra=[3.0])],
    "sub.Scalar": [_one((2, 4), extra=[3.0])],
    "rsub.Scalar": [_one((2, 4), extra=[3.0])],
    "xlogy.Tensor": [lambda r: ([r(2, 4).abs(), r(4).abs()], {})],
    "addmm.default": [_one((6,), (4, 8), (8, 6)),
                      lambda r: ([r(4, 6), r(4, 8), r(8, 6)], {"beta": 0.5, "alpha": 2.0})],
    "convolution.default": [_conv(), _conv(bias=False), _conv(transposed=True),
                            _conv(groups=2)],
    "convolution_backward.default": [_conv_backward(), _conv_backward(mask=(False, True, False)),
                                     _conv_backward(transposed=True), _conv_backward(groups=2)],
    "embedding.default": [lambda r: ([r(8, 6), r.ints(8, 2, 4)], {}),
                          lambda r: ([r(8, 6), r.ints(8, 2, 4), 3], {})],
    "embedding_dense_backward.default": [
        lambda r: ([r(2, 4, 6), r.ints(8, 2, 4), 8, -1, False], {}),
        lambda r: ([r(2, 4, 6), r.ints(8, 2, 4), 8, 5, False], {}),
        lambda r: ([r(2, 4, 6), r.ints(8, 2, 4), 8, -1, True], {})],
    "native_layer_norm.default": [lambda r: ([r(2, 4, 6), [6], r(6), r(6), 1e-5], {}),
                                  lambda r: ([r(2, 4, 6), [4, 6], None, None, 1e-5], {})],
    "native_layer_norm_backward.default": [_layer_norm_backward([True, True, True], True),
                                           _layer_norm_backward([True, False, False], False)],
    "_native_batch_norm_legit_functional.default": [_batch_norm(True), _batch_norm(False)],
    "_native_batch_norm_legit.no_stats": [
        lambda r: ([r(4, 6, 2, 2), r(6), r(6), True, 0.1, 1e-5], {}),
        lambda r: ([r(1, 6, 2, 2), None, None, True, 0.1, 1e-5], {})],
    "_native_batch_norm_legit_no_training.default": [
        lambda r: ([r(4, 6, 2, 2), r(6), r(6), r(6), r(6).abs(), 0.1, 1e-5], {})],
    "native_batch_norm_backward.default": [_batch_norm_backward(True, [True, True, True]),
                                           _batch_norm_backward(False, [True, True, True]),
                                           _batch_norm_backward(True, [False, True, True])],
    "native_group_norm.default": [
        lambda r: ([r(4, 6, 3), r(6), r(6), 4, 6, 3, 2, 1e-5], {})],
    "native_group_norm_backward.default": [_group_norm_backward],
    "max_pool2d_with_indices.default": [_one((2, 4, 6, 6), extra=[[2, 2], [2, 2]])],
    "max_pool2d_with_indices_backward.default": [_max_pool_backward],
    "_scaled_dot_product_flash_attention_for_cpu.default": [
        _sdpa(), _sdpa(causal=True), _sdpa(kv_heads=2), _sdpa((6, 6), scale=0.3),
        _sdpa((2, 1, 6, 6))],
    "_scaled_dot_product_flash_attention_for_cpu_backward.default": [
        _sdpa_backward(), _sdpa_backward(causal=True), _sdpa_backward(kv_heads=2),
        _sdpa_backward((2, 1, 6, 6))],
    "_scaled_dot_product_flash_attention.default": [_cuda_forward("flash"),
                                                    _cuda_forward("flash", causal=True)],
    "_scaled_dot_product_flash_attention_backward.default": [_cuda_backward("flash")],
    "_scaled_dot_product_efficient_attention.default": [_cuda_forward("efficient"),
                                                        _cuda_forward("efficient", bias=False)],
    "_scaled_dot_product_efficient_attention_backward.default": [_cuda_backward("efficient")],
    "_scaled_dot_product_cudnn_attention.default": [_cuda_forward("cudnn")],
    "_scaled_dot_product_cudnn_attention_backward.default": [_cuda_backward("cudnn")],
}
SAMPLES = {f"aten.{k}": v for k, v in SAMPLES.items()}
CASES = [(t, i) for t, fns in SAMPLES.items() for i in range(len(fns))]


def _sample(target: str, i: int):
    args, kwargs = SAMPLES[target][i](_Rand(1000 + i))
    return make_op(target, args, kwargs)


# judged, never split: every result of a pairwise distance reads two rows; a median or a
# product of every element is no combination of pieces' medians or products
WHOLE = {"aten._pdist_forward.default", "aten.median.default", "aten.nanmedian.default",
         "aten.prod.default"}


def test_every_target_with_strategies_has_a_sample_that_splits():
    with_menu = {t for t, rule in FRAMEWORK_OPS.items()
                 if t.startswith("aten.") and rule.strategies is not None}
    assert with_menu - set(SAMPLES) == set(), "no sample"
    assert set(SAMPLES) - with_menu == set(), "a sample of an op without strategies"
    for target in set(SAMPLES) - WHOLE:
        splits = set()
        for i in range(len(SAMPLES[target])):
            op, tensors, whole = _sample(target, i)
            splits |= {s.name for s in candidates(op, [_ttype(t) for t in tensors],
                                                  [_ttype(w) for w in whole], N)[1:]}
        assert splits, f"{target}: no sample takes a split"


@pytest.mark.parametrize("target,i", CASES, ids=[f"{t[5:]}-{i}" for t, i in CASES])
def test_each_strategy_splits_exactly(target, i):
    op, tensors, whole = _sample(target, i)
    ins, outs = [_ttype(t) for t in tensors], [_ttype(w) for w in whole]
    g = torch.Generator().manual_seed(7)
    for s in candidates(op, ins, outs, N, masked=True):
        assert (len(s.inputs), len(s.outputs)) == (len(ins), len(outs)), s
        run_strategy(target, op, tensors, whole, s, g)


@pytest.mark.parametrize("target,i", CASES, ids=[f"{t[5:]}-{i}" for t, i in CASES])
def test_each_grouped_strategy_splits_exactly(target, i):
    # splits of a dimension of 3 groups (a fused query/key/value projection's columns):
    # the menu's own (split, cat) and every plain split regrouped, where the rule allows
    op, tensors, whole = _sample(target, i)
    ins, outs = [_ttype(t) for t in tensors], [_ttype(w) for w in whole]
    g = torch.Generator().manual_seed(7)
    for s in candidates(op, ins, outs, N, groups=(3,)):
        if any(isinstance(p, Shard) and p.groups > 1 for p in s.inputs + s.outputs):
            run_strategy(target, op, tensors, whole, s, g)


def test_grouped_splits_are_offered_where_exact():
    for target, groups in (("split.Tensor", 3), ("cat.default", 2), ("addmm.default", 3)):
        op, tensors, whole = _sample(f"aten.{target}", 0 if target != "cat.default" else 1)
        ins, outs = [_ttype(t) for t in tensors], [_ttype(w) for w in whole]
        menu = candidates(op, ins, outs, N, groups=(groups,))
        assert any(isinstance(p, Shard) and p.groups == groups
                   for s in menu for p in s.inputs + s.outputs), target
    op, tensors, whole = _sample("aten.convolution.default", 3)      # groups=2 convolution
    ins, outs = [_ttype(t) for t in tensors], [_ttype(w) for w in whole]
    assert not any(isinstance(p, Shard) and p.groups > 1
                   for s in candidates(op, ins, outs, N, groups=(2,))
                   for p in s.inputs + s.outputs)


def test_a_wrong_strategy_is_caught():
    """The checker fails on a split that is not exact (softmax split along its own dim)."""
    from diphoma_compile.ir.strategies import Strategy
    op, tensors, whole = _sample("aten._softmax.default", 0)
    wrong = Strategy((Shard(1),), (Shard(1),), "wrong")
    with pytest.raises(AssertionError):
        run_strategy("aten._softmax.default", op, tensors, whole, wrong,
                     torch.Generator().manual_seed(0))


# ------------------------------------------------------------------ flops

def _flops(target, args, kwargs=None):
    op, tensors, whole = make_op(target, args, kwargs or {}, call=resolve_target(target))
    return op_def("opaque").flops(op, [_ttype(t) for t in tensors], [_ttype(w) for w in whole])


def _counted(fn, *args) -> int:
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as counter:
        fn(*args)
    return counter.get_total_flops()


def test_addmm_flops():
    r = _Rand(0)
    b, x, w = r(5), r(3, 4), r(4, 5)
    assert _flops("aten.addmm.default", [b, x, w]) == 2 * 3 * 4 * 5 + 3 * 5
    assert _counted(lambda: aten.addmm(b, x, w)) == 2 * 3 * 4 * 5


def test_convolution_flops():
    r = _Rand(0)
    x, w, b = r(2, 3, 8, 8), r(4, 3, 3, 3), r(4)
    conv = [[1, 1], [1, 1], [1, 1], False, [0, 0], 1]
    matmul = 2 * 2 * 4 * 8 * 8 * 3 * 3 * 3           # 2 * N * Cout * outHW * Cin * kH * kW
    assert _flops("aten.convolution.default", [x, w, b, *conv]) == matmul + 2 * 4 * 8 * 8
    assert _counted(lambda: aten.convolution(x, w, b, *conv)) == matmul
    g = r(2, 4, 8, 8)
    back = [g, x, w, [4], *conv, [True, True, True]]
    assert _flops("aten.convolution_backward.default", back) == 2 * matmul + g.numel()
    assert _counted(lambda: aten.convolution_backward(*back)) == 2 * matmul
    only_weight = back[:-1] + [[False, True, False]]
    assert _flops("aten.convolution_backward.default", only_weight) == matmul
    t = [x, r(3, 4, 3, 3), None, [2, 2], [1, 1], [1, 1], True, [1, 1], 1]   # transposed
    assert _flops("aten.convolution.default", t) == _counted(lambda: aten.convolution(*t))


def test_attention_flops():
    r = _Rand(0)
    q, k, v = r(2, 3, 4, 8), r(2, 3, 5, 8), r(2, 3, 5, 8)
    scores = 2 * 3 * 4 * 5
    fwd = _flops("aten._scaled_dot_product_flash_attention_for_cpu.default", [q, k, v])
    assert fwd == 4 * 2 * 3 * 4 * 5 * 8 + 5 * scores
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)
    bwd = _flops("aten._scaled_dot_product_flash_attention_for_cpu_backward.default",
                 [r(*out.shape), q, k, v, out, lse, 0.0, False])
    assert bwd == 2.5 * (4 * 2 * 3 * 4 * 5 * 8) + 4 * scores
    # the CUDA kernels, on meta tensors, against torch's flop counter
    meta = dict(device="meta", dtype=torch.float16)
    q, k, v = (torch.empty(2, 4, 6, 8, **meta), torch.empty(2, 4, 5, 8, **meta),
               torch.empty(2, 4, 5, 8, **meta))
    bias, scores = torch.empty(2, 4, 6, 5, **meta), 2 * 4 * 6 * 5
    calls = {
        "_scaled_dot_product_flash_attention": [q, k, v],
        "_scaled_dot_product_efficient_attention": [q, k, v, bias, True],
        "_scaled_dot_product_cudnn_attention": [q, k, v, bias, True],
    }
    for name, args in calls.items():
        target = f"aten.{name}.default"
        res = resolve_target(target)(*args)
        assert _flops(target, args) - 5 * scores == _counted(resolve_target(target), *args)
        g = torch.empty_like(res[0])
        if name.startswith("_scaled_dot_product_flash"):
            back = [g, q, k, v, res[0], res[1], res[2], res[3], res[4], res[5], 0.0, False,
                    res[6], res[7]]
        elif "efficient" in name:
            back = [g, q, k, v, bias, res[0], res[1], res[2], res[3], 0.0, [True] * 4]
        else:
            back = [g, q, k, v, res[0], res[1], res[6], res[7], bias, res[2], res[3], res[4],
                    res[5], 0.0, False]
        bt = f"aten.{name}_backward.default"
        assert _flops(bt, back) - 4 * scores == _counted(resolve_target(bt), *back), bt


def test_embedding_bytes_count_the_rows_looked_up_not_the_table():
    r = _Rand(0)
    table, idx = r(1000, 16), r.ints(1000, 2, 4)
    op, tensors, whole = make_op("aten.embedding.default", [table, idx], {})
    got = op_def("opaque").bytes_accessed(op, [_ttype(t) for t in tensors],
                                          [_ttype(w) for w in whole])
    assert got == idx.numel() * 8 + 2 * 8 * 16 * 8
