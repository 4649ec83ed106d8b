"""A Hugging Face transformers model traces without modification and stays bit-exact."""

from __future__ import annotations

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import diphoma_compile  # noqa: E402
from diphoma_compile.errors import DiphomaWarning  # noqa: E402
from models import hf_lm_step as lm_step  # noqa: E402


def hf_step(model, opt, batch):
    out = model(input_ids=batch["ids"], labels=batch["ids"])
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    return out.loss


def gpt2_twins(layers: int, seed: int, steps: int):
    """A GPT-2 in training mode (dropout on, embedding tied to the LM head) and its copy,
    each with its own AdamW, and ``steps`` batches of token ids."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=128,
                                  n_positions=32, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    model.train()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed)
    data = [{"ids": torch.randint(0, 128, (2, 16), generator=g)} for _ in range(steps)]
    return model, opt, ref, ref_opt, data


def test_gpt2_lm_head_model_bit_exact():
    model, opt, ref, ref_opt, data = gpt2_twins(2, 0, 4)
    compiled = diphoma_compile.compile(hf_step, model, opt, data[0])
    names = {i.name for i in compiled.graph.inputs}
    assert "transformer.h.0.attn.c_attn.weight" in names
    for i, batch in enumerate(data):
        torch.manual_seed(i)   # GPT-2 has dropout on: both draw from the same seed
        loss = compiled(model, opt, batch)
        torch.manual_seed(i)
        assert torch.equal(loss, hf_step(ref, ref_opt, batch)), f"loss differs at step {i}"
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name


def test_gpt2_dropout_probability_changed_after_the_trace_is_warned_of():
    """Hugging Face GPT-2 as people bring it: its dropout modules read ``self.p``, which
    the trace bakes in; set between calls it is warned of, naming the attribute (the
    per-call checks found on a hand-written module in test_baked.py, here on the model
    they were written for)."""
    model, opt, _, _, data = gpt2_twins(1, 0, 2)
    compiled = diphoma_compile.compile(hf_step, model, opt, data[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error", DiphomaWarning)
        compiled(model, opt, data[0])
    model.transformer.drop.p = 0.3
    with pytest.warns(DiphomaWarning, match=r"model.transformer.drop.p: 0.1 -> 0.3 changed "
                                            "since the step was traced"):
        compiled(model, opt, data[1])


def llama_step(model, opt, sched, batch):
    out = model(input_ids=batch["ids"], labels=batch["ids"])
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    sched.step()
    return out.loss


def test_llama_with_one_cycle_inside_the_step_bit_exact():
    """OneCycleLR stepped inside the step runs on the host after each call (its lr and
    beta1, which it cycles, are graph inputs read each call): bit for bit as eager."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(cfg)
    model.train()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=6)
    ref_sched = torch.optim.lr_scheduler.OneCycleLR(ref_opt, max_lr=0.05, total_steps=6)
    g = torch.Generator().manual_seed(0)
    data = [{"ids": torch.randint(0, 64, (2, 16), generator=g)} for _ in range(4)]
    compiled = diphoma_compile.compile(llama_step, model, opt, sched, data[0])
    for i, batch in enumerate(data):
        loss = compiled(model, opt, sched, batch)
        assert torch.equal(loss, llama_step(ref, ref_opt, ref_sched, batch)), f"step {i}"
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
        assert opt.param_groups[0]["betas"] == ref_opt.param_groups[0]["betas"]
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name
    hyper = {i.name for i in compiled.graph.inputs if i.role.kind.value == "hyper"}
    assert hyper == {"lr", "beta1"}


def test_gpt2_parallelized_over_one_device_in_a_plain_process_bit_exact():
    """``parallelize(step, {"dp": 1})`` with no process group runs the single-device
    program: a Hugging Face model steps exactly as eager does (dropout seeded alike)."""
    model, opt, ref, ref_opt, data = gpt2_twins(1, 1, 3)
    pstep = diphoma_compile.parallelize(hf_step, {"dp": 1})
    for i, batch in enumerate(data):
        torch.manual_seed(i)
        loss = pstep(model, opt, batch)
        torch.manual_seed(i)
        assert torch.equal(loss, hf_step(ref, ref_opt, batch)), f"loss differs at step {i}"
    assert pstep.plan.passes == ()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name
    for p, q in zip(model.parameters(), ref.parameters()):
        for k, v in opt.state[p].items():
            assert torch.equal(v, ref_opt.state[q][k]), k


def test_gpt2_under_inductor_draws_eager_dropout_and_keeps_tied_weights(monkeypatch):
    """codegen="inductor" on GPT-2 (dropout on, embedding tied to the LM head, clipped
    AdamW): the compiled program updates the model and optimizer in place (nothing written
    back), the tied weight stays one tensor, and dropout draws eager's masks from torch's
    generator, so a seeded step matches eager to Inductor's rounding (with Inductor's own
    random numbers the masks, and so the losses, differed by 2e-3)."""
    from diphoma_compile.torch import runtime
    written = []
    write = runtime.TorchStep._write
    monkeypatch.setattr(runtime.TorchStep, "_write",
                        lambda self, slot, new: (written.append(slot.name),
                                                 write(self, slot, new)))
    model, opt, ref, ref_opt, data = gpt2_twins(1, 2, 3)
    step = diphoma_compile.compile(hf_step, model, opt, data[0], codegen="inductor")
    for i, batch in enumerate(data):
        torch.manual_seed(i)
        loss = step(model, opt, batch)
        torch.manual_seed(i)
        want = hf_step(ref, ref_opt, batch)
        assert abs(loss.item() - want.item()) <= 1e-5, (i, loss.item(), want.item())
    assert step.compile_s is not None and written == []
    assert model.lm_head.weight is model.transformer.wte.weight
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5, msg=name)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert int(opt.state[p]["step"]) == int(ref_opt.state[q]["step"]) == len(data)


def _twins(model: torch.nn.Module):
    ref = copy.deepcopy(model)
    return (model, torch.optim.AdamW(model.parameters(), lr=1e-3), ref,
            torch.optim.AdamW(ref.parameters(), lr=1e-3))


def _bit_exact(step, model, opt, ref, ref_opt, data) -> None:
    """Both steps from the same seed each call (dropout draws alike), and the generator
    left where eager leaves it."""
    compiled = diphoma_compile.compile(step, model, opt, *data[0])
    for i, batch in enumerate(data):
        torch.manual_seed(i)
        got = compiled(model, opt, *batch)
        after = torch.get_rng_state()
        torch.manual_seed(i)
        assert torch.equal(got, step(ref, ref_opt, *batch)), i
        assert torch.equal(after, torch.get_rng_state()), i
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), name
        for k, v in opt.state[p].items():
            assert torch.equal(v, ref_opt.state[q][k]), (name, k)


def mixtral(**kw):
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64, attention_dropout=0.0, **kw))


def test_mixtral_with_batched_experts_bit_exact_and_its_default_experts_named():
    """Mixtral (mixture of experts, top-2 routing) with experts_implementation="batched_mm"
    traces and stays bit for bit with eager over 3 AdamW steps (parameters and state); its
    default experts call aten._grouped_mm, whose fake kernel (which tracing runs) wants
    bf16 where the CPU kernel takes float32: refused naming the op and the way out."""
    g = torch.Generator().manual_seed(7)
    data = [(torch.randint(0, 128, (4, 16), generator=g),) for _ in range(3)]
    # a kernel of the experts' routing sums in a thread-dependent order on the CPU: two eager runs
    # differ (17 parameters by up to 8e-8 after 3 steps) unless torch runs deterministic
    # kernels, which the compiled step then matches bit for bit
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        _bit_exact(lm_step, *_twins(mixtral(experts_implementation="batched_mm")), data)
    finally:
        torch.use_deterministic_algorithms(was)
    model = mixtral()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    try:
        diphoma_compile.compile(lm_step, model, opt, *data[0])
    except diphoma_compile.DiphomaError as e:        # as of torch 2.13, transformers 5.25
        assert "aten._grouped_mm" in str(e) and "batched_mm" in str(e), str(e)


def test_whisper_encoder_decoder_bit_exact():
    """Whisper (an encoder over audio features, a decoder with cross-attention) traces and
    stays bit for bit with eager over 3 AdamW steps."""
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(
        vocab_size=128, num_mel_bins=8, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_source_positions=8, max_target_positions=32, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=1))

    def step(model, opt, feats, dec, labels):
        out = model(input_features=feats, decoder_input_ids=dec, labels=labels)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        return out.loss
    g = torch.Generator().manual_seed(7)
    data = [(torch.randn(2, 8, 16, generator=g), torch.randint(3, 128, (2, 8), generator=g),
             torch.randint(3, 128, (2, 8), generator=g)) for _ in range(3)]
    _bit_exact(step, *_twins(model), data)


def padded_step(model, opt, ids, mask, labels):
    out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
    out.loss.backward()
    opt.step()
    opt.zero_grad()
    return out.loss


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_gpt2_with_a_padding_mask_and_no_cache_bit_exact(checkpointing):
    """A batch padded on the right (``attention_mask``, labels -100 at the padding),
    ``use_cache=False``, and gradient checkpointing: transformers asks ``is_tracing`` of
    the mask before reading it on the host, which it now answers True for the step's
    traced tensors (torch/library_hooks.py); before, each was refused as a branch on
    tensor data. Dropout on: checkpointing recomputes each block in backward from the
    generator state saved before its forward, and the program reads the forward's masks
    there (torch/rng_replay.py); it drew other masks before, 2e-3 off eager."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=128,
                                  n_positions=32)
    model = transformers.GPT2LMHeadModel(cfg)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    g = torch.Generator().manual_seed(1)
    data = []
    for k in range(3):
        ids = torch.randint(0, 128, (2, 16), generator=g)
        mask = torch.ones(2, 16, dtype=torch.long)
        mask[1, 12 - k:] = 0
        data.append((ids, mask, ids.masked_fill(mask == 0, -100)))
    _bit_exact(padded_step, *_twins(model), data)


def halves_lm_step(model, opt, batch):
    """Gradient accumulation inside the step over two halves, each Hugging Face's own
    loss (a mean over its kept labels), as a review wrote it."""
    h = batch["ids"].shape[0] // 2
    total = 0.0
    for part in (slice(0, h), slice(h, None)):
        loss = model(input_ids=batch["ids"][part], labels=batch["ids"][part]).loss
        (loss / 2).backward()
        total = total + loss.detach() / 2
    opt.step()
    opt.zero_grad()
    return total


def test_gpt2_halves_of_one_row_are_judged_at_more_rows():
    """At two rows a device each half is one row, and GPT-2's position embedding
    (1, S, E) added to it was taken for a value per row: the step was warned of as
    combining examples at modeling_gpt2.py's add, and its counts left per device (0.0175
    off the single-device loss at dp=4 with num_items_in_batch; a review's probe,
    2026-12-07). Judged on the step traced at more rows: only the halves' own counts are
    warned of, as at four rows a device."""
    model, opt, _, _, data = gpt2_twins(1, 0, 1)
    model.eval()                     # no dropout: the plan alone is judged here
    pstep = diphoma_compile.parallelize(halves_lm_step, {"dp": 2})
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        pstep.trace(model, opt, data[0])
    said = [str(x.message) for x in w if issubclass(x.category, DiphomaWarning)]
    assert len(said) == 1 and said[0].startswith(
        "the step's forward divides by counts of parts of its batch"), said
    assert pstep.plan.notes["data-parallel"]["batch_coupled"] == []
