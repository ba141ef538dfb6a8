"""The op timer of a traced step (lorafit.trace.optime): what it records, how it files and sums it.

Expected counts come from the tiny model itself (its nn.Linear weights counted on the meta device) and from
hand calculation, not from the time model the op timer checks.
"""

from __future__ import annotations

from functools import cache

import pytest

from conftest import tiny_spec
from lorafit import hardware, timing
from lorafit.models import ModelSpec
from lorafit.schema import Settings

torch = pytest.importorskip("torch")
pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

from lorafit.trace.optime import CATEGORIES, OpTimer, op_seconds, time_ops, trace_micro_batch, trace_ops  # noqa: E402
from lorafit.trace.tracker import Phase  # noqa: E402
from lorafit.train import build  # noqa: E402

TOKENS = 2 * 48  # micro-batch 2 of 48 tokens (not the head width, 32: eager scores are told apart by shape)
RANK = 4  # no dimension of the tiny model is 4, so a matmul with a 4 in its shape is a LoRA one


def tiny(layers: int = 2) -> ModelSpec:
    return tiny_spec("llama-3.1-8b", num_hidden_layers=layers)


def settings(**changes: object) -> Settings:
    base = {"method": "lora", "quant": "none", "micro_batch": 2, "seq_len": 48, "lora_r": RANK}
    return Settings(**(base | changes))


def linear_weights(spec: ModelSpec, s: Settings) -> tuple[int, int, int]:
    """(the decoder layers' nn.Linear weights, the LM head's, the first layer's q, k and v projections'),
    counted on a meta-device model."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(build.hf_config(spec, s))
    head = model.get_output_embeddings()
    layers = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head)
    attention = model.model.layers[0].self_attn
    qkv = sum(getattr(attention, name).weight.numel() for name in ("q_proj", "k_proj", "v_proj"))
    return layers, head.weight.numel(), qkv


def linear_shapes(spec: ModelSpec, s: Settings) -> list[tuple[int, int]]:
    """(in, out) of every nn.Linear in the decoder layers, from a meta-device model."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(build.hf_config(spec, s))
    return [(m.in_features, m.out_features) for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]


@cache
def traced(s: Settings) -> list:
    """The tiny model's op list under `s` (traced once: several tests read the same one)."""
    return trace_ops(tiny(), s)


def flops(ops: list, category: str) -> float:
    return sum(op.flops for op in ops if op.category == category)


@pytest.mark.parametrize(
    ("changes", "layer_passes", "head_passes", "first_qkv_skipped"),
    [
        # forward and the input gradients; the first layer's q, k and v need none for LoRA: their input
        # (the embeddings') needs no gradient without checkpointing
        ({"grad_ckpt": False}, 2, 2, True),
        # + the layers' recomputation (the head runs after the last checkpoint); checkpointing makes the
        # embeddings' output require a gradient
        ({"grad_ckpt": True}, 3, 2, False),
        ({"method": "full", "grad_ckpt": False}, 3, 3, False),  # + the weight gradients
        # the recomputation stops after the last tensor backward needs (checkpoint's early stop): without an
        # adapter after it, each layer's down_proj is not run again
        ({"method": "full", "grad_ckpt": True}, 4, 3, False),
        ({"method": "qlora", "quant": "nf4", "grad_ckpt": True}, 3, 2, False),
    ],
)
def test_base_matmul_flops_are_two_per_weight_per_token_per_pass(
    changes: dict, layer_passes: int, head_passes: int, first_qkv_skipped: bool
) -> None:
    spec, s = tiny(), settings(**changes)
    layers, head, qkv = linear_weights(spec, s)
    ops = traced(s)
    weights = layers * layer_passes + head * head_passes - (qkv if first_qkv_skipped else 0)
    if s.method == "full" and s.grad_ckpt:
        weights -= spec.hidden_size * spec.intermediate_size * spec.num_hidden_layers
    assert flops(ops, "matmul") == 2 * TOKENS * weights


def test_lora_ops_are_filed_apart_and_4bit_weights_dequantised_once_a_pass() -> None:
    spec, s = tiny(), settings(method="qlora", quant="nf4", grad_ckpt=True)
    ops = traced(s)
    # lora_A (in x r) and lora_B (r x out) of every linear: forward, recomputation, input and weight gradients;
    # the recomputation stops after the last tensor backward needs (checkpoint's early stop), so each layer's
    # last lora_B (down_proj's, r x hidden), whose output nothing saves, is not run again
    adapter_weights = sum(RANK * (i + o) for i, o in linear_shapes(spec, s))
    not_recomputed = RANK * spec.hidden_size * spec.num_hidden_layers
    assert flops(ops, "lora") == 2 * TOKENS * (adapter_weights * 4 - not_recomputed)
    assert not [op for op in ops if op.category == "matmul" and not op.flops]
    # 7 linears a layer, each dequantised in forward, recomputation and backward; each of those matmuls is on a
    # dequantised weight (the 16-bit LM head is not)
    dequantised = [op for op in ops if op.name == "bitsandbytes.dequantize_4bit"]
    assert len(dequantised) == 7 * spec.num_hidden_layers * 3
    assert sum(op.quantized for op in ops) == len(dequantised)
    assert not [op for op in traced(settings(method="full", grad_ckpt=False)) if op.category == "lora"]


def test_views_move_nothing_and_each_kernel_its_inputs_and_outputs() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    timer = OpTimer(lambda: Phase(1, 1, "forward: layer", 0))
    with FakeTensorMode(), timer:
        x = torch.empty(8, 16, dtype=torch.bfloat16)
        w = torch.empty(16, 32, dtype=torch.bfloat16)
        x.view(16, 8).t()
        x.reshape(-1).unsqueeze(0).detach()
        x[:, :4].expand(2, 8, 4)
        y = x + x  # reads two, writes one
        z = y @ w
    assert [op.name for op in timer.ops] == ["aten.add", "aten.mm"]
    add, mm = timer.ops
    assert add.moved_bytes == 3 * 8 * 16 * 2 and add.flops == 0 and add.category == "elementwise"
    assert mm.moved_bytes == (8 * 16 + 16 * 32 + 8 * 32) * 2 and mm.flops == 2 * 8 * 16 * 32
    assert z.shape == (8, 32)


def test_categories_sum_to_the_total_and_the_depth_line_matches_a_full_trace() -> None:
    gpu = hardware.resolve("L4")
    spec, s = tiny(layers=4), settings(method="qlora", quant="nf4")
    ops = trace_ops(spec, s)
    timed = time_ops(ops, gpu)
    assert set(op.category for op in ops) <= set(CATEGORIES)
    assert timed.total == pytest.approx(sum(op_seconds(op, gpu) for op in ops) + len(ops) * timing.KERNEL_SECONDS)
    depths = trace_micro_batch(spec, s)  # traced at 2 and 3 layers, extended to 4
    assert [n for n, _ in depths.traces] == [2, 3]
    line = depths.time(gpu)
    for category in CATEGORIES:
        assert line.kernels[category] == pytest.approx(timed.kernels[category])
        assert line.moved_bytes[category] == pytest.approx(timed.moved_bytes[category])
        assert line.seconds[category] == pytest.approx(timed.seconds[category])


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_attention_is_the_fused_kernel_or_every_op_on_the_eager_scores(attn: str) -> None:
    spec, s = tiny(), settings(attn=attn, grad_ckpt=False)
    ops = [op for op in traced(s) if op.category == "attention"]
    heads, seq = spec.num_attention_heads, s.seq_len
    # QK^T and PV over the whole square: 2 x 2 x heads x seq^2 x head_dim per sequence and layer
    forward_flops = 4 * s.micro_batch * heads * seq * seq * spec.head_size * spec.num_hidden_layers
    forward = [op for op in ops if not op.backward]
    assert sum(op.flops for op in forward) == forward_flops
    if attn == "sdpa":
        assert len(forward) == spec.num_hidden_layers and all(op.causal for op in forward)
    else:  # two batched matmuls, scaling, mask, fp32 softmax and the casts around it, all on the scores
        assert {op.name for op in forward} >= {"aten.bmm", "aten._softmax", "aten.add", "aten.mul"}
        assert not any(op.causal for op in ops)
