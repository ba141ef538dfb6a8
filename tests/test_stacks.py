"""The stack catalog (`--stack`) and what the trl and peft-kbit facts change in the estimate.

The differences against lorafit's own stack are written out from the shapes, term by term, as
docs/memory-model.md derives them ("Other trainers' steps"); the real CPU steps at the end run each stack's own
trainer under the live-tensor tracker (bench/stack_trace.py) and hold the estimate to 2 % of them.
"""

import importlib
import sys
from pathlib import Path

import pytest

from lorafit import memory, stacks
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
    n, layers, h = 2048, spec.num_hidden_layers, spec.hidden_size
    settings = dict(method="qlora", quant="nf4", micro_batch=1, seq_len=n, grad_ckpt=grad_ckpt)
    ours, ours_phase = allocated("llama-3.1-8b", "lorafit", **settings)
    kbit, kbit_phase = allocated("llama-3.1-8b", "peft-kbit", **settings)
    assert ours_phase == kbit_phase == "loss (LM head backward)"
    not_packed = spec.num_params - layers * spec.layer_linear_params
    upcast = not_packed * (4 - C)
    stream = layers * n * (2 * h if grad_ckpt else 3 * (4 - C) * spec.intermediate_size)
    head_copy = C * spec.vocab_size * h
    assert kbit - ours == pytest.approx(upcast + stream + head_copy)


def test_peft_kbit_without_autocast_keeps_the_attention_in_fp32() -> None:
    """The peft QLoRA recipe in a plain loop (--no-autocast): bitsandbytes hands q, k and v back in the fp32
    stream's dtype and nothing casts them down, so SDPA saves q, k, v and its output in fp32. Against the same
    step with a bf16 stream, a layer saves per token 2 more bytes for each of q, k (GQA: kv wide), v and the
    output, plus SwiGLU's three intermediate-sized tensors in fp32 (3 x 2 x I)."""
    spec = resolve("llama-3.1-8b")
    chosen = Settings(method="qlora", micro_batch=1, seq_len=1024, grad_ckpt=False, autocast=False, stack="peft-kbit")
    fp32 = memory.stack_runtime(chosen)
    bf16 = fp32.model_copy(update={"fp32_stream": False})
    per_token = 2 * (2 * spec.q_size + 2 * spec.kv_size) + 3 * (4 - C) * spec.intermediate_size
    extra = memory.activation_bytes_per_layer(spec, chosen, fp32) - memory.activation_bytes_per_layer(
        spec, chosen, bf16
    )
    assert extra == pytest.approx(per_token * 1024)
    # under autocast (the Trainer's bf16=True) the attention runs in bf16: only SwiGLU's tensors stay fp32
    mixed = chosen.model_copy(update={"autocast": True})
    fp32, bf16 = memory.stack_runtime(mixed), memory.stack_runtime(mixed).model_copy(update={"fp32_stream": False})
    extra = memory.activation_bytes_per_layer(spec, mixed, fp32) - memory.activation_bytes_per_layer(spec, mixed, bf16)
    assert extra == pytest.approx(3 * (4 - C) * spec.intermediate_size * 1024)


def test_the_peft_kbit_plain_loop_keeps_the_first_layers_input_gradient() -> None:
    """The peft QLoRA scripts' loop calls enable_input_require_grads: without checkpointing the first layer then
    saves what every other layer does, its input norm's fp32 input and rsqrt (4h + 4) and the q, k, v adapters'
    dropout masks (1 byte x h each). The Trainer's path (autocast) calls it only with checkpointing."""
    spec = resolve("llama-2-7b")
    n, h = 2048, spec.hidden_size
    settings = dict(method="qlora", quant="nf4", micro_batch=1, seq_len=n, grad_ckpt=False, autocast=False)
    loop, phase = allocated("llama-2-7b", "peft-kbit", **settings)
    chosen = Settings(**settings).model_copy(update={"stack": "peft-kbit"})
    without = memory.stack_runtime(chosen).model_copy(update={"input_grads": False})
    assert phase == "loss (LM head backward)"
    assert loop - sum(memory.breakdown(spec, chosen, without)[0].values()) == pytest.approx(n * (4 * h + 4 + 3 * h))
    assert not memory.stack_runtime(chosen.model_copy(update={"autocast": None})).input_grads


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


# --- each stack's own step on the CPU ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stack_trace():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("stack_trace")
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.slow
@pytest.mark.parametrize("grad_ckpt", [True, False])
def test_the_peft_kbit_plain_loop_estimate_is_within_2_percent_of_its_cpu_step(grad_ckpt: bool, stack_trace) -> None:
    """The peft QLoRA recipe's own plain loop (kbit preparation with non-reentrant checkpointing,
    enable_input_require_grads, torch.optim.AdamW, no autocast) on a small random Llama (2 layers, hidden 256,
    real 4-bit base, 2 x 256 tokens) on the CPU, against `--stack peft-kbit --no-autocast --no-fused-optimizer`."""
    name = f"peft-kbit loop cpu small-a qlora b2x256 {'ckpt' if grad_ckpt else 'no-ckpt'}"
    (case,) = [case for case in stack_trace.cases() if case.name == name]
    traced = stack_trace.trace(case)
    predicted, _ = stack_trace.estimate_bytes(case)
    assert predicted == pytest.approx(traced.peak_bytes, rel=0.02), (
        f"estimate {predicted / 2**20:.1f} MiB, traced {traced.peak_bytes / 2**20:.1f} MiB ({traced.phase})"
    )


@pytest.mark.slow
@pytest.mark.parametrize("stack", ["trl", "peft-kbit"])
def test_the_estimate_is_within_2_percent_of_the_stacks_own_cpu_step(stack: str, stack_trace) -> None:
    """A real SFTTrainer / Trainer.train() of two steps of a small random Llama (4 layers, hidden 512, 4-bit
    base, 1 x 1024 tokens) on the CPU, every live tensor counted, against `Runtime(device="cpu")`."""
    (case,) = [case for case in stack_trace.cases() if case.name == f"{stack} cpu small-c qlora b1x1024 no-ckpt"]
    traced = stack_trace.trace(case)
    predicted, _ = stack_trace.estimate_bytes(case)
    assert predicted == pytest.approx(traced.peak_bytes, rel=0.02), (
        f"estimate {predicted / 2**20:.1f} MiB, traced {traced.peak_bytes / 2**20:.1f} MiB ({traced.phase})"
    )
    assert traced.peak_bytes < 0.5 * GIB  # small enough for a test
