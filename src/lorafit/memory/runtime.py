"""How the trainer runs the step (`Runtime`, one per stack: catalog/stacks.toml) and the constants of the
libraries it runs (bitsandbytes' blocks, the chunk sizes of the losses, the checkpoint buffers)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from lorafit import stacks
from lorafit.models import ModelSpec
from lorafit.schema import Settings
from lorafit.units import DTYPE_BYTES

NF4_BLOCK = 64  # bitsandbytes blocksize for 4-bit weights
NESTED_BLOCK = 256  # double quantisation groups 256 absmax values
BNB_8BIT_MIN_SIZE = 4096  # bnb keeps 32-bit optimizer state for tensors smaller than this
BNB_8BIT_BLOCK = 256
HEAD_CHUNK = 128  # litgpt's lm_head_chunk_size: the LM head runs on 128 positions of every row at a time
# lorafit's own chunked loss (settings.loss "chunked", lorafit.train.savers): the LM head and the fp32
# cross-entropy run over chunks of this many tokens of the micro-batch, recomputed in backward
LOSS_CHUNK_TOKENS = 512  # one chunk of a 152k vocabulary: 12 x V x 512 bytes = 0.87 GiB of fp32 logits and gradients
# offload_activations: checkpointed layer inputs on the GPU at once (one being copied back for its layer's
# backward, the next one arriving)
OFFLOAD_LAYERS_ON_GPU = 2
# Unsloth's checkpointing (unsloth_zoo/gradient_checkpointing.py @ ce232d6c, UnslothCheckpointFunction): the last
# layer's input stays on the GPU (LAST_GC_INDEX) and the others come back through GPU buffers A and B, resized
# to a layer input and kept (double buffering when 512 MiB are free): three layer inputs on the GPU
UNSLOTH_LAYERS_ON_GPU = 3
# Unsloth's fused cross-entropy (unsloth_zoo/fused_losses/cross_entropy_loss.py @ ce232d6c, get_chunk_size):
# chunks of at most min(half the free memory, 4 GiB) of fp32 logits, their number a multiple of 4 unless one fits;
# the cap, and the target where no GPU is given (unsloth_chunk_target)
UNSLOTH_CHUNK_TARGET_BYTES = 4 * 2**30
ChunkSizing = Literal["capped", "half_free"]  # Runtime.fused_chunk_sizing
# Unsloth's rotary embeddings (unsloth/models/llama.py @ c7c67447, 2024.9: LlamaRotaryEmbedding and
# LlamaExtendedRotaryEmbedding `current_rope_size = min(4 * 8192, max_position_embeddings)`; gemma.py's
# GemmaFixedRotaryEmbedding the same): cos and sin caches of this many positions, built at load
UNSLOTH_ROPE_CACHE_POSITIONS = 4 * 8192


class Runtime(BaseModel):
    """How the framework runs the step. The defaults are lorafit's own trainer; catalog/stacks.toml sets them to
    describe the other stacks `--stack` offers (TRL's fused LM head, peft's fp32 upcast, litgpt's loop, ...).
    Code paths only published benchmark rows ran (torchtune's) are bench/torchtune_step.py's."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # hf: fp32 copy of all logits; chunked_compute: the head runs in chunks whose logits stay in the compute
    # dtype through the loss (litgpt); fused_logprob: TRL's fused LM head (trl.trainer.utils.add_fused_lm_head),
    # which folds 32768-wide vocabulary tiles of the logits into per-token log-probabilities and never holds the
    # full logits (fused_head_bytes)
    # fused_chunked: Unsloth's fused cross-entropy (unsloth_fused_ce_loss), the head and the fp32 loss over chunks
    # of at most 4 GiB of fp32 logits, the hidden states' gradient computed in forward (fused_chunked_loss_bytes);
    # liger_fused: Liger's fused linear cross-entropy, which makes the hidden states' gradient in the forward, a
    # chunk of logits at a time (liger_loss_bytes)
    # Unsloth's earlier losses, for runs of its older releases (unsloth/models/llama.py CausalLM_fast_forward):
    # compute_logits, before 2024-11-17 (@ 27d2d1df, l. 989): the head's logits of the whole micro-batch in the
    # compute dtype, which its Triton fast_cross_entropy_loss saves and overwrites with their gradient
    # (unsloth/kernels/cross_entropy_loss.py, Fast_CrossEntropyLoss: save_for_backward(logits, ...), backward
    # returns logits); cut_ce, from then (fa8e59eb, "Cut Cross Entropy") until the fused loss (806bee24,
    # 2025-08-13): Apple's cut_cross_entropy, an unsloth_zoo dependency, which never holds the logits, for a
    # micro-batch of more than 1024 tokens (b9fe2588, 2024-12-10; below it, compute_logits)
    loss: Literal[
        "hf", "chunked_compute", "fused_logprob", "fused_chunked", "liger_fused", "compute_logits", "cut_ce"
    ] = "hf"
    # Liger's RMSNorm, SwiGLU and rotary kernels (use_liger_kernel; catalog/stacks.toml [liger]): the norms save
    # their input in its own dtype and one fp32 rsqrt per row, SwiGLU saves gate and up only
    liger_kernels: bool = False
    kbit_upcast: bool = False  # peft prepare_model_for_kbit_training: non-quantised params to fp32
    lora_dtype: Literal["fp32", "compute"] = "fp32"  # peft autocasts adapters to fp32 by default
    fused_optimizer: bool = True  # adamw_torch_fused: no param-sized temporaries in the step
    # the model runs under torch.compile: Inductor fuses chains of elementwise ops into one kernel each, which
    # the time model counts (timing.py); the memory model does not model compile's own buffers
    compiled: bool = False
    amp_master_fp32: bool = False  # fp32 master weights with a bf16/fp16 autocast copy
    device: Literal["cuda", "cpu"] = "cuda"  # CPU dropout keeps a float mask where CUDA keeps a bool one
    # the HF Trainer with bf16/fp16 runs the forward under torch.autocast: peft's fp32 adapter matmuls then
    # save their inputs in the compute dtype
    autocast: bool = True
    # peft's kbit preparation followed by TRL's peft_module_casting_to_bf16 leaves the RMSNorm weights in fp32:
    # `weight * x.to(bf16)` then promotes every norm output, and with it the residual stream, to fp32
    fp32_norms: bool = False
    # peft's prepare_model_for_kbit_training upcasts the embeddings too, so the residual stream is fp32 from the
    # first layer on, and bitsandbytes' Linear4bit returns its output in its input's dtype (`.to(inp_dtype)`):
    # gate and up come out fp32 and SwiGLU saves its three tensors in fp32 (autocast runs only the matmuls and
    # the attention in the compute dtype)
    fp32_stream: bool = False
    # transformers' enable_input_require_grads (peft's kbit preparation with reentrant checkpointing, and the peft
    # QLoRA scripts' own call in their plain loops): the embeddings' output requires grad, so the first layer saves
    # for backward what every other layer does (its input norm, its adapters' dropout masks)
    input_grads: bool = False
    # bitsandbytes before 0.43.2 kept each 4/8-bit layer's input for backward as a ctx attribute
    # (`ctx.tensors = (A, B)`): it lives as long as the graph does, not only until that layer's backward
    bnb_saves_input: bool = False
    # litgpt's GPT has its own lm_head even where the checkpoint ties it to the embeddings
    untied_head: bool = False
    # Lightning's BitsandbytesPrecision (litgpt) converts every nn.Linear, the LM head too, and quantises from
    # an fp16 copy: each dequantisation makes an fp16 weight and then its cast to the compute dtype, two
    # copies at once
    quantized_head: bool = False
    dequant_copies: int = Field(default=1, ge=1)
    # litgpt's fused qkv projection: one LoRA (one dropout) for all adapted q/k/v, k and v repeated to every
    # head and copied, v a view of the fused output when there are as many kv heads as heads
    fused_qkv: bool = False
    # litgpt's loop keeps `logits` and `loss` of the last micro-batch until the next forward and loss replace
    # them: its logits, and through the loss its graph (with the bnb inputs held there), live through the
    # next forward
    keeps_previous_step: bool = False
    # CUDA context, cuBLAS/cuDNN workspaces and the kernel images a training step loads (flash-attn, bnb, fused
    # optimizers): nvidia-smi minus reserved; see device_bytes for the measurement
    cuda_context_gib: float = 0.9
    nccl_gib: float = 1.2  # NCCL buffers and the collective streams' pools, per GPU, when training on several
    # the shards under which a 4/8-bit base is loaded whole onto every GPU before it is sharded: transformers
    # quantises it on the process's GPU (bitsandbytes' device_map), accelerate's FSDP2 keeps bitsandbytes'
    # Params4bit off the meta device, and DeepSpeed moves a model that ZeRO-3 did not build whole to the GPU.
    # A shard not listed loads the base in host memory and moves it to the GPUs one sharded layer at a time
    quantized_whole_on_gpu: tuple[str, ...] = ("zero3",)
    # Unsloth's gradient checkpointing ("unsloth"): every checkpointed layer input but the last goes to pinned host
    # memory, whatever offload_activations says (checkpointed_layers_on_gpu)
    offloaded_checkpoints: bool = False
    # Unsloth's Triton RMSNorm / RoPE / SwiGLU and, with lora_dropout 0, its LoRA autograd functions for q/k/v, o
    # and the MLP: fewer saved tensors per layer (triton_kernel_parts)
    triton_kernels: bool = False
    # the families whose step Unsloth's FastLanguageModel patches with those kernels; the others it loads through
    # FastModel, where transformers' own modules run under its compiler (triton_kernels_apply). Empty: every family
    kernel_families: tuple[str, ...] = ()
    # Unsloth's 4-bit load quantises an MoE's experts too (NF4, as the linears): transformers' bitsandbytes
    # integration packs nn.Linear only and leaves the fused 3-D experts 16-bit (quantized_expert_params)
    quantized_experts: bool = False
    # an image-text model's vision tower and projector packed with the rest by a 4-bit load (transformers'
    # quantizer skips neither); Unsloth's skips them (llm_int8_skip_modules: vision_tower, multi_modal_projector)
    quantized_vision: bool = True
    # LoRA on an MoE's experts added beside the base's grouped matmul, ((x A) B) per expert, instead of peft's
    # W + B A materialised for the layer (Unsloth's default: unsloth_zoo temporary_patches/moe_utils.py @ ce232d6c,
    # _should_use_separated_lora l. 1095-1097, forward_native_grouped_mm l. 1619-1680): no merged weight is kept
    # (merged_expert_bytes); the N k x r products it saves are not counted (read from the source, not traced)
    separated_expert_lora: bool = False
    # Unsloth under a transformers whose attention layers still built their own rotary embedding (before 4.48):
    # its patched attention __init__ (unsloth/models/_utils.py @ c7c67447 patch_linear_scaling, which swaps the
    # `self.rotary_emb = ...` line of the attention's __init__ for its own class) gives every layer cos/sin caches,
    # "compute": downcast to the model's dtype (llama.py post_patch, "Downcast RoPE embedding"); "fp32": Gemma's,
    # kept in fp32 (gemma.py post_patch, "RoPE must be done in float32 for Gemma"): rope_cache_bytes. At the
    # pinned versions the attention has no rotary_emb line (patch_linear_scaling returns None) and one cache
    # serves the model (16 MB for a 128-wide head), not counted
    per_layer_rope_cache: Literal["compute", "fp32"] | None = None
    # How Unsloth's fused cross-entropy sizes its chunks (unsloth_chunk_target, unsloth_chunk_tokens). "capped":
    # the pinned unsloth_zoo, since d9fe1f43 (2026-07-06, "Cap the fused cross entropy chunk target"): at most
    # min(half the free memory, 4 GiB) of fp32 logits a chunk, their count rounded up to a multiple of 4.
    # "half_free": the releases before it (the fused loss came in fc29e051, 2025-08-13): half the free memory,
    # no cap, the count rounded to the nearest multiple of 4 and at least 1 (cross_entropy_loss.py @ de203d37,
    # get_chunk_size), so fp32 logits under the whole target are scored in one chunk
    fused_chunk_sizing: ChunkSizing = "capped"
    # DeepSpeed's zero_optimization.reduce_bucket_size under ZeRO-3, in elements; None: the 5e7 lorafit's own
    # deepspeed.json writes (memory.weights.DEEPSPEED_BUCKET_ELEMENTS). ZeRO-3 allocates one buffer of that many
    # elements in the communication dtype (communication_buffer_bytes)
    zero3_reduce_bucket: int | None = Field(default=None, gt=0)


def triton_kernels_apply(spec: ModelSpec, runtime: Runtime) -> bool:
    """Unsloth's Triton kernels run only in the families FastLanguageModel patches (Runtime.kernel_families); an
    image-text model is its own model_type (mistral3, qwen2_5_vl, Llama 3.2 Vision's mllama), which it loads
    through FastModel."""
    if not runtime.kernel_families:
        return runtime.triton_kernels
    text_model = spec.vision is None and spec.cross_attention is None
    return runtime.triton_kernels and text_model and spec.architecture in runtime.kernel_families


def quantized_expert_params(spec: ModelSpec, settings: Settings, runtime: Runtime) -> int:
    """The MoE expert weights a 4-bit load packs beside the linears: none under transformers' integration, every
    layer's under Unsloth's (unsloth_zoo temporary_patches/moe_utils_bnb4bit.py @ ce232d6c: the fused 3-D experts
    made Params4bit, l. 197-255, 257-312; gpt-oss's -unsloth-bnb-4bit repo holds one bnb Linear4bit per expert,
    gpt_oss.py GptOssExpertsBnb4bit l. 812-836)."""
    if settings.quant == "none" or not runtime.quantized_experts:
        return 0
    return spec.expert_params * spec.num_hidden_layers


def packed_params(spec: ModelSpec, settings: Settings, runtime: Runtime) -> int:
    """The weights a 4-bit load packs: the decoder's linears (and the vision tower's, unless the load skips it,
    unsloth_zoo/peft_utils.py @ ce232d6c SKIP_QUANTIZATION_MODULES l. 35-52), and the experts where it packs them."""
    vision = 0 if runtime.quantized_vision or not spec.vision else spec.vision.linear_params(spec.hidden_size)
    return spec.quantized_linear_params - vision + quantized_expert_params(spec, settings, runtime)


def rope_cache_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """Unsloth's per-layer rotary caches (Runtime.per_layer_rope_cache): cos and sin, each positions x head_dim in
    the compute dtype (fp32 for Gemma), in every layer; resident from the load on, like the weights."""
    if runtime.per_layer_rope_cache is None:
        return 0.0
    positions = min(UNSLOTH_ROPE_CACHE_POSITIONS, spec.max_position_embeddings)
    c = 4 if runtime.per_layer_rope_cache == "fp32" else DTYPE_BYTES[settings.precision]
    return spec.num_hidden_layers * 2 * positions * spec.head_size * c


KBIT_PREP_FIELDS = ("kbit_upcast", "fp32_norms", "fp32_stream")


def stack_runtime(settings: Settings, **overrides: Any) -> Runtime:
    """The Runtime of the trainer `settings.stack` names (lorafit.stacks, catalog/stacks.toml), with the facets
    the settings switch (autocast, kbit_prep, fp32_adapters, fused_optimizer, torch_compile, liger) and
    `overrides` (e.g. device) on top."""
    quantized = settings.quant != "none"
    fields = stacks.resolve(settings.stack).facts(quantized, liger=bool(settings.liger))
    if settings.autocast is not None:
        fields["autocast"] = settings.autocast
    if settings.fused_optimizer is not None:
        fields["fused_optimizer"] = settings.fused_optimizer
    if settings.fp32_adapters is not None:
        fields["lora_dtype"] = "fp32" if settings.fp32_adapters else "compute"
    if settings.torch_compile is not None:
        fields["compiled"] = settings.torch_compile
    if settings.kbit_prep is not None and quantized:
        # peft's preparation upcasts every non-quantised parameter, the norms' weights and the embeddings too, to
        # fp32: the norms' outputs and with them the residual stream are fp32 (Runtime.fp32_norms, fp32_stream),
        # as far as the stack leaves them so (StackSpec.kbit_prep_runtime)
        kbit = stacks.resolve(settings.stack).kbit_prep_runtime
        fields |= {name: settings.kbit_prep and kbit.get(name, False) for name in KBIT_PREP_FIELDS}
    if settings.autocast is False and fields.get("kbit_upcast"):
        # a plain loop over peft's kbit preparation (the peft QLoRA scripts) calls enable_input_require_grads; the
        # Trainer's path calls it only with checkpointing, where the first layer's recompute counts it anyway
        fields["input_grads"] = True
    return Runtime(**(fields | overrides))
