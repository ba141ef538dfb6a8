"""The stack catalog (`--stack`) and what the trl and peft-kbit facts change in the estimate.

The differences against lorafit's own stack are written out from the shapes, term by term, as
docs/memory-model.md derives them ("Other trainers' steps"); the real CPU steps at the end run each stack's own
trainer under the live-tensor tracker (bench/stack_trace.py) and hold the estimate to 2 % of them.
"""

import importlib
import json
import sys
from pathlib import Path

import pytest

from conftest import run_cli
from lorafit import memory, stacks
from lorafit.errors import InvalidConfig
from lorafit.memory import GIB
from lorafit.models import resolve
from lorafit.options import Stack
from lorafit.schema import Settings

BENCH = Path(__file__).resolve().parents[1] / "bench"
C = 2  # bf16
FUSED_TILE, FUSED_CHUNK = 4096, 32768  # trl/kernels/chunked_logprob.py TOKEN_CHUNK_SIZE, the head's vocabulary chunk


def test_the_catalog_lists_every_stack_the_option_offers() -> None:
    assert set(stacks.catalog()) == set(Stack.__args__)


@pytest.mark.parametrize("name", list(stacks.catalog()))
def test_every_stack_fact_is_a_runtime_field(name: str) -> None:
    stack = stacks.catalog()[name]
    for quantized in (True, False):
        facts = stack.facts(quantized)
        assert set(facts) <= set(memory.Runtime.model_fields), set(facts) - set(memory.Runtime.model_fields)
        memory.Runtime(**facts)  # and each value is one the field takes


@pytest.mark.parametrize("name", ["trl", "peft-kbit"])
def test_the_traced_stacks_say_what_they_keep_and_where_that_is_read(name: str) -> None:
    stack = stacks.resolve(name)
    assert stack.keeps and not any("to be derived" in line for line in stack.keeps)
    assert stack.sources and all(" @ " in source for source in stack.sources)
    assert "make bench-stacks" in stack.traced
    assert "trl 1.16.0" in stack.pinned or name != "trl"


def allocated(spec_name: str, stack: str, **settings: object) -> tuple[float, str]:
    """The allocated peak (bytes) and its phase, as `lorafit estimate --stack` sums it."""
    spec = resolve(spec_name)
    chosen = Settings(**settings).model_copy(update={"stack": stack})
    parts, phase = memory.breakdown(spec, chosen, memory.stack_runtime(chosen))
    return sum(parts.values()), phase


def fused_head_by_hand(hidden: int, micro_batch: int, seq_len: int) -> int:
    """TRL's fused LM head at its backward on CUDA: the gathered hidden states it saved (c x h per scored token),
    its tile buffer (4096 tokens x 32768 vocabulary entries), the fp32 gradient of the hidden states and that
    gradient's cast back to bf16."""
    scored = micro_batch * (seq_len - 1)
    return C * hidden * scored + min(scored, FUSED_TILE) * FUSED_CHUNK * C + 4 * hidden * scored + C * hidden * scored


@pytest.mark.parametrize("method", ["qlora", "lora"])
def test_trl_replaces_the_fp32_logits_by_its_fused_head(method: str) -> None:
    """Llama-3.1-8B at 2048 tokens without checkpointing peaks at the loss under both stacks. TRL's step holds
    the fused head instead of 12 x V bytes per token of fp32 logits, and over a 4-bit base casts the adapters to
    bf16 (adapters and their two AdamW moments: 2 + 2 x 2 bytes less per parameter; no gradient is alive yet)."""
    spec = resolve("llama-3.1-8b")
    settings = dict(method=method, quant="nf4" if method == "qlora" else "none", micro_batch=1, seq_len=2048)
    ours, ours_phase = allocated("llama-3.1-8b", "lorafit", grad_ckpt=False, **settings)
    trl, trl_phase = allocated("llama-3.1-8b", "trl", grad_ckpt=False, **settings)
    assert ours_phase == trl_phase == "loss (LM head backward)"
    trainable = spec.lora_params(16, "all")
    adapters = trainable * (2 + 2 * 2) if method == "qlora" else 0
    logits = 12 * spec.vocab_size * 2048
    assert ours - trl == pytest.approx(adapters + logits - fused_head_by_hand(spec.hidden_size, 1, 2048))


@pytest.mark.parametrize("grad_ckpt", [False, True])
def test_peft_kbit_qlora_adds_the_fp32_upcast_terms(grad_ckpt: bool) -> None:
    """peft's prepare_model_for_kbit_training over a 4-bit Llama-3.1-8B: every parameter that is not packed goes
    from 2 to 4 bytes; the residual stream is fp32, so without checkpointing SwiGLU saves gate, silu(gate) and up
    in fp32 (3 x 2 more bytes x I per token and layer) and with checkpointing each layer's saved input is fp32
    (2 more bytes x h); and the head's matmul saves a bf16 copy of its fp32 weight (2 x V x h) through the loss."""
    spec = resolve("llama-3.1-8b")
    n, layers = 2048, spec.num_hidden_layers
    settings = dict(method="qlora", quant="nf4", micro_batch=1, seq_len=n, grad_ckpt=grad_ckpt)
    ours, ours_phase = allocated("llama-3.1-8b", "lorafit", **settings)
    kbit, kbit_phase = allocated("llama-3.1-8b", "peft-kbit", **settings)
    assert ours_phase == kbit_phase == "loss (LM head backward)"
    not_packed = spec.num_params - layers * spec.layer_linear_params
    upcast = not_packed * (4 - C)
    stream = layers * n * (2 * spec.hidden_size if grad_ckpt else 3 * (4 - C) * spec.intermediate_size)
    head_copy = C * spec.vocab_size * spec.hidden_size
    assert kbit - ours == pytest.approx(upcast + stream + head_copy)


def test_peft_kbit_over_a_16_bit_base_is_lorafits_step() -> None:
    """Without a quantised base there is nothing to prepare: the Trainer + peft LoRA step is lorafit's own."""
    settings = dict(method="lora", quant="none", micro_batch=2, seq_len=1024)
    for grad_ckpt in (False, True):
        ours = allocated("llama-2-7b", "lorafit", grad_ckpt=grad_ckpt, **settings)
        assert allocated("llama-2-7b", "peft-kbit", grad_ckpt=grad_ckpt, **settings) == ours


def test_the_estimate_follows_the_stack() -> None:
    """What `lorafit estimate --stack` prints: peft-kbit's QLoRA needs more than lorafit's, TRL's less."""
    spec = resolve("llama-3.1-8b")
    peaks = {
        name: memory.estimate(spec, Settings(method="qlora", seq_len=2048, stack=name)).peak_allocated_gib
        for name in ("lorafit", "trl", "peft-kbit")
    }
    assert peaks["trl"] < peaks["lorafit"] < peaks["peft-kbit"]


# --- Liger's kernels (--liger) -----------------------------------------------------------------------------------
def liger_loss_by_hand(hidden: int, vocab: int, tokens: int) -> int:
    """Liger's fused linear cross-entropy in its forward (fused_linear_cross_entropy.py @ v0.8.2): the hidden
    states and their gradient (c x h per token each), one chunk of next_pow2(tokens / ceil(V / h)) tokens'
    logits and input gradient, and the fp32 per-token losses."""
    per_chunk = -(-tokens // -(-vocab // hidden))
    chunk = min(tokens, 1 << (per_chunk - 1).bit_length())
    return 2 * C * hidden * tokens + C * (vocab + hidden) * chunk + 4 * tokens


@pytest.mark.parametrize("stack", ["lorafit", "llama-factory"])
def test_liger_replaces_the_fp32_logits_by_its_fused_loss(stack: str) -> None:
    """A Trainer with use_liger_kernel: Liger's fused linear cross-entropy in place of 12 x V bytes per token of
    fp32 logits (Llama-3.1-8B, 2048 tokens: a chunk of 64 tokens), and its final RMSNorm saves its bf16 input
    (2h + 4 per token) instead of an fp32 copy (4h + 4). The loss no longer makes the peak: the backward through
    the layers does."""
    spec = resolve("llama-3.1-8b")
    h, n = spec.hidden_size, 2048
    settings = dict(method="qlora", micro_batch=1, seq_len=n, grad_ckpt=True)
    plain, liger = Settings(stack=stack, **settings), Settings(stack=stack, liger=True, **settings)
    on, off = memory.stack_runtime(liger), memory.stack_runtime(plain)
    assert memory.logits_bytes(spec, plain, off) == 12 * spec.vocab_size * n
    assert memory.logits_bytes(spec, liger, on) == liger_loss_by_hand(h, spec.vocab_size, n)
    assert liger_loss_by_hand(h, spec.vocab_size, n) < 0.02 * 12 * spec.vocab_size * n
    assert memory.head_saved_bytes(spec, plain, off) - memory.head_saved_bytes(spec, liger, on) == (4 - C) * h * n
    assert allocated("llama-3.1-8b", stack, **settings)[1] == "loss (LM head backward)"
    assert allocated("llama-3.1-8b", stack, liger=True, **settings)[1] == "backward through the last layers"


def test_liger_under_trl_keeps_its_fused_head_and_saves_less_in_the_layers() -> None:
    """TRL 1.16's SFTTrainer turns Liger's fused cross-entropy off and keeps its own fused head; the layer
    kernels stay. Without checkpointing every layer but the first saves, per token, its two norms' inputs in bf16
    (2h + 4 each, not 4h + 4) and SwiGLU gate and up (2 x 2 x I, not 3 x 2 x I): 4h + 2I less; the first layer's
    input norm saves nothing either way (frozen embeddings)."""
    spec = resolve("llama-3.1-8b")
    h, inter, n, layers = spec.hidden_size, spec.intermediate_size, 1024, spec.num_hidden_layers
    trl = Settings(stack="trl", liger=True)
    assert memory.stack_runtime(trl).loss == "fused_logprob" and memory.stack_runtime(trl).liger_kernels
    settings = dict(method="lora", quant="none", micro_batch=1, seq_len=n, grad_ckpt=False)
    plain = memory.activation_bytes(
        spec, Settings(stack="trl", **settings), memory.stack_runtime(trl.model_copy(update={"liger": None}))
    )
    liger = memory.activation_bytes(spec, Settings(stack="trl", **settings), memory.stack_runtime(trl))
    first_layer_norm = (4 - C) * h
    assert plain - liger == pytest.approx(n * (layers * (2 * (4 - C) * h + C * inter) - first_layer_norm))


def test_liger_is_refused_for_a_stack_without_the_switch_and_with_the_chunked_loss(capsys) -> None:
    code, _, err = run_cli(["estimate", "--stack", "litgpt", "--liger"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert "litgpt has no use_liger_kernel switch" in err and "trl" in err and "llama-factory" in err
    code, _, err = run_cli(["estimate", "--liger", "--loss", "chunked"], capsys)
    assert code == 2 and "loss chunked" in err and "leave loss full" in err
    code, _, _ = run_cli(["estimate", "--stack", "litgpt", "--no-liger"], capsys)
    assert code == 0
    code, _, err = run_cli(["estimate", "--liger", "--exact"], capsys)
    assert code == 2 and "does not run Liger's Triton kernels" in err


def test_liger_is_refused_for_a_model_type_it_does_not_patch() -> None:
    """Liger 0.8.2 patches the families it lists by config.json model type; another trains without its kernels."""
    llama = resolve("llama-3.1-8b")
    stacks.check_liger_model(llama.arch.model_types, llama.name)
    with pytest.raises(
        InvalidConfig, match="does not patch falcon-7b .model type falcon.; it patches 50 model types, llama"
    ):
        stacks.check_liger_model(("falcon",), "falcon-7b")


# --- RoPE scaling past the trained context ---------------------------------------------------------------------
def test_a_sequence_past_the_trained_context_is_refused_for_a_stack_that_does_not_scale(capsys) -> None:
    code, _, err = run_cli(["plan", "-m", "llama-2-7b", "--gpu", "A100 80GB", "--seq-len", "8192"], capsys)
    scaling = [s.name for s in stacks.offered() if s.rope_scaling]
    assert code == 2 and err.count("\n") == 1
    assert "past llama-2-7b's maximum of 4096 tokens" in err and "stack lorafit does not scale RoPE" in err
    assert "llama-factory" in scaling and all(name in err for name in scaling)


@pytest.mark.parametrize("seq_len, factor", [(8192, 2), (10000, 3)])
def test_a_stack_that_scales_rope_trains_past_the_trained_context(seq_len: int, factor: int, capsys) -> None:
    """LLaMA-Factory's configure_rope stretches the positions by ceil(length / max_position_embeddings); the plan
    says so in one line and estimates the step at the asked length (not cut to the model's 4096)."""
    args = ["plan", "-m", "llama-2-7b", "--gpu", "A100 80GB", "--seq-len", str(seq_len), "--stack", "llama-factory"]
    code, out, _ = run_cli(args + ["--json"], capsys)
    plan = json.loads(out)
    assert code == 0 and plan["settings"]["seq_len"] == seq_len
    line = [reason for reason in plan["reasons"] if "RoPE" in reason]
    assert line == [
        f"sequence length {seq_len} is past llama-2-7b's 4096 trained positions: stack llama-factory scales RoPE "
        f"by a factor of {factor} (rope_scaling) to reach it"
    ]
    for stack in stacks.catalog().values():
        assert stack.rope_scaling == bool(stack.rope_scaling_source), stack.name


# --- each stack's own step on the CPU ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stack_trace():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("stack_trace")
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.slow
@pytest.mark.parametrize("stack", ["trl", "peft-kbit", "trl --liger"])
def test_the_estimate_is_within_2_percent_of_the_stacks_own_cpu_step(stack: str, stack_trace) -> None:
    """A real SFTTrainer / Trainer.train() of two steps of a small random Llama (4 layers, hidden 512, 4-bit
    base, 1 x 1024 tokens) on the CPU, every live tensor counted, against `Runtime(device="cpu")`; with --liger,
    Liger's layer kernels stood in by torch functions that keep what Liger's keep (bench/liger_standins.py)."""
    name, liger = stack.removesuffix(" --liger"), " liger" if stack.endswith("--liger") else ""
    (case,) = [case for case in stack_trace.cases() if case.name == f"{name} cpu small-c qlora b1x1024 no-ckpt{liger}"]
    traced = stack_trace.trace(case)
    predicted, _ = stack_trace.estimate_bytes(case)
    assert predicted == pytest.approx(traced.peak_bytes, rel=0.02), (
        f"estimate {predicted / 2**20:.1f} MiB, traced {traced.peak_bytes / 2**20:.1f} MiB ({traced.phase})"
    )
    assert traced.peak_bytes < 0.5 * GIB  # small enough for a test


def test_the_liger_standins_keep_what_liger_keeps_for_backward(stack_trace) -> None:
    """One bf16 Llama decoder layer (frozen weights, an input that needs its gradient), its saved tensors
    counted by storage: with the stand-ins of Liger's RMSNorm, SwiGLU and rotary it keeps 4h + 2I bytes per
    token less - two norms' inputs in bf16 instead of fp32 copies (2 x 2h) and gate and up without silu(gate)
    (2I) - which is what memory.activation_parts_per_token takes off under liger_kernels. In fp32 the same layer
    gives its input the same gradient either way."""
    import contextlib

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import liger_standins

    h, inter, n = 256, 704, 128
    config = LlamaConfig(
        hidden_size=h, intermediate_size=inter, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).requires_grad_(False)
    x, weights = torch.randn(1, n, h), torch.randn(1, n, h)

    def run(patched: bool, dtype: torch.dtype) -> tuple[int, torch.Tensor]:
        storages: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        model.to(dtype)
        given = x.to(dtype).requires_grad_()
        positions = torch.arange(n)[None]
        patch = liger_standins.liger_kernels() if patched else contextlib.nullcontext()
        with patch, torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = model.model.layers[0](given, position_embeddings=model.model.rotary_emb(given, positions))
            (out.float() * weights).sum().backward()
        assert given.grad is not None
        return sum(storages.values()), given.grad

    assert run(False, torch.bfloat16)[0] - run(True, torch.bfloat16)[0] == (4 * h + 2 * inter) * n
    assert torch.allclose(run(True, torch.float32)[1], run(False, torch.float32)[1], rtol=1e-4, atol=1e-5)
