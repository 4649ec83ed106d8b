"""The plan's flops next to the matmul count, for Hugging Face GPT-2 small and a small
Llama, unmodified (issue 16: ``compute.flops_per_step`` within 10% of the matmul count,
``flops_per_device`` 1/N of it at dp=N).

    python benchmarks/flops_check.py [--mesh dp=4] [--gpt-batch 8] [--gpt-seq 1024]

The matmul count of a training step is 3 x tokens x (forward matmul flops per token): the
backward pass does two matmuls for each forward one (the gradient of the input and of the
weight). Per token, forward:

    2 x (non-embedding matmul weights, LM head included)     every weight: a multiply-add
  + 2 x 2 x n_layer x seq x d                                scores q.k and weights.v

(attention counted over the whole seq x seq square, masked half included, as the kernels
compute it). Elementwise work (norms, activations, softmax, the optimizer) is not in it,
so the plan's figure is a few percent above it. Inspect builds the models on the meta
device: nothing is allocated, each plan takes seconds. Prints both figures, their ratio,
flops_per_step / flops_per_device, the ops whose cost is unknown, and the wall time."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


@dataclass(frozen=True)
class Model:
    """A model to plan and the sizes its matmul count needs."""

    label: str
    target: str            # PATH:NAME or module:NAME for diphoma inspect
    init: str
    vocab: int
    d: int
    layers: int
    batch: int
    seq: int
    matmul_weights: int    # non-embedding matmul weights, LM head included

    def matmul_flops_per_step(self) -> int:
        """3 x tokens x forward matmul flops per token."""
        per_token = 2 * self.matmul_weights + 2 * 2 * self.layers * self.seq * self.d
        return 3 * self.batch * self.seq * per_token


def gpt2_small(batch: int, seq: int) -> Model:
    """GPT2Config() defaults: 12 layers, d 768, vocab 50257, 1024 positions."""
    d, layers, vocab = 768, 12, 50257
    # per layer: qkv 3d^2, attention out d^2, MLP 4d^2 twice; the head (tied to wte) V x d
    weights = layers * 12 * d * d + vocab * d
    return Model("GPT-2 small", "transformers.models.gpt2.modeling_gpt2:GPT2LMHeadModel",
                 "GPT2LMHeadModel(GPT2Config())", vocab, d, layers, batch, seq, weights)


def small_llama(batch: int, seq: int) -> Model:
    """4 layers, hidden 512, intermediate 1376, 8 heads, vocab 32000."""
    d, inter, layers, heads, vocab = 512, 1376, 4, 8, 32000
    init = (f"LlamaForCausalLM(LlamaConfig(vocab_size={vocab}, hidden_size={d}, "
            f"intermediate_size={inter}, num_hidden_layers={layers}, "
            f"num_attention_heads={heads}, max_position_embeddings={seq}))")
    # per layer: q, k, v, o d x d (as many kv heads as heads), gate, up, down d x inter;
    # the head (not tied) V x d
    weights = layers * (4 * d * d + 3 * d * inter) + vocab * d
    return Model("Llama (small)", "transformers.models.llama.modeling_llama:LlamaForCausalLM",
                 init, vocab, d, layers, batch, seq, weights)


def plan(model: Model, mesh: str) -> tuple[dict, float]:
    """The JSON plan of ``diphoma inspect`` for the model (in this process) and its wall
    seconds."""
    from diphoma_compile.cli import main
    tokens = f"int64[{model.batch},{model.seq}]<{model.vocab}"
    out = Path(tempfile.mkdtemp()) / "plan.json"
    t0 = time.perf_counter()
    rc = main(["inspect", model.target, "--init", model.init, "--input",
               f"input_ids={tokens}", "--input", f"labels={tokens}", "--mesh", mesh,
               "--format", "json", "--out", str(out)])
    wall = time.perf_counter() - t0
    if rc != 0:
        sys.exit(f"inspect failed for {model.label} ({rc})")
    return json.loads(out.read_text()), wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mesh", default="dp=4")
    p.add_argument("--gpt-batch", type=int, default=8)
    p.add_argument("--gpt-seq", type=int, default=1024)
    p.add_argument("--llama-batch", type=int, default=8)
    p.add_argument("--llama-seq", type=int, default=512)
    a = p.parse_args()
    models = [gpt2_small(a.gpt_batch, a.gpt_seq), small_llama(a.llama_batch, a.llama_seq)]
    n = 1
    for part in a.mesh.split(","):
        n *= int(part.split("=")[1])
    print(f"mesh {a.mesh} ({n} devices); flops in TFLOP per training step")
    head = (f"{'model':<16}{'tokens':>8}{'matmul count':>14}{'plan: step':>12}{'ratio':>8}"
            f"{'plan: device':>14}{'step/device':>13}{'inspect':>10}")
    print(head)
    unknown = {}
    for m in models:
        data, wall = plan(m, a.mesh)
        c = data["compute"]
        count = m.matmul_flops_per_step()
        step, dev = c["flops_per_step"], c["flops_per_device"]
        print(f"{m.label:<16}{m.batch * m.seq:>8}{count / 1e12:>14.4f}{step / 1e12:>12.4f}"
              f"{step / count:>8.3f}{dev / 1e12:>14.4f}{step / dev:>13.4f}{wall:>9.1f}s")
        unknown[m.label] = c["unknown_cost_ops"]
        est = c["estimated_step_s"]
        print(f"{'':<16}est. {est['total'] * 1e3:.1f} ms/step on {c['device_model']} = "
              f"{est['compute'] * 1e3:.1f} ms compute + {est['exposed_comm'] * 1e3:.1f} ms "
              "exposed communication")
    for label, ops in unknown.items():
        print(f"{label}: cost unknown (counted as zero): {', '.join(ops) or 'none'}")


if __name__ == "__main__":
    main()
