"""The stack catalog (`--stack`) and what the trl and peft-kbit facts change in the estimate.

The differences against lorafit's own stack are written out from the shapes, term by term, as
docs/memory-model.md derives them ("Other trainers' steps"); the real CPU steps at the end run each stack's own
trainer under the live-tensor tracker (bench/stack_trace.py) and hold the estimate to 2 % of them.
"""

import json
from pathlib import Path

import pytest

from conftest import bench_module, run_cli
from lorafit import memory, stacks
from lorafit.errors import InvalidConfig
from lorafit.memory import GIB
from lorafit.models import resolve
from lorafit.options import Stack
from lorafit.schema import Settings

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
    bf16 = fp32.model_copy(update={"fp32_stream": False, "fp32_norms": False})
    per_token = 2 * (2 * spec.q_size + 2 * spec.kv_size) + 3 * (4 - C) * spec.intermediate_size
    extra = memory.activation_bytes_per_layer(spec, chosen, fp32) - memory.activation_bytes_per_layer(
        spec, chosen, bf16
    )
    assert extra == pytest.approx(per_token * 1024)
    # under autocast (the Trainer's bf16=True) the attention runs in bf16: only SwiGLU's tensors stay fp32
    mixed = chosen.model_copy(update={"autocast": True})
    fp32 = memory.stack_runtime(mixed)
    bf16 = fp32.model_copy(update={"fp32_stream": False, "fp32_norms": False})
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
    yield from bench_module("stack_trace")


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


# --- Unsloth: estimated from its source (it needs a GPU to import) --------------------------------------------
UNSLOTH_STEP = dict(method="qlora", micro_batch=2, seq_len=2048, lora_dropout=0.0, optimizer="adamw_8bit")


def test_unsloth_keeps_less_than_lorafit_and_trl_for_the_same_step() -> None:
    """Its checkpoints in host memory: the same QLoRA step keeps less activation memory on the GPU than under
    lorafit's trainer or TRL (and, with its chunked loss, less in all than lorafit's fp32 logits), and the
    offloaded layer inputs (all but the last, c x h per token each) are counted in host memory instead."""
    spec = resolve("llama-3.1-8b")
    kept = {}
    for name in ("lorafit", "trl", "unsloth"):
        step = Settings(stack=name, **UNSLOTH_STEP)
        kept[name] = memory.activation_bytes(spec, step, memory.stack_runtime(step))
    assert kept["unsloth"] < kept["trl"] and kept["unsloth"] < kept["lorafit"]
    assert (
        allocated("llama-3.1-8b", "unsloth", **UNSLOTH_STEP)[0]
        < allocated("llama-3.1-8b", "lorafit", **UNSLOTH_STEP)[0]
    )
    chosen = Settings(stack="unsloth", **UNSLOTH_STEP)
    runtime = memory.stack_runtime(chosen)
    on_gpu = memory.activation_bytes(spec, chosen, runtime)
    assert on_gpu == 3 * C * spec.hidden_size * 2 * 2048  # the last layer's input and the two copy buffers
    host = (spec.num_hidden_layers - 1) * C * spec.hidden_size * 2 * 2048
    assert memory.offloaded_activation_bytes(spec, chosen, runtime) == host


def test_unsloth_loss_holds_no_logits_of_the_whole_micro_batch() -> None:
    """Its fused cross-entropy: the hidden states' gradient (N x h) and one chunk's logits; the chunks are cut so
    that each one's fp32 logits stay under 4 GiB (8 chunks for 16 x 4096 tokens of a 128k vocabulary)."""
    spec = resolve("llama-3.1-8b")
    big = Settings(stack="unsloth", **(UNSLOTH_STEP | dict(micro_batch=16, seq_len=4096)))
    n = 16 * 4096
    assert memory.unsloth_chunk_tokens(spec, big) == n // 8
    loss = memory.logits_bytes(spec, big, memory.stack_runtime(big))
    assert loss == C * spec.hidden_size * n + 8 * spec.vocab_size * (n // 8)  # twice a chunk's fp32 logits
    assert loss < 12 * spec.vocab_size * n / 4  # a quarter of the HF loss's fp32 logits and gradients


def test_unsloth_lora_kernels_need_dropout_0() -> None:
    """With lora_dropout above 0 Unsloth keeps peft's LoRA modules, which save more per layer."""
    spec = resolve("llama-3.1-8b")
    layer = {}
    for dropout in (0.0, 0.05):
        chosen = Settings(stack="unsloth", **(UNSLOTH_STEP | dict(lora_dropout=dropout)))
        layer[dropout] = memory.activation_bytes_per_layer(spec, chosen, memory.stack_runtime(chosen))
    assert layer[0.0] < layer[0.05]


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--quant", "int8"], "quant nf4"),
        (["--method", "full"], "method qlora or lora"),
        (["--n-gpus", "2", "--shard", "fsdp"], "ddp"),
        (["--model", "phi-3-mini"], "llama, mistral"),
        (["--offload-activations"], "stacks that do: lorafit"),
    ],
)
def test_unsloth_refuses_what_it_does_not_run_in_one_line(args: list[str], names: str, capsys) -> None:
    from conftest import run_cli

    given = ["estimate", "--model", "llama-3.1-8b", "--method", "qlora", "--stack", "unsloth"]
    code, _, err = run_cli([*given, *args], capsys)
    assert code == 2 and err.count("\n") == 1 and names in err, err


def test_lorafit_train_says_unsloth_is_plan_and_estimate_only(tmp_path: Path, capsys) -> None:
    from conftest import run_cli

    config = tmp_path / "plan.yaml"
    config.write_text("model: llama-3.1-8b\nstack: unsloth\n")
    code, _, err = run_cli(["train", str(config)], capsys)
    assert code == 2 and "plans and estimates it only" in err and "FastLanguageModel" in err, err
    code, _, err = run_cli(["train", "--stack", "unsloth"], capsys)
    assert code == 2 and "lorafit train runs its own trainer" in err, err


@pytest.fixture(scope="module")
def accuracy():
    yield from bench_module("memory_accuracy")


def test_the_unsloth_calibration_rows_load_and_route_to_the_stack(accuracy) -> None:
    rows = [row for row in accuracy.read_rows(accuracy.DEFAULT_CSV) if row.id.startswith(("USN-", "USC-"))]
    assert len(rows) == 38 and {row.raw["stack"] for row in rows} == {"unsloth"}
    for row in rows:
        spec = accuracy.resolve_model(row.raw["model"])
        mapping = accuracy.map_row(row, spec)
        assert mapping.settings.stack == "unsloth" and mapping.runtime.offloaded_checkpoints
        assert mapping.gpu is not None  # its loss sizes its chunks by the row's card


def test_unsloth_cuts_its_loss_in_more_chunks_on_a_smaller_gpu() -> None:
    """Its chunks hold at most half the memory free at the loss: on an 8 GB card the same step's loss is a few
    hundred MiB, on an 80 GB one the fp32 logits of the whole micro-batch fit one chunk."""
    spec = resolve("llama-3.1-8b")
    step = Settings(stack="unsloth", **(UNSLOTH_STEP | dict(micro_batch=1, seq_len=4096)))
    runtime = memory.stack_runtime(step)
    small, big = (memory.logits_bytes(spec, step, runtime, gib * GIB) for gib in (8, 80))
    assert memory.unsloth_chunk_tokens(spec, step, memory.unsloth_chunk_target(spec, step, runtime, 80 * GIB)) == 4096
    assert small < big / 3
    assert memory.unsloth_chunk_target(spec, step, runtime, 8 * GIB) < 1 * GIB


def test_unsloth_s_own_default_dropout_0_applies_unless_given(capsys) -> None:
    """get_peft_model's lora_dropout is 0 (which its LoRA kernels need); lorafit's own default stays 0.05."""
    from conftest import run_cli

    base = ["estimate", "--model", "llama-3.1-8b", "--method", "qlora", "--json"]
    dropout = {}
    for name, extra in {
        "unsloth": ["--stack", "unsloth"],
        "lorafit": [],
        "given": ["--stack", "unsloth", "--lora-dropout", "0.1"],
    }.items():
        code, out, _ = run_cli([*base, *extra], capsys)
        assert code == 0
        dropout[name] = json.loads(out)["settings"]["lora_dropout"]
    assert dropout == {"unsloth": 0.0, "lorafit": 0.05, "given": 0.1}


def test_unsloth_keeps_checkpoints_under_2_mib_on_the_gpu() -> None:
    """Below MINIMUM_SIZE (2 MiB a layer input) Unsloth's checkpointing offloads nothing."""
    spec = resolve("llama-3.1-8b")  # 4096 x 2 bytes a token: 256 tokens are exactly 2 MiB
    for tokens, on_host in ((256, False), (512, True)):
        step = Settings(stack="unsloth", **(UNSLOTH_STEP | dict(micro_batch=1, seq_len=tokens)))
        runtime = memory.stack_runtime(step)
        assert (memory.offloaded_activation_bytes(spec, step, runtime) > 0) is on_host
        layers = 3 if on_host else spec.num_hidden_layers
        assert memory.activation_bytes(spec, step, runtime) == layers * C * spec.hidden_size * tokens


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


def test_unsloth_reads_the_free_memory_once_before_any_optimizer_state_or_gradient() -> None:
    """_get_chunk_multiplier is functools.cache'd: the free memory it halves is read at the first micro-batch's
    loss, before the optimizer's first step makes its states and before any gradient, so neither changes it."""
    spec = resolve("llama-3.1-8b")
    targets = set()
    for optimizer, grad_accum in (("adamw", 1), ("adamw", 8), ("adamw_8bit", 1), ("sgd", 4)):
        step = Settings(stack="unsloth", **(UNSLOTH_STEP | dict(optimizer=optimizer, grad_accum=grad_accum)))
        targets.add(memory.unsloth_chunk_target(spec, step, memory.stack_runtime(step), 12 * GIB))
    assert len(targets) == 1 and 0 < targets.pop() < 4 * GIB


def test_unsloth_before_its_cap_scores_the_whole_micro_batch_in_one_chunk() -> None:
    """Before unsloth_zoo capped the chunk target (d9fe1f43, 2026-07), a chunk could hold half the free memory and
    the count was rounded to the nearest multiple of 4: Gemma 3 27B's 2 x 2048 tokens on a 40 GB card are one
    chunk (16 GiB of fp32 logits and their gradient at once), where the pinned version cuts them in 4."""
    spec = resolve("gemma-3-27b")
    step = Settings(stack="unsloth", **(UNSLOTH_STEP | dict(lora_r=8)))
    capped = memory.stack_runtime(step)
    before = capped.model_copy(update={"fused_chunk_sizing": "half_free"})
    n = step.tokens_per_micro_batch
    fp32_logits = 4 * spec.vocab_size * n
    target = memory.unsloth_chunk_target(spec, step, before, 40 * GIB)
    assert target > fp32_logits / 2  # under half a chunk over: rounded to no split at all
    assert memory.unsloth_chunk_tokens(spec, step, target, "half_free") == n
    assert memory.unsloth_chunk_tokens(spec, step, memory.unsloth_chunk_target(spec, step, capped, 40 * GIB)) == n // 4
    loss = memory.logits_bytes(spec, step, before, 40 * GIB)
    assert loss == C * spec.hidden_size * n + 2 * fp32_logits
    assert loss > 3 * memory.logits_bytes(spec, step, capped, 40 * GIB)
    # rounded to the nearest multiple of 4: 5 targets' worth of logits is 4 chunks, 7 is 8
    for targets, chunks in ((5, 4), (7, 8)):
        assert memory.unsloth_chunk_tokens(spec, step, fp32_logits / targets, "half_free") == n // chunks


def test_unsloth_s_earlier_losses_by_release() -> None:
    """Up to 2024-11 its Triton cross-entropy kept the whole micro-batch's logits in the compute dtype and wrote
    their gradient over them, and the model returned them, which the Trainer's mixed precision copies to fp32;
    from then until the fused loss, Apple's cut cross-entropy kept no logits for a micro-batch of more than 1024
    tokens (and returned none; below that, the logits as before)."""
    spec = resolve("llama-3.1-8b")
    step = Settings(stack="unsloth", **UNSLOTH_STEP)
    runtime = memory.stack_runtime(step)
    n, h, v = step.tokens_per_micro_batch, spec.hidden_size, spec.vocab_size
    triton = runtime.model_copy(update={"loss": "compute_logits"})
    cut = runtime.model_copy(update={"loss": "cut_ce"})
    # the model returns the logits: accelerate's mixed precision hands them back as an fp32 copy (4 bytes each)
    assert memory.logits_bytes(spec, step, triton) == C * v * n + 4 * v * n
    assert memory.logits_bytes(spec, step, triton.model_copy(update={"autocast": False})) == C * v * n + C * h * n
    assert memory.logits_bytes(spec, step, cut) == C * h * n + 4 * n
    short = Settings(stack="unsloth", **(UNSLOTH_STEP | dict(micro_batch=1, seq_len=1024)))
    assert memory.logits_bytes(spec, short, cut) == memory.logits_bytes(spec, short, triton)


def test_each_unsloth_row_runs_the_loss_of_its_release(accuracy) -> None:
    """The calibration rows replay the loss of the Unsloth release that produced them (their banners), the
    estimate for users the pinned one."""
    rows = {row.id: row for row in accuracy.read_rows(accuracy.DEFAULT_CSV)}
    expected = {"USN-01": ("compute_logits", "capped"), "USN-08": ("cut_ce", "capped")}
    expected |= {"USC-04": ("cut_ce", "capped"), "USM-03": ("fused_chunked", "half_free")}
    for row_id, (loss, sizing) in expected.items():
        row = rows[row_id]
        runtime = accuracy.map_row(row, accuracy.resolve_model(row.raw["model"])).runtime
        assert (runtime.loss, runtime.fused_chunk_sizing) == (loss, sizing), row_id
    pinned = memory.stack_runtime(Settings(stack="unsloth", **UNSLOTH_STEP))
    assert (pinned.loss, pinned.fused_chunk_sizing) == ("fused_chunked", "capped")


def test_a_padded_row_of_the_cut_cross_entropy_releases_is_bounded_at_its_longest_logits_batch(accuracy) -> None:
    """Unsloth's releases with cut cross-entropy scored micro-batches of at most 1024 tokens through the whole
    logits: a row padded to each batch's longest may peak below its cap, so its figure is the higher of the two."""
    rows = {row.id: row for row in accuracy.read_rows(accuracy.DEFAULT_CSV)}
    row = rows["USN-21"]  # Llama-3.2-1B, micro-batch 1, padded up to 2048, Unsloth 2025.4.7
    mapping = accuracy.map_row(row, accuracy.resolve_model(row.raw["model"]))
    assert mapping.runtime.loss == "cut_ce" and mapping.shorter is not None and mapping.shorter.seq_len == 1024
    at = {
        length.seq_len: memory.estimate(mapping.spec, length, mapping.gpu, runtime=mapping.runtime).peak_reserved_gib
        for length in (mapping.settings, mapping.shorter)
    }
    assert at[1024] > at[2048]  # the logits of 1024 tokens outweigh everything 1024 more tokens add
    assert accuracy.predicted_bytes(mapping, "reserved") == max(at.values()) * GIB
    fixed = rows["USN-26"]  # packed to 4096: no shorter batch
    assert accuracy.map_row(fixed, accuracy.resolve_model(fixed.raw["model"])).shorter is None
