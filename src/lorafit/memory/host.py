"""Host memory: what each training process holds on the CPU side (loading the model, offloaded states and
activations)."""

from __future__ import annotations

from lorafit.memory.activations import host_saver_bytes
from lorafit.memory.runtime import Runtime
from lorafit.memory.weights import (
    gathered_param_bytes,
    on_host,
    shard_factors,
    trainable_params,
    weights_bytes,
    world_size,
)
from lorafit.models import ModelSpec
from lorafit.schema import Settings
from lorafit.units import BYTES_PER_GIB as GIB
from lorafit.units import DTYPE_BYTES

# --- host memory --------------------------------------------------------------------------------------------
# DeepSpeed's CPU Adam (and torch's AdamW on FSDP's host shards) keeps, per trainable parameter it steps: an fp32
# master copy, the fp32 gradient and two fp32 moments (ZeRO-Offload, Ren et al. 2021, section 4.1: 16 bytes).
HOST_OPTIMIZER_BYTES_PER_PARAM = 16
# What one training process holds in host memory before any weight: the CUDA runtime and kernel images mapped
# in, torch, transformers, peft, the tokenizer and the data loader. A chosen round figure, not measured by this
# project on CUDA (a CPU process importing the same libraries holds about 1 GiB; the CUDA libraries add more).
PROCESS_HOST_BYTES = 3 * GIB
# transformers' save_pretrained writes checkpoints in files of at most 5 GB (max_shard_size); a quantised load
# reads one file at a time into host memory and quantises it on the GPU.
CHECKPOINT_FILE_BYTES = 5e9


def processes_per_node(settings: Settings) -> int:
    return settings.n_gpus


def loading_bytes_per_process(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """Host memory a process needs to load the model, as `lorafit train` loads it (train/recipe.py): a 4/8-bit
    base goes straight to the process's GPU, one checkpoint file at a time, unless it is loaded in host memory
    for the shard (host_loads_the_base: then the whole packed base and the file being quantised); a 16-bit one
    is built in host memory first, whole, in the compute dtype, and only then moved to the GPU or sharded.
    Every process of a node loads its own copy: the loading peak that stops many multi-GPU runs before their
    first step."""
    if settings.quant == "none":
        return spec.num_params * DTYPE_BYTES[settings.precision]
    one_file = min(CHECKPOINT_FILE_BYTES, spec.num_params * DTYPE_BYTES[settings.precision])
    if host_loads_the_base(settings, runtime):
        return weights_bytes(spec, settings, runtime) + one_file
    return one_file


def offloaded_state_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> dict[str, float]:
    """Per process, what the offload keeps in host memory: its shard of the parameters (offload params) and,
    for either offload, its shard of the optimizer's fp32 state (HOST_OPTIMIZER_BYTES_PER_PARAM)."""
    weights_host, _, optimizer_host = on_host(settings)
    w_share, _, o_share = shard_factors(settings)
    parts = {}
    if weights_host:
        parts["offloaded_weights"] = gathered_param_bytes(spec, settings, runtime) * w_share
    if optimizer_host:
        states = 0 if settings.optimizer == "sgd" else HOST_OPTIMIZER_BYTES_PER_PARAM
        parts["offloaded_optimizer"] = trainable_params(spec, settings) * states * o_share
    return parts


def shards_a_quantized_base(settings: Settings) -> bool:
    """A 4/8-bit base that ZeRO-3/FSDP shard over several GPUs: where how it is loaded matters."""
    return settings.quant != "none" and settings.shard in ("zero3", "fsdp") and world_size(settings) > 1


def host_loads_the_base(settings: Settings, runtime: Runtime) -> bool:
    """A sharded quantised base loaded in host memory by every process, and moved to its GPU one sharded layer
    at a time by the engine (FSDP2's fully_shard), rather than whole onto every GPU first. `lorafit train`
    loads it so where the plan says so (train/recipe.py `_load_model`)."""
    return shards_a_quantized_base(settings) and settings.shard not in runtime.quantized_whole_on_gpu


def gpu_loading_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """A 4/8-bit base that ZeRO-3/FSDP shard and that is loaded whole onto every process's GPU first
    (Runtime.quantized_whole_on_gpu) is only sharded after that: for a moment each GPU holds all of it. 0 where
    it is loaded in host memory (one layer at a time reaches the GPU) or the step keeps the whole base anyway."""
    on_gpu = shards_a_quantized_base(settings) and not host_loads_the_base(settings, runtime)
    return weights_bytes(spec, settings, runtime) if on_gpu else 0.0


def host_ram_parts(spec: ModelSpec, settings: Settings, runtime: Runtime) -> dict[str, float]:
    """Host RAM one machine needs, in bytes, as the larger of its two peaks: loading (every process its copy,
    loading_bytes_per_process) and training (every process's runtime, its offloaded states, and the pinned
    activations and embeddings of the savers)."""
    processes = processes_per_node(settings)
    offloaded = offloaded_state_bytes(spec, settings, runtime)
    savers = host_saver_bytes(spec, settings, runtime)
    training: dict[str, float] = {"processes": processes * PROCESS_HOST_BYTES}
    training |= {name: processes * value for name, value in offloaded.items()}
    if savers:
        training["offloaded_savers"] = processes * savers
    loading: dict[str, float] = {
        "processes": processes * PROCESS_HOST_BYTES,
        "model_loading": processes * loading_bytes_per_process(spec, settings, runtime),
    }
    return training if sum(training.values()) >= sum(loading.values()) else loading
