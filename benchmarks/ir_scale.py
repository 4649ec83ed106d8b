"""How the IR machinery scales: print, parse, verify, dce and cse on a synthetic graph the
size of a traced GPT-2-small step (tens of thousands of ops). Prints times per phase and per
1,000 ops, measured in one run; no asserts (these machines are noisy).

    python benchmarks/ir_scale.py [--layers 200] [--width 768]
"""

from __future__ import annotations

import argparse
import time

from diphoma_compile.ir import (Graph, Input, InputKind, InputRole, Op, Output, OutputKind,
                                OutputRole, Phase, TensorType, Value, parse, print_graph, verify)
from diphoma_compile.ir.analysis import graph_cost, liveness
from diphoma_compile.passes import Pipeline


def synthetic_step(layers: int, width: int, batch: int = 8) -> Graph:
    """An MLP-stack training step: forward, backward and an SGD update per layer, with
    duplicated constants (for cse) and dead ops (for dce)."""
    f32 = "f32"
    act = TensorType((batch, width), f32)
    w_t = TensorType((width, width), f32)
    scalar = TensorType((), f32)
    inputs = [Input(Value("x", act), InputRole(InputKind.batch)),
              Input(Value("lr", scalar), InputRole(InputKind.hyper))]
    ops: list[Op] = []
    outputs: list[Output] = []
    n = 0

    def emit(name, ins, t, phase, **attrs):
        nonlocal n
        n += 1
        v = f"v{n}"
        ops.append(Op(name, tuple(ins), (Value(v, t),), attrs, phase=phase))
        return v

    h = "x"
    acts = []
    for i in range(layers):
        inputs.append(Input(Value(f"layers.{i}.weight", w_t), InputRole(InputKind.param)))
        for _ in range(4):  # four sub-blocks per layer, like attention + MLP
            z = emit("dot", [h, f"layers.{i}.weight"], act, Phase.forward,
                     lhs_contract=(1,), rhs_contract=(0,))
            c = emit("full", [], scalar, Phase.forward, value=0.5)
            s = emit("mul", [z, c], act, Phase.forward)
            emit("exp", [s], act, Phase.forward)  # dead
            acts.append((h, s))
            h = emit("tanh", [s], act, Phase.forward)
    loss = emit("reduce_mean", [h], scalar, Phase.forward, dims=(0, 1))
    outputs.append(Output(loss, OutputRole(OutputKind.loss)))
    g = emit("full", [], act, Phase.backward, value=1.0)
    grads: dict[int, str] = {}
    for j in reversed(range(len(acts))):
        x_in, s = acts[j]
        t = emit("tanh", [s], act, Phase.backward)  # recomputed: cse merges it
        one = emit("full", [], scalar, Phase.backward, value=1.0)
        t2 = emit("mul", [t, t], act, Phase.backward)
        d = emit("sub", [one, t2], act, Phase.backward)
        g = emit("mul", [g, d], act, Phase.backward)
        i = j // 4
        gw = emit("dot", [x_in, g], w_t, Phase.backward, lhs_contract=(0,), rhs_contract=(0,))
        grads[i] = gw if i not in grads else emit("add", [grads[i], gw], w_t, Phase.backward)
        g = emit("dot", [g, f"layers.{i}.weight"], act, Phase.backward,
                 lhs_contract=(1,), rhs_contract=(1,))
    for i in range(layers):
        step = emit("mul", [grads[i], "lr"], w_t, Phase.update)
        new = emit("sub", [f"layers.{i}.weight", step], w_t, Phase.update)
        outputs.append(Output(new, OutputRole(OutputKind.replaces, f"layers.{i}.weight")))
    return Graph("synthetic_step", tuple(inputs), tuple(ops), tuple(outputs))


def timed(label: str, fn, n_ops: int):
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    print(f"{label:28s} {dt * 1e3:9.1f} ms   {dt * 1e6 / max(n_ops, 1):7.1f} us/op")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=200,
                   help="200 layers give about 10,600 ops, a traced GPT-2-small step has thousands")
    p.add_argument("--width", type=int, default=768)
    a = p.parse_args()
    g = synthetic_step(a.layers, a.width)
    n = len(g.ops)
    print(f"synthetic step: {n:,} ops, {len(g.inputs)} inputs")
    text = timed("print_graph", lambda: print_graph(g), n)
    print(f"{'':28s} {len(text) / 1e6:9.1f} MB of text")
    g2 = timed("parse", lambda: parse(text), n)
    assert g2 == g
    timed("verify", lambda: verify(g), n)
    timed("liveness", lambda: liveness(g), n)
    timed("graph_cost", lambda: graph_cost(g), n)
    out = timed("pipeline dce,cse (verified)", lambda: Pipeline.from_spec("dce,cse").run(g), n)
    print(f"{'':28s} {n:,} -> {len(out.ops):,} ops")


if __name__ == "__main__":
    main()
