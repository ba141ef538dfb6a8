"""The per-op time model (lorafit.timing), term by term, worked out by hand from each term's formula.

llama-2-7b throughout: h 4096, intermediate 11008, 32 layers of 32 heads (no grouped-query attention), vocabulary
32000, untied head. Its decoder layers hold 4 x 4096^2 + 3 x 4096 x 11008 = 202,375,168 linear weights and
2 x 4096 norm weights each: 6,476,271,616 matmul weights with the final norm, plus a 131,072,000-weight head.
The fitted constants (MATMUL_SHAPE_SHARE, QUANT_MATMUL_SLOWDOWN) are read by name; the catalog's figures are
written out.
"""

from __future__ import annotations

import pytest

from lorafit import costs, hardware, models, timing
from lorafit.schema import Settings

LAYERS_WEIGHTS = 6_476_271_616  # the decoder layers' matmul weights (and norms), as above
HEAD = 32000 * 4096
LINEARS = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)  # what bitsandbytes packs: 6,476,005,376
A100_BYTES = 2039e9 * 0.85  # spec bandwidth x BANDWIDTH_SHARE
A100_MATMUL = 264.5e12  # catalog matmul_tflops (best-square PyTorch bf16 matmul)


@pytest.fixture(scope="module")
def spec() -> models.ModelSpec:
    return models.resolve("llama-2-7b")


def lora(**fields) -> Settings:
    return Settings(**({"method": "lora", "quant": "none", "micro_batch": 1, "seq_len": 2048} | fields))


def test_rates_come_from_measured_matmuls_or_a_share_of_the_peak() -> None:
    a100 = hardware.resolve("A100 80GB")
    assert timing.achievable_matmul_flops(a100, "bf16") == pytest.approx(264.5e12)
    assert timing.achievable_matmul_flops(a100, "fp32") == pytest.approx(156e12 * 264.5 / 312)  # TF32, same share
    # the L4's 72 W cap holds it to 57 of its 121 peak TFLOP/s
    assert timing.achievable_matmul_flops(hardware.resolve("L4"), "bf16") == pytest.approx(57e12)
    # no bf16 on the T4: its fp16 measurement
    assert timing.achievable_matmul_flops(hardware.resolve("T4"), "fp16") == pytest.approx(24e12)
    # no measurement: a GeForce card its whole fp32-accumulate peak, the others 80 % of theirs
    assert timing.achievable_matmul_flops(hardware.resolve("RTX 4080"), "bf16") == pytest.approx(97.5e12)
    assert timing.achievable_matmul_flops(hardware.resolve("A40"), "bf16") == pytest.approx(149.7e12 * 0.8)
    assert timing.achievable_bytes_per_second(hardware.resolve("RTX 4060 Ti 16GB")) == pytest.approx(288e9 * 0.85)


def test_base_matmuls_by_hand(spec, a100) -> None:
    rate = A100_MATMUL * timing.MATMUL_SHAPE_SHARE
    # LoRA with checkpointing: the layers run forward, input gradients and the recomputation; the head no
    # recomputation
    flops = 2 * (3 * LAYERS_WEIGHTS + 2 * HEAD) * 2048
    assert timing.base_matmul_seconds(spec, lora(), a100) == pytest.approx(flops / rate)
    # full fine-tuning adds the weight gradients of both; its recomputation skips each layer's down projection
    # (11008 x 4096), whose output nothing saves
    full = Settings(method="full", quant="none", micro_batch=1, seq_len=2048)
    assert timing.base_matmul_seconds(spec, full, a100) == pytest.approx(
        2 * (4 * LAYERS_WEIGHTS - 32 * 11008 * 4096 + 3 * HEAD) * 2048 / rate
    )
    # a 4-bit base runs the decoder layers' matmuls QUANT_MATMUL_SLOWDOWN slower; the 16-bit head as it was
    qlora = lora(method="qlora", quant="nf4")
    layers, head = 2 * 3 * LAYERS_WEIGHTS * 2048 / rate, 2 * 2 * HEAD * 2048 / rate
    assert timing.base_matmul_seconds(spec, qlora, a100) == pytest.approx(layers * timing.QUANT_MATMUL_SLOWDOWN + head)
    # the chunked loss runs the head's forward again: 2 x V x h FLOPs per token more
    chunked = lora(loss="chunked")
    assert timing.base_matmul_seconds(spec, chunked, a100) == pytest.approx((flops + 2 * HEAD * 2048) / rate)
    # eight tokens: reading the 16-bit weights in each pass takes longer than their FLOPs
    few = lora(seq_len=8)
    assert timing.base_matmul_seconds(spec, few, a100) == pytest.approx(
        (3 * LAYERS_WEIGHTS + 2 * HEAD) * 2 / A100_BYTES
    )


def test_attention_by_kernel(spec, a100) -> None:
    # sdpa / flash: 2 x seq x q_size FLOPs per token and layer; forward, recomputation and a 2.5-forward backward
    flops = 2 * 2048 * 4096 * 32 * 2048 * (1 + 1 + 2.5)
    sdpa = flops / (A100_MATMUL * 0.6)
    assert timing.attention_seconds(spec, lora(attn="sdpa"), a100) == pytest.approx(sdpa)
    assert timing.attention_seconds(spec, lora(attn="flash"), a100) == pytest.approx(sdpa)
    # eager: the whole square at the matmul rate, or the scores it writes out, whichever is slower: 32 heads x
    # 2048^2 scores a layer, 32 bytes each (bf16) in forward and in the recomputation, 36 in backward
    moved = 32 * 2048 * 2048 * 32 * (32 * 2 + 36)
    eager = timing.attention_seconds(spec, lora(attn="eager"), a100)
    assert eager == pytest.approx(max(2 * flops / A100_MATMUL, moved / A100_BYTES))
    assert eager == pytest.approx(moved / A100_BYTES) and eager > sdpa
    assert timing.eager_score_bytes(4) == (48, 52)  # fp32 scores: 8 x 4 + 16, 8 x 4 + 20


def test_dequantisation_scales_with_the_weights_not_the_tokens(spec) -> None:
    card = hardware.resolve("RTX 4060 Ti 16GB")
    # nf4 with double quantisation read, a bf16 copy written, the nested absmax's fp32 dequantisation (15/64)
    per_weight = 0.5 + 1 / 64 + 4 / (64 * 256) + 2 + 15 / 64
    qlora = lora(method="qlora", quant="nf4")
    expected = LINEARS * per_weight * 3 / (288e9 * 0.85)  # forward, recomputation, input gradients
    assert timing.dequant_seconds(spec, qlora, card) == pytest.approx(expected)
    assert timing.dequant_seconds(spec, qlora.model_copy(update={"micro_batch": 8}), card) == pytest.approx(expected)
    no_ckpt = qlora.model_copy(update={"grad_ckpt": False})
    assert timing.dequant_seconds(spec, no_ckpt, card) == pytest.approx(expected * 2 / 3)
    assert timing.dequant_seconds(spec, lora(), card) == 0.0

    # so it weighs most on a small micro-batch on a card with little bandwidth
    def share(settings: Settings, gpu: hardware.GpuSpec) -> float:
        ops = timing.micro_batch_time(spec, settings, gpu)
        return ops.dequant / ops.total

    small = qlora.model_copy(update={"seq_len": 512})
    assert share(small, card) > share(qlora.model_copy(update={"micro_batch": 8}), card)
    assert share(small, card) > share(small, hardware.resolve("RTX 4090"))


def test_lora_path_bytes_by_hand(spec, a100) -> None:
    # lorafit's trainer: fp32 adapters under bf16 autocast, dropout 0.05. Input side: cast to fp32 (2 + 4),
    # dropout (4 + 4 + a 1-byte mask), autocast's cast back (4 + 2), lora_A's read (2) = 23; output side: lora_B
    # writes 2, the scaling reads and writes 4, the sum reads 2 + 2 and writes 2 = 12
    runtime = timing.memory.stack_runtime(lora())
    assert timing.lora_bytes_per_element(lora(), runtime, 2) == (23, 12)
    assert timing.lora_bytes_per_element(lora(lora_dropout=0.0), runtime, 2) == (14, 12)
    # peft's bitsandbytes layer under CUDA's autocast casts nothing (`requires_conversion = not
    # torch.is_autocast_enabled()`): the same fp32 adapters over a 4-bit base drop the bf16 input out as it comes
    # (2 + 2 + 1) and lora_A reads it; the output side as above
    qlora = lora(method="qlora", quant="nf4")
    assert timing.lora_bytes_per_element(qlora, timing.memory.stack_runtime(qlora), 2) == (7, 12)
    # on the CPU that check reads CUDA's autocast, which is off: the casts are made, as for a 16-bit base
    cpu = timing.memory.stack_runtime(qlora, device="cpu")
    assert timing.lora_bytes_per_element(qlora, cpu, 2) == (23, 12)
    # TRL over a 4-bit base keeps its adapters in bf16: a bf16 dropout (2 + 2 + 1) and the read
    trl = lora(method="qlora", quant="nf4", stack="trl")
    assert timing.lora_bytes_per_element(trl, timing.memory.stack_runtime(trl), 2) == (7, 12)
    # and with peft's kbit preparation an fp32 input (s = 4): dropout 4 + 4 + 1, autocast's cast 4 + 2, the read 2;
    # lora_B writes 2, the scaling 4, the sum reads 4 + 2 and writes 4
    kbit = lora(method="qlora", quant="nf4", stack="trl", kbit_prep=True)
    assert timing.lora_bytes_per_element(kbit, timing.memory.stack_runtime(kbit), 4) == (17, 16)
    # without autocast the adapter matmuls run in fp32: lora_A reads 4; lora_B writes 4, the scaling 8, the sum
    # reads 2 + 4 and writes 4, and the cast back reads 4 and writes 2
    plain = lora(autocast=False)
    assert timing.lora_bytes_per_element(plain, timing.memory.stack_runtime(plain), 2) == (19, 28)
    # a pure-bf16 loop with its adapters in bf16 (fp32_adapters off, no autocast): a bf16 dropout (2 + 2 + 1)
    # and lora_A's read; lora_B writes 2, the scaling 4, the sum reads 2 + 2 and writes 2
    pure = lora(autocast=False, fp32_adapters=False)
    assert timing.lora_bytes_per_element(pure, timing.memory.stack_runtime(pure), 2) == (7, 12)
    assert timing.lora_seconds(spec, pure, a100) < timing.lora_seconds(spec, plain, a100) / 2
    # and the adapters, their gradients and AdamW's states take half the memory of fp32 ones
    assert timing.memory.adapter_bytes(spec, pure, timing.memory.stack_runtime(pure)) * 2 == pytest.approx(
        timing.memory.adapter_bytes(spec, plain, timing.memory.stack_runtime(plain))
    )
    # q and v (4096 -> 4096) of 32 layers, 2048 tokens, forward + recomputation + about as much in backward
    qv = lora(lora_targets="qv")
    moved = 2048 * 32 * (2 * 4096 * 23 + 2 * 4096 * 12) * 3
    assert timing.lora_seconds(spec, qv, a100) == pytest.approx(moved / A100_BYTES)
    # over a 4-bit base peft clones the base output in every forward (2 x 2 bytes an output element more) and,
    # under CUDA's autocast, casts nothing (7 bytes an input element, not 23)
    qlora_qv = lora(lora_targets="qv", method="qlora", quant="nf4")
    moved = 2048 * 32 * (2 * (2 * 4096 * 7 + 2 * 4096 * 16) + 2 * 4096 * 7 + 2 * 4096 * 12)
    assert timing.lora_seconds(spec, qlora_qv, a100) == pytest.approx(moved / A100_BYTES)
    assert timing.lora_seconds(spec, Settings(method="full", quant="none"), a100) == 0.0


def test_norms_activations_rotary_residuals_by_hand(spec, a100) -> None:
    per_token = (
        2 * 36 * 4096  # two RMSNorms
        + 2 * 3 * 2 * 4096  # two residual sums
        + 10 * 2 * (4096 + 4096)  # rotary on q and k
        + 5 * 2 * 11008  # SwiGLU
        + 2 * 2 * 4096  # attention output back to the token layout
    )
    assert timing.elementwise_bytes_per_token(spec, lora()) == per_token == 634_368
    seconds = 2048 * 32 * per_token * (1 + 1 + 3) / A100_BYTES  # backward moves three times the forward
    assert timing.elementwise_seconds(spec, lora(), a100) == pytest.approx(seconds)
    no_ckpt = lora(grad_ckpt=False)
    assert timing.elementwise_seconds(spec, no_ckpt, a100) == pytest.approx(seconds * 4 / 5)


def test_an_fp32_stream_into_a_4bit_base_costs_each_linears_casts_by_hand(spec, a100) -> None:
    """peft's kbit preparation leaves fp32 norms, so the stream is fp32: every Linear4bit casts its input down and
    its output back, and their gradients back in backward (6 bytes an element for bf16), and q, k, gate and up
    come back fp32, so rotary and SwiGLU move 4-byte elements. The attention's output projection is the
    exception under autocast: the attention hands it its output in bf16."""
    qlora = lora(method="qlora", quant="nf4")
    prepared = lora(method="qlora", quant="nf4", kbit_prep=True)
    assert timing.stream_cast_seconds(spec, qlora, a100) == 0.0
    assert timing.stream_cast_seconds(spec, lora(kbit_prep=True), a100) == 0.0  # no 4-bit layer to cast into
    # in + out of q, k, v (4096 + 4096 each), gate and up (4096 + 11008 each), down (11008 + 4096)
    elements = 3 * 8192 + 3 * (4096 + 11008)
    seconds = 6 * elements * 32 * 2048 * (2 + 1) / A100_BYTES  # forward, recomputation, backward
    assert timing.stream_cast_seconds(spec, prepared, a100) == pytest.approx(seconds)
    # without autocast the attention runs in fp32 and o_proj casts too
    plain = prepared.model_copy(update={"autocast": False})
    assert timing.stream_cast_seconds(spec, plain, a100) == pytest.approx(seconds * (elements + 8192) / elements)
    per_token = (
        2 * 36 * 4096  # two RMSNorms
        + 2 * 3 * 4 * 4096  # two residual sums on the fp32 stream
        + 10 * 4 * (4096 + 4096)  # rotary on fp32 q and k
        + 5 * 4 * 11008  # SwiGLU on fp32 gate and up
        + 2 * 2 * 4096  # the attention's output (autocast ran it in bf16) back to the token layout
    )
    assert timing.elementwise_bytes_per_token(spec, prepared) == per_token
    ops = timing.micro_batch_time(spec, prepared, a100)
    plain = timing.elementwise_seconds(spec, prepared, a100)
    assert ops.elementwise == pytest.approx(plain + seconds)


def test_loss_and_kernels_by_hand(spec, a100) -> None:
    # 36 bytes a logit, and accelerate's fp32 copy of the bf16 logits under autocast (2 + 4)
    assert timing.loss_seconds(spec, lora(), a100) == pytest.approx(2048 * 32000 * 42 / A100_BYTES)
    plain = lora(autocast=False)
    assert timing.loss_seconds(spec, plain, a100) == pytest.approx(2048 * 32000 * 36 / A100_BYTES)
    # QLoRA on all 7 linears with checkpointing. Forward: 30 a layer (two norms of six kernels, two sums, ten for
    # rotary, two for SwiGLU, four for attention) + the attention + 7 linears + 21 dequantisations (three each
    # with double quantisation) + 7 x 8 LoRA kernels (dropout, autocast's casts of the two fp32 adapter weights,
    # lora_A, lora_B, scaling, sum, peft's clone: its bitsandbytes layer casts nothing under CUDA's autocast),
    # twice with the recomputation; backward: 60 + 7 input gradients + 21 + 7 x 9
    qlora = lora(method="qlora", quant="nf4")
    assert timing.lora_kernels(qlora, timing.memory.stack_runtime(qlora)) == 8
    assert timing.kernel_count(spec, qlora) == ((30 + 1 + 7 + 21 + 56) * 2 + 60 + 7 + 21 + 63) * 32
    # full fine-tuning: forward 31 + 7 linears, backward 60 + input and weight gradients of the 7
    full = Settings(method="full", quant="none", grad_ckpt=False)
    assert timing.kernel_count(spec, full) == (38 + 74) * 32
    assert timing.launch_seconds(spec, full) == pytest.approx(3584 * 4e-6)


def test_a_micro_batch_is_the_sum_of_its_ops(spec) -> None:
    gpu = hardware.resolve("RTX 4090")
    settings = lora(method="qlora", quant="nf4", micro_batch=2, grad_accum=4)
    ops = timing.micro_batch_time(spec, settings, gpu)
    parts = (
        timing.base_matmul_seconds(spec, settings, gpu),
        timing.attention_seconds(spec, settings, gpu),
        timing.dequant_seconds(spec, settings, gpu),
        timing.lora_seconds(spec, settings, gpu),
        timing.elementwise_seconds(spec, settings, gpu),
        timing.loss_seconds(spec, settings, gpu),
        timing.launch_seconds(spec, settings),
    )
    assert ops.total == pytest.approx(sum(parts)) == timing.step_seconds(spec, settings, gpu)
    step = timing.step_time(spec, settings, gpu)
    assert step.compute == pytest.approx(4 * ops.total)
    assert step.dequant == pytest.approx(4 * parts[2]) and step.lora == pytest.approx(4 * parts[3])


def test_cards_with_little_bandwidth_lose_more_than_their_tflops_say(spec) -> None:
    """The RTX 4060 Ti has 27 % of the 4090's measured matmul rate but 29 % of its bandwidth; the L4 has a third
    of the 4090's matmul rate. Both are slower than the 4090, and the L4 slower than its spec's peak would say."""
    settings = lora(method="qlora", quant="nf4", micro_batch=2, seq_len=1024)
    speed = {
        name: timing.tokens_per_second(spec, settings, hardware.resolve(name))
        for name in ("RTX 4090", "RTX 4060 Ti 16GB", "L4")
    }
    assert speed["RTX 4090"] > speed["L4"] > speed["RTX 4060 Ti 16GB"]
    assert speed["L4"] / speed["RTX 4090"] < 121 / 165.2  # the peak ratio


def test_torch_compile_fuses_the_elementwise_ops_not_the_matmuls(spec, a100) -> None:
    """Compiled, a residual sum and its norm read the stream and the block output and write the new stream and
    the normed input (3s + c); rotary reads and writes q and k once (2c), SwiGLU reads two and writes one (3c);
    the LoRA path is two fused kernels; the matmuls and attention are cuBLAS's and flash's either way."""
    eager, compiled = lora(), lora(torch_compile=True)
    h, c = 4096, 2
    per_token = 2 * (3 * c + c) * h + 2 * c * (h + h) + 3 * c * 11008 + 2 * c * h
    assert timing.elementwise_bytes_per_token(spec, compiled) == per_token
    assert timing.elementwise_bytes_per_token(spec, eager) > 2 * per_token
    runtime = timing.memory.stack_runtime(compiled)
    assert timing.lora_bytes_per_element(compiled, runtime, c) == (c + 2 * c, 2 * c + 2 * c)
    eager_ops, compiled_ops = timing.micro_batch_time(spec, eager, a100), timing.micro_batch_time(spec, compiled, a100)
    assert compiled_ops.matmul == eager_ops.matmul and compiled_ops.attention == eager_ops.attention
    assert compiled_ops.launches < eager_ops.launches and compiled_ops.loss < eager_ops.loss
    assert compiled_ops.total < eager_ops.total


def test_liger_s_norm_keeps_the_stream_in_its_input_s_dtype_under_kbit_preparation() -> None:
    """transformers' RMSNorm returns `weight * x.to(dtype)`, which fp32 weights promote; Liger's writes its input's
    dtype. So with kbit preparation and Liger the stream stays bf16 where TRL (up to 0.12) cast the embeddings back
    to bf16, and is fp32 where they stay fp32 (the Trainer after peft's preparation alone)."""
    runtime, stream = timing.memory.stack_runtime, timing.memory.stream_dtype_bytes
    for stack, with_liger in (("trl", 2), ("peft-kbit", 4)):
        prepared = lora(method="qlora", quant="nf4", stack=stack, kbit_prep=True)
        assert stream(prepared, runtime(prepared)) == 4
        liger = prepared.model_copy(update={"liger": True})
        assert stream(liger, runtime(liger)) == with_liger
        assert timing.memory.swiglu_dtype_bytes(liger, runtime(liger)) == with_liger


def test_liger_kernels_make_fewer_passes_over_memory_and_its_loss_no_more_matmuls(spec, a100) -> None:
    """Liger (lorafit's Trainer with use_liger_kernel): each RMSNorm reads the stream and writes the normed input
    once (s + c), rotary rotates q and k in place (2c), SwiGLU reads gate and up and writes their product (3c); the
    residual sums (3s each) and the attention output's copy (2c x q) are transformers'. Its fused cross-entropy
    reads a chunk's logits twice and writes their gradient once (3c a logit, not 36 + 6), and computes the hidden
    states' gradient in the forward instead of the backward: the same head matmuls, none run again, unlike
    lorafit's chunked loss (2 x V x h more FLOPs a token)."""
    eager, liger, chunked = lora(), lora(liger=True), lora(loss="chunked")
    h, c = 4096, 2
    per_token = 2 * (c + c) * h + 2 * 3 * c * h + 2 * c * (h + h) + 3 * c * 11008 + 2 * c * h
    assert timing.elementwise_bytes_per_token(spec, liger) == per_token
    assert timing.loss_seconds(spec, liger, a100) == pytest.approx(2048 * 32000 * 3 * c / A100_BYTES)
    eager_ops, liger_ops = timing.micro_batch_time(spec, eager, a100), timing.micro_batch_time(spec, liger, a100)
    assert liger_ops.matmul == eager_ops.matmul < timing.micro_batch_time(spec, chunked, a100).matmul
    assert liger_ops.elementwise < eager_ops.elementwise / 2 and liger_ops.loss < eager_ops.loss / 5
    assert liger_ops.launches < eager_ops.launches
    assert timing.tokens_per_second(spec, liger, a100) > timing.tokens_per_second(spec, eager, a100)


def test_the_hours_range_is_the_check_rows_error_of_the_narrowest_class_with_rows(a100) -> None:
    """hours x (1 + the 10th and 90th percentile errors) of the run's class: GPU kind and count, else count,
    else all check rows, whichever first has MIN_KIND_ROWS rows."""
    table = costs.time_accuracy()
    for gpu, n_gpus in ((a100, 1), (a100, 8), (hardware.resolve("RTX 4090"), 1), (hardware.resolve("RTX 4090"), 2)):
        name, entry = costs.accuracy_of(gpu, n_gpus)
        narrower = costs.run_classes(gpu.kind, n_gpus)
        assert name in narrower and entry == table[name]
        skipped = narrower[: narrower.index(name)]
        assert all(table.get(other, {"rows": 0})["rows"] < costs.MIN_KIND_ROWS for other in skipped)
        assert name == "all" or entry["rows"] >= costs.MIN_KIND_ROWS
        low, high = costs.hours_range(gpu, 10.0, n_gpus)
        assert low == pytest.approx(10 * (1 + entry["low"]), abs=1e-3)
        assert high == pytest.approx(10 * (1 + entry["high"]), abs=1e-3)
        assert low <= 10.0 <= high
    assert costs.hours_range(None, 10.0) is None and costs.hours_range(a100, 0.0) is None


def test_a_linear4bit_casts_an_fp32_input_and_output_as_the_time_model_counts() -> None:
    """stream_cast_seconds' count, checked on bitsandbytes itself (its CPU kernels): with an fp32 input a
    Linear4bit casts the input down and its output back in forward, and both gradients back in backward - four
    casts moving (4 + 2) x (in + out) bytes per token each way - and none with a bf16 input."""
    torch = pytest.importorskip("torch")
    bnb = pytest.importorskip("bitsandbytes")
    from torch.utils._python_dispatch import TorchDispatchMode

    class Casts(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.moved = self.kernels = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default and args[0].dtype != out.dtype and out.is_floating_point():
                self.moved += args[0].nbytes + out.nbytes
                self.kernels += 1
            return out

    width_in, width_out, tokens = 256, 512, 64
    layer = bnb.nn.Linear4bit(width_in, width_out, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
    weight = torch.randn(width_out, width_in, dtype=torch.bfloat16)
    layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4")
    layer = layer.to("cpu")
    moved = {}
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(tokens, width_in, dtype=dtype, requires_grad=True)
        casts = Casts()
        with casts:
            layer(x).sum().backward()
        moved[dtype] = (casts.kernels, casts.moved)
    assert moved[torch.float32] == (4, (4 + 2) * (width_in + width_out) * tokens * 2)
    assert moved[torch.bfloat16] == (0, 0)
