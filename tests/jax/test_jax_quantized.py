"""SDP4Bit's quantized collectives on the JAX backend, 8 CPU devices: the quant kernels
against the PyTorch lowering's (the same keyed draws, the same codes), quantize-weight-diff
and quantize-grads each within its declared error of the exact step, the preset
(compression="sdp4bit") on the GPT of examples/gpt.py in flax with the bytes of the PyTorch
plan for the same model, the communication state held and resumed, and the golden IR of
both passes on the JAX layout (dim-0 pieces)."""

from __future__ import annotations

import math
import os
import sys

import pytest

jax = pytest.importorskip("jax")
flax = pytest.importorskip("flax")
optax = pytest.importorskip("optax")

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from diphoma_compile import Mesh, parallelize, trace  # noqa: E402
from diphoma_compile.ir import InputKind, parse, print_graph  # noqa: E402
from diphoma_compile.jax import quant as jq  # noqa: E402
from diphoma_compile.jax.comm_state import JaxCommStateStep  # noqa: E402
from diphoma_compile.passes import PassContext, Pipeline  # noqa: E402
from diphoma_compile.passes.defaults import default_passes  # noqa: E402

pytestmark = pytest.mark.skipif(jax.device_count() < 8,
                                reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))

N = 8
BASE = "dce,data-parallel{axis=dp},weight-update-sharding{axis=dp, layout=dims},dce"
QWD = BASE + ",quantize-weight-diff{axis=dp, bits=4, group=2048, rounding=stochastic}"
QG = BASE + ",quantize-grads{axis=dp, bits=4, group=128, hadamard=32}"


# ------------------------------------------------------------------ kernels vs torch

def test_kernels_draw_and_round_as_the_torch_lowering_does():
    """The keyed stream, stochastic codes and packed bytes are the PyTorch lowering's
    exactly, the scales and dequantized values to the last bit (no Hadamard: the
    transform's matmul may round the last bit differently, so with it the codes agree to
    one step)."""
    torch = pytest.importorskip("torch")
    from diphoma_compile.torch import quant as tq
    rng = np.random.default_rng(0)
    x = rng.standard_normal(3000).astype(np.float32)
    for key, offset in ((0, 0), (12345, 777), (0xFFFFFFFF, 2 ** 31 - 5)):
        u_t = tq.uniform(torch.tensor(key, dtype=torch.int64), 500, offset).numpy()
        u_j = np.asarray(jq.uniform(jnp.uint32(key), 500, offset))
        assert np.array_equal(u_t, u_j)
        assert int(tq.next_key(torch.tensor(key, dtype=torch.int64))) == \
            int(jq.next_key(jnp.uint32(key)))
    u = tq.uniform(torch.tensor(7, dtype=torch.int64), x.size, 0)
    q_t, s_t = tq.quantize(torch.from_numpy(x), 4, 128, u, 4)
    q_j, s_j = jq.quantize(jnp.asarray(x), 4, 128, jnp.asarray(u.numpy()), 4)
    assert np.array_equal(q_t.numpy(), np.asarray(q_j))
    # the scales to the last bit: XLA may divide by 7 as a multiply by its reciprocal
    assert np.allclose(s_t.numpy(), np.asarray(s_j), rtol=2.5e-7, atol=0)
    p_t, p_j = tq.pack(q_t, 4), jq.pack(q_j, 4)
    assert np.array_equal(p_t.numpy(), np.asarray(p_j))
    back = jq.unpack(p_j, 4, q_j.shape, jnp.int8)
    assert np.array_equal(np.asarray(back), np.asarray(q_j))
    d_t = tq.dequantize(q_t, s_t, 128, torch.float32, [3000], 4).numpy()
    d_j = np.asarray(jq.dequantize(q_j, s_j, 128, jnp.float32, (3000,), 4))
    assert np.allclose(d_t, d_j, rtol=5e-7, atol=0)
    assert np.abs(d_j - x).max() <= np.abs(x).max() / 7 * (1 + 1e-6)
    qh_t, _ = tq.quantize(torch.from_numpy(x), 8, 128, u, 4, 32)
    qh_j, _ = jq.quantize(jnp.asarray(x), 8, 128, jnp.asarray(u.numpy()), 4, 32)
    assert np.abs(qh_t.numpy().astype(int) - np.asarray(qh_j).astype(int)).max() <= 1
    h = jq.hadamard(jnp.asarray(x[:2048]), 32)
    assert np.allclose(np.asarray(jq.hadamard(h, 32)), x[:2048], atol=1e-5)


# ------------------------------------------------------------------ models

class MLP(nn.Module):
    """32 -> 512 -> 64: the kernels' pieces are one and two groups of 2048 (and 16 and 32
    groups of 128); the biases are under a group and stay fp32."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(64)(nn.tanh(nn.Dense(512)(x)))


def mlp_case(tx, width: int = 32):
    model = MLP()
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4 * N, width)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((4 * N, 64)), jnp.float32)
    params = model.init(jax.random.key(0), x[:1])["params"]

    def loss_fn(p, x, y):
        return jnp.mean((model.apply({"params": p}, x) - y) ** 2)

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return step, loss_fn, params, tx.init(params), x, y


def group_absmax(x: np.ndarray, pieces: int, group: int) -> np.ndarray:
    """Per element of flat x: the absmax of its group in quantize{pieces}'s layout."""
    k = -(-x.size // pieces)
    kq = -(-k // group) * group
    rows = np.zeros((pieces, kq), x.dtype)
    rows[:, :k] = np.pad(x, (0, pieces * k - x.size)).reshape(pieces, k)
    amax = np.repeat(np.abs(rows.reshape(-1, group)).max(1), group).reshape(pieces, kq)
    return amax[:, :k].reshape(-1)[:x.size]


def in_pieces(a, shape: tuple[int, ...]) -> np.ndarray:
    """a flattened in the order of its pieces under the JAX layout: split along the first
    dimension the axis divides, moved to the front (dim 0: the plain flattening)."""
    d = next(i for i, s in enumerate(shape) if s % N == 0)
    return np.moveaxis(np.reshape(np.asarray(a), shape), d, 0).reshape(-1)


def names_of(runner) -> list[str]:
    """The graph input names of the user's parameter leaves, in leaf order."""
    return [i.name for i in runner.user_graph.inputs if i.role.kind is InputKind.param]


@pytest.mark.parametrize("width", [32, 36])
def test_quantize_weight_diff_within_its_declared_error(width):
    """Every step, each quantized parameter (what every device computes with) is within
    absmax/7 of its group of the step's difference of the exact weights, which the runner
    holds; after step 1 the exact weights are the single-device step's; the checkpoint of
    the state resumes the run exactly. Width 36: the first kernel (36, 512) is split along
    dim 1, which the pass moves to the front before quantizing."""
    step, _, params, opt, x, y = mlp_case(optax.sgd(0.1, momentum=0.9), width)
    ps = parallelize(step, Mesh({"dp": N}), donate=False, passes=QWD)
    ref = jax.jit(step)(params, opt, x, y)[0]
    p, o = params, opt
    for t in range(3):
        before = jax.tree.leaves(p)
        p, o, loss = ps(p, o, x, y)
        names = names_of(ps.runner)
        masters = ps.runner.gather_comm_state()
        quantized = [n for n in names if f"{n}.master" in masters]
        assert len(quantized) == 2                    # the kernels; the biases stay fp32
        for n, b, r in zip(names, before, jax.tree.leaves(p)):
            if n not in quantized:
                continue
            shape = np.shape(r)
            exact = in_pieces(masters[f"{n}.master"], shape)
            recon = in_pieces(r, shape)
            bound = group_absmax(exact - in_pieces(b, shape), N, 2048) / 7
            assert np.all(np.abs(recon - exact) <= bound * (1 + 1e-5) + 1e-12)
            assert np.abs(recon - exact).max() > 0        # it does quantize
            if t == 0:
                want = in_pieces(jax.tree.leaves(ref)[names.index(n)], shape)
                assert np.allclose(exact, want, rtol=1e-5, atol=1e-6)
    # resume: a fresh runner given the state continues exactly; one without it restarts
    # the exact weights from the reconstruction, and differs
    saved = ps.runner.gather_comm_state()
    nxt = ps(p, o, x, y)[0]
    resumed = JaxCommStateStep(ps.graph, ps.runner.out_tree, mesh=ps.runner.mesh,
                               donate=False)
    resumed.load_comm_state(saved)
    fresh = JaxCommStateStep(ps.graph, ps.runner.out_tree, mesh=ps.runner.mesh,
                             donate=False)
    same = [np.array_equal(a, b) for a, b in zip(jax.tree.leaves(nxt),
                                                 jax.tree.leaves(resumed(p, o, x, y)[0]))]
    other = [np.array_equal(a, b) for a, b in zip(jax.tree.leaves(nxt),
                                                  jax.tree.leaves(fresh(p, o, x, y)[0]))]
    assert all(same) and not all(other)


def hadamard_rows(x: np.ndarray, block: int = 32) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < block:
        h = np.block([[h, h], [h, -h]])
    return (x.astype(np.float64).reshape(-1, block) @ (h / math.sqrt(block))).reshape(-1)


def piece_rows(x: np.ndarray, pieces: int, group: int) -> np.ndarray:
    k = -(-x.size // pieces)
    kq = -(-k // group) * group
    rows = np.zeros((pieces, kq), x.dtype)
    rows[:, :k] = np.pad(x, (0, pieces * k - x.size)).reshape(pieces, k)
    return rows


@pytest.mark.parametrize("width", [32, 36])
def test_quantize_grads_within_its_declared_error(width):
    """One SGD step at lr 1: the averaged gradient each device's piece receives differs
    from the exact mean, in the Hadamard domain, by at most the mean over the senders of
    their group's absmax/7, computed here from each device's own gradient (width 36: a
    gradient split along dim 1)."""
    step, loss_fn, params, opt, x, y = mlp_case(optax.sgd(1.0), width)
    ps = parallelize(step, Mesh({"dp": N}), donate=False, passes=QG)
    new = ps(params, opt, x, y)[0]
    rec = ps.plan.notes["quantize-grads"]
    assert len(rec["quantized"]) == 2 and len(rec["kept"]) == 2       # the biases
    own = [jax.grad(loss_fn)(params, x[4 * d:4 * d + 4],
                             y[4 * d:4 * d + 4]) for d in range(N)]
    names = names_of(ps.runner)
    checked = 0
    for k, n in enumerate(names):
        shape = np.shape(jax.tree.leaves(params)[k])
        every = [in_pieces(jax.tree.leaves(g)[k], shape) for g in own]
        if every[0].size // N < 128:
            continue
        exact = np.mean(np.stack(every).astype(np.float64), 0)
        w0 = in_pieces(jax.tree.leaves(params)[k], shape).astype(np.float64)
        got = w0 - in_pieces(jax.tree.leaves(new)[k], shape)
        scales = [np.abs(piece_rows(hadamard_rows(piece_rows(e, N, 128).reshape(-1)), 1, 128)
                         .reshape(-1, 128)).max(1) / 7 for e in every]
        bound = np.repeat(np.mean(scales, 0), 128)
        err = np.abs(hadamard_rows(piece_rows(got - exact, N, 128).reshape(-1)))
        slack = 4e-7 * np.abs(w0).max()
        assert np.all(err <= bound * (1 + 1e-5) + slack), n
        assert err.max() > 1e-3 * bound.max()                 # it does quantize
        checked += 1
    assert checked == 2


# ------------------------------------------------------------------ the preset

V, T, L, H, D = 128, 16, 1, 2, 128


def test_preset_on_gpt_moves_the_bytes_of_the_torch_plan():
    """compression="sdp4bit" on the flax GPT of examples/flax_gpt.py: the plan's bytes per
    step are the PyTorch plan's for examples/gpt.py (same tensors), at most 0.16x of the
    unquantized plan's; three AdamW steps run and their losses stay within 2% of the
    unquantized plan's."""
    from flax_gpt import GPT, make_step
    model, tx = GPT(V, T, L, H, D), optax.adamw(3e-3)
    params = model.init(jax.random.key(0), jnp.zeros((1, T), jnp.int32))["params"]
    opt = tx.init(params)
    ids = np.random.default_rng(0).integers(0, V, (2 * N, T + 1)).astype(np.int32)
    idx, tgt = jnp.asarray(ids[:, :-1]), jnp.asarray((ids[:, :-1] + 1) % V)
    step = make_step(model, tx)
    runs = {}
    for comp in (None, "sdp4bit"):
        ps = parallelize(step, Mesh({"dp": N}), donate=False, compression=comp)
        p, o, losses = params, opt, []
        for _ in range(3):
            p, o, loss = ps(p, o, idx, tgt)
            losses.append(float(loss))
        runs[comp] = (ps.plan, losses)
    plan, losses = runs["sdp4bit"]
    assert plan.comm_bytes_per_step <= 0.16 * runs[None][0].comm_bytes_per_step
    assert all(abs(a / b - 1) < 0.02 for a, b in zip(losses, runs[None][1]))
    assert losses[-1] < losses[0]
    torch = pytest.importorskip("torch")
    from gpt import GPT as TorchGPT
    from gpt import GPTConfig, train_step
    tm = TorchGPT(GPTConfig(vocab_size=V, block_size=T, n_layer=L, n_head=H, n_embd=D))
    topt = torch.optim.AdamW(tm.parameters(), lr=3e-3)
    tidx = torch.zeros((2, T), dtype=torch.int64)
    tplan = parallelize(train_step, Mesh({"dp": N}), compression="sdp4bit").trace(
        tm, topt, tidx, tidx).plan
    # PyTorch's cross-entropy divides by its count of targets not ignored, summed over the
    # devices (one f32 all-reduce, 2 (N-1)/N of 4 bytes); optax's mean divides by the rows
    assert tplan.notes["data-parallel"]["counted_globally"] != []
    assert plan.comm_bytes_per_step == tplan.comm_bytes_per_step - 2 * (N - 1) * 4 // N
    for p in ("quantize-grads", "quantize-weight-diff"):
        assert sorted(plan.notes[p]["bytes_after"].values()) == \
            sorted(tplan.notes[p]["bytes_after"].values())


def test_golden_sdp4bit_on_the_jax_layout(golden):
    """Both passes after weight-update sharding on whole dimensions (dim-0 pieces)."""
    step, _, params, opt, x, y = mlp_case(optax.adamw(1e-2))
    graph = trace(step, params, opt, x[:4], y[:4]).replace(mesh=Mesh({"dp": N}))
    spec = default_passes("dp", layout="dims", compression="sdp4bit")
    out = Pipeline.from_spec(spec).run(graph, PassContext())
    text = print_graph(out)
    assert parse(text) == out
    golden("jax_mlp_adamw.sdp4bit.ir", text)


def test_two_hop_gradients_within_declared_error():
    """quantize-grads{levels=2, local=2} on 8 devices (4 nodes x 2): 8-bit all-to-all
    inside each node, the partial means requantized to 4 bits, all-to-all across nodes (each
    level's exchange as ppermute rounds). One SGD step at lr 1: in the Hadamard domain the
    averaged gradient is within the mean over nodes of (the node's senders' mean absmax/127)
    + (the node's partial mean's absmax/7, bounded by the exact partial's plus hop 1's)."""
    local_n, G = 2, 128
    nodes = N // local_n
    step, loss_fn, params, opt, x, y = mlp_case(optax.sgd(1.0))
    ps = parallelize(step, Mesh({"dp": N}),
                     passes=BASE + ",quantize-grads{axis=dp, levels=2, local=2}")
    new = ps(params, opt, x, y)[0]
    assert ps.plan.notes["quantize-grads"]["hops"] == 2
    own = [jax.grad(loss_fn)(params, x[4 * d:4 * d + 4], y[4 * d:4 * d + 4]) for d in range(N)]
    checked = 0
    for k in range(len(jax.tree.leaves(params))):
        every = [np.asarray(jax.tree.leaves(g)[k]).reshape(-1) for g in own]
        if every[0].size // N < G:
            continue
        hd = np.stack([hadamard_rows(piece_rows(e, N, G).reshape(-1)).reshape(N, -1)
                       for e in every])                                 # (sender, dest, kq)
        amax8 = np.abs(hd.reshape(N, N, -1, G)).max(-1) / 127
        exact = hd.mean(0)
        bound = np.zeros((N, exact.shape[1] // G))
        for a in range(nodes):
            members = list(range(a * local_n, (a + 1) * local_n))
            e1 = amax8[members].mean(0)
            part = np.abs(hd[members].mean(0).reshape(N, -1, G)).max(-1)
            bound += (e1 + (part + e1) / 7) / nodes
        w0 = np.asarray(jax.tree.leaves(params)[k]).reshape(-1).astype(np.float64)
        got = w0 - np.asarray(jax.tree.leaves(new)[k]).reshape(-1)
        err = np.abs(hadamard_rows(piece_rows(got, N, G).reshape(-1)).reshape(N, -1) - exact)
        b = np.repeat(bound, G, axis=1)
        slack = 4e-7 * np.abs(w0).max()
        assert np.all(err <= b * (1 + 1e-5) + slack)
        assert err.max() > 0.05 * b.max()
        checked += 1
    assert checked == 2


def test_node_axis_gives_two_hops():
    """parallelize(step, {"node": 4, "dp": 2}, compression="sdp4bit"): the node axis splits
    the data axis (8 devices) into 4 nodes of 2; the preset's gradients take two hops, the
    step runs, and its first loss is the unquantized step's."""
    step, _, params, opt, x, y = mlp_case(optax.adamw(1e-2))
    ps = parallelize(step, {"node": 4, "dp": 2}, donate=False, compression="sdp4bit")
    loss = ps(params, opt, x, y)[2]
    qg = ps.plan.notes["quantize-grads"]
    assert ps.mesh == Mesh({"dp": 8}) and qg["hops"] == 2 and qg["local"] == 2
    ref = jax.jit(step)(params, opt, x, y)[2]
    assert abs(float(loss) - float(ref)) < 1e-5 * abs(float(ref))


QAR = ("dce,data-parallel{axis=dp},dce,"
       "quantize-grads{axis=dp, bits=4, group=128, hadamard=32, all-reduce=true}")


def test_quantized_all_reduce_of_plain_data_parallelism():
    """all-reduce=true without weight-update sharding, one SGD step at lr 1: each
    gradient's all-reduce is a quantized all-to-all and a 4-bit all-gather of the averaged
    pieces; per 32-value block (L2), the applied gradient is within stage 1's bound (the
    senders' absmax/7, Hadamard domain) plus stage 2's (absmax/7 of the averaged group)."""
    step, loss_fn, params, opt, x, y = mlp_case(optax.sgd(1.0))
    ps = parallelize(step, Mesh({"dp": N}), donate=False, passes=QAR)
    new = ps(params, opt, x, y)[0]
    rec = ps.plan.notes["quantize-grads"]
    assert rec["all_reduce"] and len(rec["quantized"]) == 2
    plain = parallelize(step, Mesh({"dp": N}), donate=False,
                        passes="dce,data-parallel{axis=dp},dce").trace(
        params, opt, x, y).plan
    assert ps.plan.comm_bytes_per_step < 0.16 * plain.comm_bytes_per_step
    own = [jax.grad(loss_fn)(params, x[4 * d:4 * d + 4], y[4 * d:4 * d + 4]) for d in range(N)]
    checked = 0
    for k in range(len(jax.tree.leaves(params))):
        every = [np.asarray(jax.tree.leaves(g)[k]).reshape(-1) for g in own]
        if every[0].size // N < 128:
            continue
        exact = np.mean(np.stack(every).astype(np.float64), 0)
        w0 = np.asarray(jax.tree.leaves(params)[k]).reshape(-1).astype(np.float64)
        got = w0 - np.asarray(jax.tree.leaves(new)[k]).reshape(-1)
        e1 = np.repeat(np.mean([np.abs(piece_rows(hadamard_rows(piece_rows(e, N, 128)
                                                                .reshape(-1)), 1, 128)
                                       .reshape(-1, 128)).max(1) / 7 for e in every], 0), 128)
        e1_block = np.linalg.norm(e1.reshape(-1, 32), axis=1)
        amax = np.abs(piece_rows(exact, N, 128).reshape(-1, 128)).max(1)
        a2 = (amax + e1_block.reshape(-1, 4).max(1)) / 7 * math.sqrt(32)
        bound = e1_block + np.repeat(a2, 4)
        err = np.linalg.norm(piece_rows(got - exact, N, 128).reshape(-1, 32), axis=1)
        slack = 4e-7 * np.abs(w0).max() * math.sqrt(32)
        assert np.all(err <= bound * (1 + 1e-5) + slack)
        assert err.max() > 0.05 * bound.max()
        checked += 1
    assert checked == 2
