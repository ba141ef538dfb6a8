"""What every parameter holds: the base weights (16-bit or packed 4/8-bit), the adapters, their gradients and
optimizer states, and how ZeRO / FSDP split them over the GPUs and gather them back."""

from __future__ import annotations

from lorafit.memory.runtime import BNB_8BIT_BLOCK, BNB_8BIT_MIN_SIZE, NESTED_BLOCK, NF4_BLOCK, Runtime, packed_params
from lorafit.models import ModelSpec
from lorafit.schema import Settings
from lorafit.units import DTYPE_BYTES


# --- weights ------------------------------------------------------------------------------------------------
def quantized_weight_bytes(n_params: int, settings: Settings) -> float:
    """Packed base weights plus quantisation state.

    NF4: 4 bits per weight, one absmax per 64 weights (fp32, or uint8 plus one fp32 per 256 absmax with double
    quantisation). int8 (LLM.int8): 1 byte per weight plus an fp32 scale per output row (~0.1%, folded in)."""
    if settings.quant == "nf4":
        absmax = 1 / NF4_BLOCK + 4 / (NF4_BLOCK * NESTED_BLOCK) if settings.double_quant else 4 / NF4_BLOCK
        return n_params * (0.5 + absmax)
    if settings.quant == "int8":
        return n_params * 1.001
    raise ValueError(settings.quant)


def weights_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """Base model weights: all in the compute dtype, or the decoder linears packed and the rest (embeddings,
    LM head, norms, biases) in the compute dtype - fp32 if peft's kbit preparation upcast them."""
    return _base_weights_bytes(spec, settings, runtime) - offloaded_embedding_bytes(spec, settings, runtime)


def _base_weights_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    c = DTYPE_BYTES[settings.precision]
    if settings.method == "full" and runtime.amp_master_fp32:
        c = 4
    head_copy = spec.embedding_params if runtime.untied_head and spec.tie_word_embeddings else 0
    if settings.quant == "none":
        return (spec.num_params + head_copy) * c
    linear = packed_params(spec, settings, runtime)
    rest = spec.num_params - linear
    if runtime.quantized_head:
        # the head quantised like the layers; the embeddings stay in the compute dtype
        head = spec.lm_head_params + head_copy
        return quantized_weight_bytes(linear + head, settings) + (rest - spec.lm_head_params) * c
    return quantized_weight_bytes(linear, settings) + (rest + head_copy) * (4 if runtime.kbit_upcast else c)


def embedding_offload_applies(spec: ModelSpec, settings: Settings) -> bool:
    """The input embedding can stay on the CPU only when it is frozen (not full fine-tuning) and not the LM
    head's weight too (tied embeddings: the head runs on the GPU)."""
    return settings.method != "full" and not spec.tie_word_embeddings


def offloaded_embedding_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """offload_embeddings: the frozen input embedding (V x h, in the dtype the rest of the base is in) stays in
    host memory; each micro-batch gathers its N rows there and copies them (N x h x c) to the GPU, which the
    embedding's output costs anyway."""
    if not settings.offload_embeddings or not embedding_offload_applies(spec, settings):
        return 0.0
    c = 4 if runtime.kbit_upcast and settings.quant != "none" else DTYPE_BYTES[settings.precision]
    return spec.embedding_params * c


def trainable_params(spec: ModelSpec, settings: Settings) -> int:
    if settings.method == "full":
        return spec.num_params
    return spec.lora_params(settings.lora_r, settings.lora_targets) + saved_module_params(spec, settings)


# --- train_embeddings: peft's modules_to_save ----------------------------------------------------------------
def saved_module_params(spec: ModelSpec, settings: Settings) -> int:
    """train_embeddings: peft's ModulesToSaveWrapper (peft 0.21.2 utils/other.py, update) keeps the frozen
    module and trains a copy.deepcopy of it: the input embedding and the LM head, V x h each; with tied
    embeddings one module (lorafit passes ensure_weight_tying: the head's copy shares the embedding copy's
    weight, tuners_utils._add_modules_to_save_to_tie)."""
    if not settings.train_embeddings or settings.method == "full":
        return 0
    return spec.embedding_params + spec.lm_head_params


def saved_module_dtype_bytes(settings: Settings, runtime: Runtime) -> float:
    """The copies keep the module's own dtype (deepcopy): the compute dtype the base loads in (bitsandbytes
    never quantises an embedding, and transformers keeps lm_head out of the 4/8-bit modules), fp32 where
    peft's prepare_model_for_kbit_training upcast the non-quantised weights first."""
    return 4 if runtime.kbit_upcast and settings.quant != "none" else DTYPE_BYTES[settings.precision]


def saved_module_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """The trained copies (their weights, or one gradient each)."""
    return saved_module_params(spec, settings) * saved_module_dtype_bytes(settings, runtime)


def trainable_dtype_bytes(settings: Settings, runtime: Runtime) -> float:
    """Adapters are fp32 (peft's autocast_adapter_dtype); full fine-tuning trains the weights' own dtype."""
    if settings.method == "full":
        return 4 if runtime.amp_master_fp32 else DTYPE_BYTES[settings.precision]
    return 4 if runtime.lora_dtype == "fp32" else DTYPE_BYTES[settings.precision]


def adapter_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    if settings.method == "full":
        return 0.0
    return gradient_bytes(spec, settings, runtime)


def gradient_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """One gradient per trainable parameter, in its dtype, all alive until the optimizer step."""
    saved = saved_module_params(spec, settings)
    adapters = (trainable_params(spec, settings) - saved) * trainable_dtype_bytes(settings, runtime)
    return adapters + saved_module_bytes(spec, settings, runtime)


def head_grad_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """Gradients of the LM head and final norm, the first ones full fine-tuning produces; with train_embeddings
    the head copy's (V x h, made by the head's backward at the loss; the shared one when tied)."""
    if settings.method != "full":
        head = spec.lm_head_params or spec.embedding_params
        return head * saved_module_dtype_bytes(settings, runtime) if saved_module_params(spec, settings) else 0.0
    return (spec.lm_head_params + spec.hidden_size) * trainable_dtype_bytes(settings, runtime)


def embedding_backward_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """train_embeddings: the V x h buffers the embedding's backward holds beside the gradients. Tied, the one
    trained weight is used twice, so autograd sums its two gradients (the head's, the embedding's dense one)
    in a buffer before it lands in .grad: two more buffers, three once .grad holds an accumulated one (the
    `--exact` trace of Llama-3.2-1B at 512 tokens, grad_accum 1 and 2). Untied, the dense gradient becomes
    .grad, or, accumulated, is a new buffer added into it (torch's AccumulateGrad: grad += new)."""
    if not saved_module_params(spec, settings):
        return 0.0
    accumulated = settings.grad_accum > 1
    buffers = (3 if accumulated else 2) if spec.tie_word_embeddings else (1 if accumulated else 0)
    return buffers * spec.embedding_params * saved_module_dtype_bytes(settings, runtime)


def embedding_grad_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """The input embedding's dense gradient (V x h), the last one backward makes; with train_embeddings and tied
    embeddings it adds into the head's, which exists already."""
    if settings.method != "full":
        untied = saved_module_params(spec, settings) and not spec.tie_word_embeddings
        return spec.embedding_params * saved_module_dtype_bytes(settings, runtime) if untied else 0.0
    return spec.embedding_params * trainable_dtype_bytes(settings, runtime)


def optimizer_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """AdamW keeps two moments per trainable parameter in the parameter's dtype (torch), fp32 (bitsandbytes'
    32-bit paged AdamW, whatever the parameter's dtype) or 8-bit blockwise (bitsandbytes, with 32-bit state for
    tensors under 4096 elements); SGD without momentum keeps none.
    DeepSpeed ZeRO (zero2, zero3) steps an fp32 master copy of its partition instead of the parameters, even
    where they are fp32 already (stage_1_and_2.py single_partition_of_fp32_groups, stage3.py
    fp32_partitioned_groups_flat): 4 more bytes a trainable parameter, and the moments are fp32 too."""
    n = trainable_params(spec, settings)
    saved = saved_module_params(spec, settings)  # train_embeddings: the copies, in their own dtype
    zero = settings.shard in ("zero2", "zero3")
    master = 4 * n if zero else 0.0
    if settings.optimizer == "sgd":
        return master
    if settings.optimizer == "paged_adamw_32bit":  # bitsandbytes' 32-bit states are fp32 (get_state_buffer)
        return 2 * n * 4 + master
    if settings.optimizer == "adamw":
        if zero:
            return 2 * n * 4 + master
        own = 2 * saved * saved_module_dtype_bytes(settings, runtime)
        return 2 * (n - saved) * trainable_dtype_bytes(settings, runtime) + own + master
    small = _params_in_small_tensors(spec, settings)
    return 2 * (n - small) * (1 + 4 / BNB_8BIT_BLOCK) + 2 * small * 4 + master


def _params_in_small_tensors(spec: ModelSpec, settings: Settings) -> int:
    """Trainable parameters that bnb keeps in 32-bit state: tensors too small for 8-bit (norms, biases, tiny
    LoRA) and, in full fine-tuning, the input embedding, which transformers' Trainer (and train/build.py)
    registers for 32-bit state under every 8-bit bitsandbytes optimizer."""
    if settings.method == "full":
        per_layer = spec.layer_other_params if spec.hidden_size < BNB_8BIT_MIN_SIZE else 0
        small = spec.num_hidden_layers * per_layer + (spec.hidden_size if spec.hidden_size < BNB_8BIT_MIN_SIZE else 0)
        return small + spec.embedding_params
    # train_embeddings: the embedding copy is an nn.Embedding too (the head's copy, a Linear, steps in 8 bits)
    small = spec.embedding_params if saved_module_params(spec, settings) else 0
    r = settings.lora_r
    names = set(spec.lora_target_names(settings.lora_targets))
    per_layer = 0
    for name, fan_in, fan_out, copies in spec.layer_linears():
        if name in names:
            per_layer += sum(r * dim for dim in (fan_in, fan_out) if r * dim < BNB_8BIT_MIN_SIZE) * copies
    return small + per_layer * spec.num_hidden_layers


def paged(settings: Settings) -> bool:
    """bnb paged optimizers keep their state in CUDA managed memory, which the torch allocator does not count."""
    return settings.optimizer.startswith("paged")


# --- several GPUs -------------------------------------------------------------------------------------------
def world_size(settings: Settings) -> int:
    """Every GPU of the run: n_gpus on each of the nodes."""
    return settings.n_gpus * settings.nodes


def shard_factors(settings: Settings) -> tuple[float, float, float]:
    """Fraction of (weights, gradients, optimizer states) each GPU holds, over all n_gpus x nodes GPUs.

    ZeRO (Rajbhandari et al. 2020, section 5): stage 2 partitions gradients and optimizer states, stage 3 the
    parameters too; FSDP's full shard is stage 3. DDP keeps everything on every GPU."""
    n = world_size(settings)
    if settings.shard in ("zero3", "fsdp"):
        return 1 / n, 1 / n, 1 / n
    if settings.shard == "zero2":
        return 1.0, 1 / n, 1 / n
    return 1.0, 1.0, 1.0


def offload_of(settings: Settings) -> str:
    """What the engine keeps in host memory. DeepSpeed has both offloads (offload_optimizer: gradients,
    optimizer states and the optimizer step, ZeRO-Offload; offload_param: the parameter partitions too). FSDP
    has only CPUOffload(offload_params=True), which moves parameters, gradients and the step: what `lorafit
    train` writes for either setting (train/distributed.py), so it is estimated as `params`."""
    if settings.offload != "none" and settings.shard == "fsdp":
        return "params"
    return settings.offload


def on_host(settings: Settings) -> tuple[bool, bool, bool]:
    """Whether (weights, gradients, optimizer states) live in host memory instead of on the GPU."""
    offload = offload_of(settings)
    return offload == "params", offload != "none", offload != "none"


def quant_state_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """The 4-bit weights' quantisation state (absmax, nested absmax): an attribute of bitsandbytes' Params4bit,
    not a parameter, so ZeRO-3 and FSDP neither shard it nor offload it; every GPU keeps all of it."""
    if settings.quant != "nf4":
        return 0.0
    linear = packed_params(spec, settings, runtime)
    if runtime.quantized_head:
        linear += spec.lm_head_params
    return quantized_weight_bytes(linear, settings) - 0.5 * linear


def sharded_weight_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """The base weights one GPU holds: its shard of the parameters (none when they are offloaded) and, for a
    4-bit base under ZeRO-3/FSDP, the whole quantisation state (quant_state_bytes)."""
    total = weights_bytes(spec, settings, runtime)
    w_share = shard_factors(settings)[0]
    if w_share == 1.0 and not on_host(settings)[0]:
        return total
    state = quant_state_bytes(spec, settings, runtime)
    return (0.0 if on_host(settings)[0] else (total - state) * w_share) + state


def gathered_param_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """Bytes of every parameter as ZeRO-3/FSDP all-gather them: the packed 4-bit weights (0.5 byte a weight,
    stored as the compute dtype), the rest in its dtype, the adapters in theirs. The volume `Psi` of the
    communication model."""
    base = weights_bytes(spec, settings, runtime) - quant_state_bytes(spec, settings, runtime)
    return base + adapter_bytes(spec, settings, runtime)


def gathered_layer_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """ZeRO-3/FSDP gather a full layer (and prefetch the next) before using it: two layers in flight, in the
    dtype they are stored in (packed 4-bit linears: 0.5 byte a weight; the quantisation state is on every GPU
    already)."""
    if settings.shard not in ("zero3", "fsdp"):
        return 0.0
    c = DTYPE_BYTES[settings.precision]
    linear_bytes = 0.5 if settings.quant == "nf4" else c
    return 2 * (spec.layer_linear_params * linear_bytes + spec.layer_other_params * c)


# The reduce bucket lorafit's deepspeed.json sets (zero_optimization.reduce_bucket_size, in elements): a tenth of
# DeepSpeed's default 5e8, whose buffers alone would take 4 GB of a GPU for fp32 adapters under ZeRO-2. torch DDP
# copies the gradients into its buckets (gradient_as_bucket_view is False under the HF Trainer).
DEEPSPEED_BUCKET_ELEMENTS = 50_000_000


def communication_buffer_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """Gradient buffers of the collective itself, per GPU, beside NCCL's own (Runtime.nccl_gib): DDP's buckets
    hold a second copy of every gradient; DeepSpeed allocates its reduce buckets whole, whatever the model's
    size: ZeRO-2 two of them with overlap_comm (stage_1_and_2.py, the double buffer of each ipg bucket), ZeRO-3
    one (stage3.py @ v0.19.8 l. 780-784: reduce_bucket_size elements of the communication dtype, which
    engine.py's communication_data_type makes the bf16/fp16 compute dtype, l. 1719-1730), Runtime.zero3_reduce_bucket
    elements where the run's config sets another size (ZeRO-2's buffers are lorafit's own deepspeed.json's, with
    overlap_comm); FSDP reduce-scatters each layer's gradients as they come
    (in gathered_layer_bytes)."""
    if world_size(settings) == 1 and settings.offload == "none":
        return 0.0
    grad = trainable_dtype_bytes(settings, runtime)
    n = trainable_params(spec, settings)
    if settings.shard in ("none", "ddp"):
        return n * grad
    if settings.shard == "zero3":
        return (runtime.zero3_reduce_bucket or DEEPSPEED_BUCKET_ELEMENTS) * DTYPE_BYTES[settings.precision]
    if settings.shard == "zero2":
        return 2 * DEEPSPEED_BUCKET_ELEMENTS * grad
    return 0.0
