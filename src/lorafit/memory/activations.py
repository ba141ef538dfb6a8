"""What one layer keeps for backward, per token, and what its backward holds in flight: the saved tensors of
every op of the layer as the stack runs it, checkpointed or not, on the GPU or copied to host memory."""

from __future__ import annotations

from functools import lru_cache

from lorafit import gemma4
from lorafit.memory.linear_attention import mixed_layer_parts, shared_expert_saved_bytes
from lorafit.memory.runtime import (
    OFFLOAD_LAYERS_ON_GPU,
    UNSLOTH_LAYERS_ON_GPU,
    Runtime,
    quantized_expert_params,
    stack_runtime,
    triton_kernels_apply,
)
from lorafit.memory.weights import (
    offloaded_embedding_bytes,
    on_host,
    shard_factors,
    trainable_dtype_bytes,
    trainable_params,
)
from lorafit.models import ModelSpec
from lorafit.schema import Settings
from lorafit.units import BYTES_PER_GIB as GIB
from lorafit.units import DTYPE_BYTES, gib


# --- activations --------------------------------------------------------------------------------------------
def lora_module_saved_bytes(
    fan_in: int, settings: Settings, runtime: Runtime, input_requires_grad: bool = True
) -> float:
    """Per token, what one LoRA-wrapped linear saves: peft casts the input to the adapter dtype, lora_A keeps
    dropout's output (in the compute dtype under autocast), dropout its mask (bool on CUDA's fused dropout, the
    input dtype in the CPU kernel; none when no gradient flows to the input), lora_B keeps lora_A's r outputs."""
    c = DTYPE_BYTES[settings.precision]
    a = 4 if runtime.lora_dtype == "fp32" else c  # the dtype the input is cast to, and dropout runs in
    saved = c if runtime.autocast else a  # under autocast lora_A casts its input to the compute dtype and saves that
    mask = (1 if runtime.device == "cuda" else a) if settings.lora_dropout > 0 and input_requires_grad else 0
    return fan_in * (saved + mask) + settings.lora_r * saved


def activation_parts_per_token(
    spec: ModelSpec, settings: Settings, runtime: Runtime, input_requires_grad: bool = True
) -> dict[str, float]:
    """Bytes one decoder layer saves for backward, per token, by sub-block (no checkpointing).

    RMSNorm (HF) upcasts to fp32 and saves that copy (4h) plus the rsqrt (4); with a trainable weight it also
    saves the bf16 normalised input (2h). Frozen linears save nothing; trainable ones save their input.
    sdpa/flash save q, k, v (k and v repeated to all heads when a mask is passed), the output and the fp32
    logsumexp; eager saves the score and probability matrices instead. SwiGLU saves gate, silu(gate) and up."""
    c = DTYPE_BYTES[settings.precision]
    h, q, kv, inter = spec.hidden_size, spec.q_size, spec.kv_size, spec.mlp_width
    heads = spec.num_attention_heads
    full = settings.method == "full"
    lora_names = set() if full else set(spec.lora_target_names(settings.lora_targets))

    def norm() -> float:
        if not input_requires_grad and not full:
            return 0.0
        return norm_saved_bytes(spec, settings, runtime)

    def linear_inputs(names: dict[str, tuple[int, int]], shared_input: bool) -> float:
        if full:
            fan_ins = {fan_in for fan_in, _ in names.values()} if shared_input else [i for i, _ in names.values()]
            return sum(c * fan_in for fan_in in fan_ins)
        return sum(
            lora_module_saved_bytes(fan_in, settings, runtime, input_requires_grad)
            for name, (fan_in, _) in names.items()
            if name in lora_names
        )

    def linear_inputs_grad(names: dict[str, tuple[int, int]], shared_input: bool) -> float:
        """Past the first LoRA output everything downstream requires grad."""
        if full:
            return linear_inputs(names, shared_input)
        return sum(
            lora_module_saved_bytes(fan_in, settings, runtime)
            for name, (fan_in, _) in names.items()
            if name in lora_names
        )

    attn_linears = spec.attention_linears()
    qkv = {name: dims for name, dims in attn_linears.items() if name != "o_proj"}
    out_proj = {"o_proj": attn_linears["o_proj"]}
    a = attention_dtype_bytes(settings, runtime)
    # eager (and litgpt always) repeats k/v to every head before the attention
    kv_saved = q if settings.attn == "eager" or runtime.fused_qkv else kv
    # litgpt without head groups: v is a view of the fused qkv output, which it keeps alive whole
    v_saved = c * (q + 2 * kv) if runtime.fused_qkv and heads == spec.num_key_value_heads else a * kv_saved
    if settings.attn == "eager":
        # q and k for QK^T, fp32 softmax output, its bf16 cast for the AV matmul, v for the AV matmul; Gemma-2's
        # soft-capping (tanh(scores / cap) x cap) also keeps the tanh output
        scores = (4 + c + (c if spec.logit_softcapping else 0)) * heads * settings.seq_len
        if spec.arch.attention_sinks:
            # gpt-oss appends its sink logit to each row and takes the softmax in the scores' own dtype: the
            # probabilities (seq + 1 columns) in bf16 and the row maxima's int64 indices
            scores = c * heads * (settings.seq_len + 1) + 8 * heads
        attention = a * (q + kv_saved) + scores + v_saved
    else:
        attention = a * (q + kv_saved) + v_saved + a * q + 4 * heads
    if spec.arch.fused_qkv and not runtime.fused_qkv:
        # a fused qkv_proj (Phi-3's): v is a view of that output, so the saved v keeps all q + 2 kv columns alive
        attention += c * (q + kv)
    mlp = {name: dims for name, dims in spec.mlp_linears().items() if name != "down_proj"}
    down = {"down_proj": spec.mlp_linears()["down_proj"]}
    experts = max(spec.num_experts_per_tok, 1) if spec.is_moe else 1
    # silu saves gate and the product silu(gate) and up; Liger's kernel saves gate and up, recomputing silu
    gated = (2 if runtime.liger_kernels else 3) * swiglu_dtype_bytes(settings, runtime) * inter
    if spec.arch.clamped_swiglu:
        # gpt-oss: both clamps keep the interleaved gate_up output (2 i) alive; the products save the clamped
        # gate, sigmoid(alpha gate), up + 1 and the gated product (GptOssExperts._apply_gate)
        gated = 6 * swiglu_dtype_bytes(settings, runtime) * inter
    parts = {
        "attn_norm": norm(),
        "qkv_inputs": fused_qkv_lora_bytes(qkv, lora_names, settings, runtime, input_requires_grad)
        if runtime.fused_qkv and not full
        else linear_inputs(qkv, shared_input=True),
        "attention": attention,
        # sdpa/flash return their output laid out as (batch, seq, heads, head_dim): the o_proj input is a view of
        # the output attention already saved, so a trainable o_proj saves nothing new
        "o_proj_input": 0.0 if full and settings.attn != "eager" else linear_inputs_grad(out_proj, False),
        "mlp_norm": norm_saved_bytes(spec, settings, runtime),  # the residual stream requires grad past attention
        "mlp_inputs": experts * linear_inputs_grad(mlp, shared_input=True),
        "gated_act": experts * gated,
        "down_input": experts * linear_inputs_grad(down, shared_input=False),
    }
    if spec.is_moe:
        # each routed expert's output is scaled by its routing weight, which requires grad (the router sees the
        # trainable residual stream), so the product keeps every expert output: k x hidden per token
        # (transformers 5.25 integrations/moe.py grouped_mm_experts_forward; checked against the trace in
        # tests/test_moe.py)
        parts["expert_outputs"] = experts * c * h
    if spec.latent is not None:
        # DeepSeek (mla.py): the latent norms and rope parts, narrower values; the shared experts' SwiGLU
        parts["latent_attention"] = spec.latent.saved_bytes_per_token(c, heads, a)
        parts["shared_experts"] = spec.latent.n_shared_experts * gated
    if spec.linear_attention:  # Qwen3-Next's and Qwen3.5 MoE's gated shared expert (memory/linear_attention.py)
        parts["shared_expert"] = shared_expert_saved_bytes(spec, settings, gated / inter)
    if gemma4.is_moe(spec):
        # Gemma 4 26B-A4B (gemma4.py): the dense MLP beside the experts (its SwiGLU, its adapters' inputs), the MoE
        # block's three norms and the router's unweighted one, the router's fp32 softmax over the experts
        dense = {name: (i, o) for name, i, o, _ in gemma4.dense_mlp_rows(spec)}
        dense_down = {"mlp.down_proj": dense.pop("mlp.down_proj")}
        dense_lora = linear_inputs_grad(dense, shared_input=True) + linear_inputs_grad(dense_down, shared_input=False)
        parts["dense_mlp"] = gated * spec.intermediate_size / inter + dense_lora
        parts["moe_norms"] = (gemma4.MOE_NORMS + 1) * norm_saved_bytes(spec, settings, runtime)
        parts["router"] = 4 * spec.num_local_experts
    if spec.global_layers and spec.global_layers.per_layer_input:
        # Gemma 4 E2B / E4B (gemma4.py): the per-layer input path after the MLP; its Linears are frozen, its GELU
        # saves its input, the product both factors (per_layer_input wide), the post_per_layer_input_norm its input
        parts["per_layer_input"] = 3 * c * spec.global_layers.per_layer_input + norm_saved_bytes(
            spec, settings, runtime
        )
    if spec.norms_per_layer > 2:
        # Gemma-2 and Gemma 3 normalise the attention and MLP outputs too, before adding them to the residual stream
        parts["post_norms"] = (spec.norms_per_layer - 2) * norm_saved_bytes(spec, settings, runtime)
    if spec.arch.qk_norm_saved:
        # Gemma 3 RMS-normalises each query and key head before RoPE: like the layer norms, each saves its fp32
        # input and one rsqrt per head (and, in full fine-tuning, its normalised input for the weight's gradient)
        kv_heads = spec.num_key_value_heads
        width = c if runtime.liger_kernels else 4  # Liger's RMSNorm saves its input in its own dtype
        extra = c * (q + kv) if full and not runtime.liger_kernels else 0
        parts["qk_norms"] = width * (q + kv) + 4 * (heads + kv_heads) + extra
    if keeps_bnb_inputs(settings, runtime):
        parts["bnb_inputs"] = bnb_input_bytes_per_token(spec, settings, input_requires_grad)
    if triton_kernels_apply(spec, runtime) and not full:
        parts |= triton_kernel_parts(spec, settings, lora_names, input_requires_grad)
    if spec.linear_attention:  # a hybrid (Qwen3.5): the mean of its layers (memory/linear_attention.py)
        parts["output_gate"] = 2 * c * q  # the gated attention keeps its output and the sigmoid of the gate
        mixer = spec.linear_attention.linears(h)
        out = {"out_proj": mixer.pop("out_proj")}
        lora = linear_inputs(mixer, shared_input=True) + linear_inputs_grad(out, shared_input=False)
        parts = mixed_layer_parts(parts, spec, settings, lora)
    return parts


def triton_kernel_parts(
    spec: ModelSpec, settings: Settings, lora_names: set[str], input_requires_grad: bool
) -> dict[str, float]:
    """What Unsloth's kernels save per token in place of the HF modules' tensors (unsloth/kernels @ 015bdef0):
    its RMSNorm its input in the compute dtype and one fp32 rsqrt (rms_layernorm.py, l. 205); RoPE nothing of q
    and k (rope_embedding.py); SwiGLU gate and up only. With lora_dropout 0 (patch_peft_model) LoRA_QKV saves
    the one input of q/k/v, LoRA_W o's input and LoRA_MLP the MLP's input with gate and up (fast_lora.py, l. 110,
    418, 612): no lora_A outputs, no silu(gate), no down_proj input. A projection group not fully adapted, or
    dropout above 0, keeps peft's modules."""
    c, h, q, inter = DTYPE_BYTES[settings.precision], spec.hidden_size, spec.q_size, spec.intermediate_size
    experts = max(spec.num_experts_per_tok, 1) if spec.is_moe else 1
    kernels = settings.lora_dropout == 0

    def adapted(names: tuple[str, ...]) -> bool:
        return kernels and all(name in lora_names for name in names)

    norm = c * h + 4
    out = {"attn_norm": norm if input_requires_grad else 0.0, "mlp_norm": norm, "gated_act": experts * 2 * c * inter}
    if adapted(("q_proj", "k_proj", "v_proj")):
        out["qkv_inputs"] = c * h if input_requires_grad else 0.0
    if adapted(("o_proj",)):
        # LoRA_W saves its input, the attention's output, which flash/sdpa saved already (a view); eager's is new
        out["o_proj_input"] = c * q if settings.attn == "eager" else 0.0
    if adapted(("gate_proj", "up_proj", "down_proj")):
        out |= {"mlp_inputs": experts * c * h, "down_input": 0.0}
    return out


def norm_saved_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """Per token, what one RMSNorm over the residual stream saves. transformers' upcasts to fp32 and saves that
    copy (4h) and the rsqrt (4), and with a trainable weight the normalised input too (2h). Liger's
    (LigerRMSNormFunction @ v0.8.2) saves its input as it comes, in the stream's dtype, and the fp32 rsqrt; its
    weight's gradient is recomputed from them."""
    h = spec.hidden_size
    if runtime.liger_kernels:
        return stream_dtype_bytes(settings, runtime) * h + 4
    return 4 * h + 4 + (2 * h if settings.method == "full" else 0)


def fused_qkv_lora_bytes(
    qkv: dict[str, tuple[int, int]],
    lora_names: set[str],
    settings: Settings,
    runtime: Runtime,
    input_requires_grad: bool,
) -> float:
    """litgpt's LoRAQKVLinear: one dropout and one lora_A (r outputs per adapted projection) for all of q/k/v;
    when some of them are not adapted, zero_pad's index_copy_ keeps the adapted outputs (c per column)."""
    adapted = [name for name in qkv if name in lora_names]
    if not adapted:
        return 0.0
    fan_in = next(iter(qkv.values()))[0]
    ranked = settings.model_copy(update={"lora_r": settings.lora_r * len(adapted)})
    saved = lora_module_saved_bytes(fan_in, ranked, runtime, input_requires_grad)
    if len(adapted) < len(qkv):
        saved += DTYPE_BYTES[settings.precision] * sum(qkv[name][1] for name in adapted)
    return saved


def keeps_bnb_inputs(settings: Settings, runtime: Runtime) -> bool:
    """Old bitsandbytes keeps the inputs of the layers it quantised; nothing is quantised without --quant."""
    return runtime.bnb_saves_input and settings.quant != "none"


def bnb_input_bytes_per_token(spec: ModelSpec, settings: Settings, input_requires_grad: bool = True) -> float:
    """The inputs old bitsandbytes keeps per layer: q/k/v share one (kept only if it needs a gradient, which
    the first layer's does not under LoRA), gate/up another, o_proj and down_proj their own."""
    c = DTYPE_BYTES[settings.precision]
    h, q, inter = spec.hidden_size, spec.q_size, spec.mlp_width
    experts = max(spec.num_experts_per_tok, 1) if spec.is_moe else 1
    qkv_input = h if input_requires_grad or settings.method == "full" else 0
    return c * (qkv_input + q + h + experts * inter)


def bnb_held_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """What old bitsandbytes' ctx attributes hold for one micro-batch, all layers and the quantised head:
    alive until the graph is freed."""
    if not keeps_bnb_inputs(settings, runtime):
        return 0.0
    layers = spec.num_hidden_layers
    per_token = bnb_input_bytes_per_token(spec, settings, input_requires_grad=False) + (
        layers - 1
    ) * bnb_input_bytes_per_token(spec, settings)
    if runtime.quantized_head:
        per_token += DTYPE_BYTES[settings.precision] * spec.hidden_size
    return per_token * settings.tokens_per_micro_batch


@lru_cache(maxsize=4096)  # the planner asks for the same few thousand times a plan; all four are frozen values
def activation_bytes_per_layer(
    spec: ModelSpec, settings: Settings, runtime: Runtime, input_requires_grad: bool = True
) -> float:
    """Saved bytes of one decoder layer for one micro-batch, without checkpointing."""
    parts = activation_parts_per_token(spec, settings, runtime, input_requires_grad)
    merged = 0.0 if runtime.separated_expert_lora else merged_expert_bytes(spec, settings)
    return sum(parts.values()) * settings.tokens_per_micro_batch + merged


def merged_expert_bytes(spec: ModelSpec, settings: Settings) -> float:
    """LoRA on an MoE's fused experts (lora_targets experts): peft's ParamWrapper parametrises each expert
    parameter as W + B A, materialised in the compute dtype for the layer's forward, and the expert matmuls save
    it for backward: one layer's expert weights per layer that keeps its activations (checked against the trace
    of Qwen3-30B-A3B, gpt-oss-20b and Mixtral in tests/test_moe.py)."""
    if not spec.expert_target_names(settings.lora_targets) or settings.method == "full":
        return 0.0
    return spec.expert_params * DTYPE_BYTES[settings.precision]


def swiglu_dtype_bytes(settings: Settings, runtime: Runtime) -> float:
    """The dtype SwiGLU's saved gate, silu(gate) and up are in: the compute dtype, or fp32 after peft's kbit
    preparation, whose fp32 residual stream reaches gate_proj and up_proj, and bitsandbytes' Linear4bit hands
    its output back in its input's dtype (`Linear4bit.forward`: `matmul_4bit(...).to(inp_dtype)`, bitsandbytes
    0.50.2).
    Traced: `make bench-stacks` (peft-kbit QLoRA without checkpointing), 6 x I bytes per token and layer over
    the bf16 count on Llama-2-7B and Llama-3.1-8B."""
    if settings.quant != "none":
        return stream_dtype_bytes(settings, runtime)
    return DTYPE_BYTES[settings.precision]


def attention_dtype_bytes(settings: Settings, runtime: Runtime) -> float:
    """The dtype the attention saves q, k, v and its output in: the compute dtype, or fp32 when peft's kbit
    preparation made the residual stream fp32 and no autocast casts the attention's inputs down - bitsandbytes
    hands q, k and v back in their fp32 input's dtype (`Linear4bit.forward`, 0.50.2) and SDPA runs in fp32.
    Traced: `make bench-stacks` (the peft-kbit plain-loop cases, no autocast): 2 x (2q + 2kv) bytes per token
    and layer over the bf16 count, 8h on Llama-2-7B and 5h on Llama-3.1-8B."""
    if not runtime.autocast and settings.quant != "none":
        return stream_dtype_bytes(settings, runtime)
    return DTYPE_BYTES[settings.precision]


def first_layer_input_requires_grad(settings: Settings, runtime: Runtime) -> bool:
    """The first layer's input needs a gradient - and its input norm and adapters save what the other layers'
    do - in full fine-tuning (trainable embeddings) or after enable_input_require_grads (Runtime.input_grads)."""
    return settings.method == "full" or runtime.input_grads


def stream_dtype_bytes(settings: Settings, runtime: Runtime) -> float:
    """Bytes per element of the residual stream between the layers: fp32 when fp32 norm weights (or peft's
    fp32 embeddings) promote it, else the compute dtype. transformers' RMSNorm returns `weight * x.to(dtype)`,
    which an fp32 weight promotes; Liger's writes its output in its input's dtype (ops/rms_norm.py
    rms_norm_forward, `Y = torch.empty(..., dtype=X.dtype)`, v0.4.2-0.8), so under Liger only fp32 embeddings
    make the stream fp32."""
    promoting_norms = runtime.fp32_norms and not runtime.liger_kernels
    return 4 if promoting_norms or runtime.fp32_stream else DTYPE_BYTES[settings.precision]


def checkpoint_bytes_per_layer(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """Under checkpointing a layer keeps only its input hidden state (c x h per token, fp32 when fp32 norm
    weights promoted the residual stream) until backward."""
    return stream_dtype_bytes(settings, runtime) * spec.hidden_size * settings.tokens_per_micro_batch


def checkpointed_layers_on_gpu(spec: ModelSpec, settings: Settings, runtime: Runtime = Runtime()) -> int:
    """Layers whose checkpointed input is on the GPU at the end of the forward pass: all of them, or with
    offload_activations (save_on_cpu around the forward) the one or two in flight to or from host memory, or
    under Unsloth's checkpointing the last layer's input and its two reused copy buffers."""
    if runtime.offloaded_checkpoints and settings.grad_ckpt and unsloth_offloads(spec, settings):
        return min(spec.num_hidden_layers, UNSLOTH_LAYERS_ON_GPU)
    if settings.offload_activations and settings.grad_ckpt:
        return min(spec.num_hidden_layers, OFFLOAD_LAYERS_ON_GPU)
    return spec.num_hidden_layers


def unsloth_offloads(spec: ModelSpec, settings: Settings) -> bool:
    """Unsloth offloads a layer input only above 2 MiB (MINIMUM_SIZE, gradient_checkpointing.py l. 694): below
    that, as for micro-batches of a few hundred tokens, every checkpoint stays on the GPU."""
    return DTYPE_BYTES[settings.precision] * spec.hidden_size * settings.tokens_per_micro_batch > 2 * 2**20


def offloaded_activation_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime = Runtime()) -> float:
    """Pinned host memory offload_activations holds: every layer's checkpointed input (N x h x c each), copied
    out in forward and back in backward."""
    unsloth = runtime.offloaded_checkpoints and unsloth_offloads(spec, settings)
    if not ((settings.offload_activations or unsloth) and settings.grad_ckpt):
        return 0.0
    width = stream_dtype_bytes(settings, runtime)
    layers = spec.num_hidden_layers - (1 if unsloth else 0)  # Unsloth keeps the last
    return layers * width * spec.hidden_size * settings.tokens_per_micro_batch


# The share of the free host RAM the offloading savers may fill: the data loader, the tokenizer and pinned
# staging buffers need the rest.
HOST_RAM_SHARE = 0.8


def host_saver_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime | None = None) -> float:
    """Host memory the offloading savers hold during a step: the pinned activations and the embedding table."""
    runtime = runtime or stack_runtime(settings)
    return offloaded_activation_bytes(spec, settings, runtime) + offloaded_embedding_bytes(spec, settings, runtime)


def host_saver_problem(spec: ModelSpec, settings: Settings, free_gib: float | None) -> str | None:
    """Why the offloading savers in `settings` do not fit the host RAM that is free, or None."""
    needed = host_saver_bytes(spec, settings)
    if not needed or free_gib is None or needed <= HOST_RAM_SHARE * free_gib * GIB:
        return None
    on = [name for name in ("offload_activations", "offload_embeddings") if getattr(settings, name)]
    return (
        f"{' and '.join(on)} need {gib(needed):.1f} GiB of host RAM and {free_gib:.1f} GiB is free "
        f"({HOST_RAM_SHARE:.0%} of it may be used); turn {' and '.join(on)} off or free some RAM"
    )


def activation_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """All layers' saved tensors at the end of the forward pass. With frozen embeddings (LoRA) the first
    layer's input norm needs no grad, so it saves nothing."""
    layers = spec.num_hidden_layers
    if settings.grad_ckpt:
        return checkpointed_layers_on_gpu(spec, settings, runtime) * checkpoint_bytes_per_layer(spec, settings, runtime)
    first = activation_bytes_per_layer(
        spec, settings, runtime, input_requires_grad=first_layer_input_requires_grad(settings, runtime)
    )
    rest = activation_bytes_per_layer(spec, settings, runtime)
    if wide := gemma4.double_wide_view(spec):  # the E2B's shared-KV layers: their MLP twice as wide
        shared = spec.global_layers.kv_shared_layers if spec.global_layers else 0
        return first + (layers - 1 - shared) * rest + shared * activation_bytes_per_layer(wide, settings, runtime)
    return first + (layers - 1) * rest


def grad_buffer_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime = Runtime()) -> float:
    """What backward through one layer holds besides its saved tensors: the gradients in flight (hidden-sized
    in the compute dtype; at the MLP the intermediate-sized gradient of down_proj's input, for LoRA also in the
    adapter's fp32). The coefficients are those of the traced backward of the real step
    (`python -m lorafit.trace.terms llama-2-7b --compare` and `qwen2.5-1.5b`, two shapes that separate the h
    and I terms): LoRA (4 + c) x I, full fine-tuning 2c x I + 8c x h, per token. With the adapters in the
    compute dtype under autocast (TRL's QLoRA) no fp32 gradient is made: I + c x h in TRL's traced step
    (`make bench-stacks`, Llama-2-7B and Llama-3.1-8B)."""
    c = DTYPE_BYTES[settings.precision]
    h, inter = spec.hidden_size, spec.mlp_width
    if settings.method == "full":
        per_token = 2 * c * inter + 8 * c * h
    elif compute_dtype_adapters_under_autocast(settings, runtime):
        per_token = inter + c * h
    else:
        per_token = (4 + c) * inter
    return per_token * settings.tokens_per_micro_batch + fp32_routing_backward_bytes(spec, settings)


def fp32_routing_backward_bytes(spec: ModelSpec, settings: Settings) -> float:
    """Gemma 4 26B-A4B's routing weights stay fp32 (Gemma4TextRouter: softmax in float32, times per_expert_scale),
    so transformers' grouped_mm_experts_forward weighs the expert outputs into fp32 (`proj_out * sample_weights_g`,
    then `weighted_out[inv_perm]`); backward through them holds, per token and routed expert, the reordered fp32
    gradient, the expert output's fp32 gradient and its cast to the compute dtype: (4 + 4 + c) x hidden. Read from
    transformers 5.25 integrations/moe.py; checked against the trace: `make bench-image-text`, the 26B-A4B at
    micro-batch 4 with the chunked loss, whose peak is a layer's backward."""
    if not gemma4.is_moe(spec):
        return 0.0
    c = DTYPE_BYTES[settings.precision]
    return (8 + c) * spec.num_experts_per_tok * spec.hidden_size * settings.tokens_per_micro_batch


def compute_dtype_adapters_under_autocast(settings: Settings, runtime: Runtime) -> bool:
    """Adapters in the compute dtype inside an autocast forward: nothing in the LoRA path is cast to fp32."""
    return runtime.lora_dtype == "compute" and runtime.autocast and settings.precision != "fp32"


def recompute_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """Backward of a checkpointed layer: its saved tensors, recomputed, plus what the recomputation and the
    backward hold in flight. For LoRA that is more than without checkpointing (the recomputed forward's own
    temporaries overlap the first gradients): 5c x I + 4c x h per token in the same traces. With the adapters
    in the compute dtype under autocast the intermediate-sized fp32 casts are gone: 4c x h (TRL's QLoRA step,
    `make bench-stacks`, within 2.5 kB per token on Llama-2-7B and Llama-3.1-8B)."""
    c = DTYPE_BYTES[settings.precision]
    if settings.method == "full":
        in_flight = grad_buffer_bytes(spec, settings)
    elif compute_dtype_adapters_under_autocast(settings, runtime):
        in_flight = 4 * c * spec.hidden_size * settings.tokens_per_micro_batch
    elif triton_kernels_apply(spec, runtime):
        # Unsloth's LoRA_MLP.backward (fast_lora.py @ 015bdef0, l. 116-200): down_proj's input gradient DW
        # (c x I; matmul_lora adds the LoRA product in place), the SwiGLU backward in place into DW, e and g, and
        # the hidden-sized gradients (4c x h); read from the source, not traced
        in_flight = (c * spec.intermediate_size + 4 * c * spec.hidden_size) * settings.tokens_per_micro_batch
    else:
        in_flight = (5 * c * spec.mlp_width + 4 * c * spec.hidden_size) * settings.tokens_per_micro_batch
    in_flight += 0.0 if settings.method == "full" else fp32_routing_backward_bytes(spec, settings)  # full: above
    return activation_bytes_per_layer(spec, settings, runtime) + in_flight


def dequant_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime = Runtime()) -> float:
    """bitsandbytes dequantises each 4/8-bit weight to the compute dtype for its matmul, one at a time."""
    if settings.quant == "none":
        return 0.0
    largest = max(fan_in * fan_out for _, fan_in, fan_out, _ in spec.layer_linears())
    return (
        max(largest * runtime.dequant_copies, expert_stack_params(spec, settings, runtime))
        * DTYPE_BYTES[settings.precision]
    )


def expert_stack_params(spec: ModelSpec, settings: Settings, runtime: Runtime) -> int:
    """4-bit experts (quantized_expert_params) run as grouped matmuls over one dequantised stack of every expert of
    the layer: gpt-oss pins its gate_up and down stacks through a checkpointed layer's backward (gpt_oss.py
    _forward_grouped_bnb4bit, l. 920-1000; moe_utils.py _moe_recompute_default, l. 412-447), Qwen3-MoE rebuilds
    them one at a time (moe_utils_bnb4bit.py forward_moe_backend_bnb4bit, l. 128-195). Counted as one layer's
    experts, both stacks: exact for gpt-oss, a third over for Qwen3-MoE, and over for gpt-oss where it loops over
    its experts instead: with LoRA on them, or without torch._grouped_mm (T4; torch 2.8 below Hopper) (l. 1018-1023;
    read from the source, not traced)."""
    if not quantized_expert_params(spec, settings, runtime):
        return 0
    return spec.expert_params


def optimizer_step_temp_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """Unfused (foreach) AdamW materialises sqrt(v) for every parameter it steps at once: the GPU's shard of
    them under ZeRO/FSDP."""
    if runtime.fused_optimizer or settings.optimizer != "adamw":
        return 0.0
    if on_host(settings)[2]:
        return 0.0  # the step runs on the CPU
    return trainable_params(spec, settings) * trainable_dtype_bytes(settings, runtime) * shard_factors(settings)[2]
