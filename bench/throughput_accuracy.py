"""Predicted vs published training throughput (tokens/s per GPU), side by side, for the calibration rows that
report a speed. Run: `make bench-throughput`.

Each row's split comes from bench/calibration/measured_memory.csv (the same column as `make bench-memory`):
"fit" rows set or were printed beside the constants of lorafit/timing.py (MATMUL_SHAPE_SHARE from FMS-01/03/04,
QUANT_MATMUL_SLOWDOWN from FMS-06/07; the torchtune and fms-acceleration reference rows were looked at beside
them), so their error only shows the fit; the cards' matmul rates are published measurements (catalog/gpus.toml),
not fitted to any row; "check" rows were not used, and their summary is the test: overall, per GPU class, per
stack, one GPU vs several, eager vs torch.compile.

Speeds are compared per GPU. A row's tokens/s is read as its source defines it (PER_JOB below); a row with only a
step time is converted with the tokens of one step on one GPU (micro_batch x seq_len x grad_accum of its
settings). lorafit's `tokens_per_second` is the whole job's, divided here by the run's GPUs.
"""

from __future__ import annotations

import csv
import statistics
import sys
from pathlib import Path

from lorafit import costs, hardware, memory, models, timing
from lorafit.schema import Settings
from lorafit.timing import tokens_per_second

CALIBRATION = Path(__file__).resolve().parent / "calibration" / "measured_memory.csv"

# row id -> (preset, gpu, settings). Settings are those the row's source states (see its notes column), the rest
# from the config the source ran at its commit; the row's split (fit / check) is the CSV's. `stack` is set only
# for the stacks lorafit offers (`lorafit stacks`); torchtune rows run on the default.
FMS = dict(seq_len=4096, grad_ckpt=True, attn="flash", lora_r=16, lora_targets="attn", grad_accum=1, stack="trl")
# its full-finetuning and standard-peft scenarios set torch_dtype bfloat16 without the bf16 flag (scenarios.yaml at
# both commits): the Trainer runs no autocast, so peft 0.13.2's fp32 adapters (autocast_adapter_dtype) run their
# matmuls in fp32; the bnb and gptq scenarios set bf16/fp16 True
FMS_PURE = dict(FMS, autocast=False)
# torchtune README @0217d44 table ('Batch Size = 4, Seq Length = 2048'; unpacked alpaca recipes, padding not
# stated): the configs of that commit give the rest.
TT_0217 = dict(micro_batch=4, seq_len=2048)
# torchtune README @30b8519 table note: 'batch size 2 (without gradient accumulation), a dataset packed to sequence
# length 2048, and torch compile enabled'; the llama3_1 configs of that commit give the rest.
TT_30B8 = dict(micro_batch=2, seq_len=2048, grad_accum=1, grad_ckpt=True)
# torchtune README @1814feb 'Optimization flags': full_finetune_single_device, Llama 3.2 3B, batch 2 x 4096, bf16,
# A100, grad accum 1; each row adds its technique to the previous one (LoRA/QLoRA without the optimizer ones).
TT_1814 = dict(micro_batch=2, seq_len=4096, grad_accum=1)
# peft method_comparison/MetaMathQA default_training_params.json (results @5d602fdb and @bda9665b): LoRA dropout
# 0, use_amp false (no autocast: the fp32 adapters' matmuls run in fp32), torch.optim.AdamW without `fused`
PM = dict(
    quant="none",
    micro_batch=4,
    seq_len=210,
    grad_accum=1,
    grad_ckpt=False,
    attn="sdpa",
    lora_targets="qv",
    lora_dropout=0.0,
    autocast=False,
    fused_optimizer=False,
)
# philschmid fine-tune-llms-in-2025 recipe llama-3-1-8b-qlora.yaml @391f19b (per-row batch, accumulation, kernels)
PS = dict(method="qlora", seq_len=1024, grad_ckpt=True, attn="flash", lora_r=16, lora_targets="all", stack="trl")
# its 2025 recipe (llama-3-1-8b-qlora.yaml) also trains the embeddings and the LM head: lora_modules_to_save
PS_EMB = dict(PS, train_embeddings=True)
# TRL's SFTTrainer of these runs (0.8-0.12) ran peft's prepare_model_for_kbit_training on a 4-bit model that is not
# sharded (`is_qlora and not is_sharded_qlora`; one GPU), and peft_module_casting_to_bf16 left the norms in fp32,
# so the residual stream is fp32 (the kbit_prep facet; bench/calibration_rows.py's TRL_KBIT for the same FMS rows):
# FMS-06/07 and the philschmid one-GPU rows. Under FSDP / ZeRO-3 (TP-FA-04/05, TP-PS-05/06) it is skipped, and
# fms-acceleration's accelerated-peft-bnb plugin (FMS-10) prepares without dtype casts.
TRL_KBIT = dict(kbit_prep=True)
# fms-acceleration l40_40gb.csv @8af8fa7d: the A100 file's scenario (FMS above) with torch_dtype float16
FL = dict(FMS, precision="fp16")
# its standard-peft scenario sets torch_dtype float16 without the fp16 flag: the Trainer runs no autocast, and the
# peft of that date (the commit pins transformers < 4.40, peft unpinned: 0.10, 2024-03) made new adapters in the
# base weight's dtype (fp16); peft casts them to fp32 only from 0.12 (autocast_adapter_dtype, huggingface/peft#1706)
FL_LORA = dict(FL, method="lora", quant="none", autocast=False, fp32_adapters=False)
# AnswerDotAI/fsdp_qlora benchmarks_03_2024.md: train.py's template command and defaults (2024-03): dummy rows filled
# to the context length, reentrant checkpointing, grad accum 1, pure bf16, AdamW, LoRA r64 on q,k,v,gate,up,down
# (lorafit's 'all' adds o), sdpa, 2 GPUs with FSDP FULL_SHARD ('ddp' rows: replicated, shard none; 'CPU offload'
# rows: FSDP parameter offload, offload params). Its own loop: no lorafit stack. Pure bf16 (train.py's precision
# "bf16"): no autocast (nullcontext), and the adapters in bf16 - peft casts new adapters to the base weight's
# dtype (Linear4bit's quant_storage is bf16) and FSDP without a mixed-precision policy flattens every parameter of
# a wrapped block into one bf16 FlatParameter.
AQ = dict(
    seq_len=2048,
    grad_ckpt=True,
    attn="sdpa",
    lora_r=64,
    lora_targets="all",
    grad_accum=1,
    n_gpus=2,
    shard="fsdp",
    autocast=False,
    fp32_adapters=False,
)
# pytorch/torchtitan docs/performance.md @157a12c5 (64 A100 80GB): train_configs and train.py of that commit: FSDP2
# fully_shard over 8 nodes of 8, no TP/PP, grad accum 1, AdamW(foreach=True), F.scaled_dot_product_attention, compile
# off, the full-vocabulary cross-entropy; every row seq_len tokens (C4 streamed into contiguous windows)
TI = dict(
    method="full",
    quant="none",
    precision="bf16",
    grad_accum=1,
    attn="sdpa",
    fused_optimizer=False,
    n_gpus=8,
    nodes=8,
    shard="fsdp",
)
ROWS: dict[str, tuple[str, str, dict]] = {
    "FMS-01": ("mistral-7b-v0.1", "A100 80GB", dict(FMS_PURE, method="full", quant="none", micro_batch=4)),
    "FMS-03": ("mistral-7b-v0.1", "A100 80GB", dict(FMS_PURE, method="lora", quant="none", micro_batch=4)),
    "FMS-04": ("mistral-7b-v0.1", "A100 80GB", dict(FMS_PURE, method="lora", quant="none", micro_batch=8)),
    "FMS-06": ("mistral-7b-v0.1", "A100 80GB", dict(FMS, **TRL_KBIT, method="qlora", micro_batch=4)),
    "FMS-07": ("mistral-7b-v0.1", "A100 80GB", dict(FMS, **TRL_KBIT, method="qlora", micro_batch=8)),
    "FMS-10": ("llama-2-70b", "A100 80GB", dict(FMS, method="qlora", micro_batch=4)),
    "TT-12": (
        "llama-3.1-8b",
        "RTX 4090",
        dict(method="qlora", micro_batch=2, seq_len=2048, grad_ckpt=False, lora_r=8),
    ),
    "TT-10": (
        "llama-3.1-8b",
        "RTX 4090",
        dict(method="lora", quant="none", micro_batch=2, seq_len=2048, grad_ckpt=False, lora_r=8),
    ),
    "TT-11": (
        "llama-3.1-8b",
        "RTX A6000",
        dict(method="lora", quant="none", micro_batch=2, seq_len=2048, grad_ckpt=False, lora_r=8),
    ),
    "TT-01": (
        "llama-2-7b",
        "RTX 4090",
        dict(method="qlora", micro_batch=4, seq_len=2048, grad_ckpt=False, lora_r=8),
    ),
    # @0217d44: 1 x 4090, 7B_lora_single_device (r8 q,v, activation checkpointing on, grad accum 64), eager
    "TT-02": (
        "llama-2-7b",
        "RTX 4090",
        dict(TT_0217, method="lora", quant="none", grad_ckpt=True, lora_r=8, lora_targets="qv", grad_accum=64),
    ),
    # @0217d44: 1 x 4090, 7B_full_low_memory (bnb PagedAdamW fused into backward, checkpointing, grad accum 1),
    # eager; its 27 GB of paged states do not fit the 24 GB card, so they page to host memory
    "TT-04": (
        "llama-2-7b",
        "RTX 4090",
        dict(TT_0217, method="full", quant="none", grad_ckpt=True, optimizer="paged_adamw_32bit", grad_accum=1),
    ),
    # @0217d44: 8 x A100, 70B_lora (FSDP, r16 q,k,v - lorafit's nearest targets add o -, checkpointing, grad accum
    # 1), batch 4 x 4096, eager
    "TT-06": (
        "llama-2-70b",
        "A100 80GB",
        dict(
            method="lora",
            quant="none",
            micro_batch=4,
            seq_len=4096,
            grad_ckpt=True,
            lora_r=16,
            lora_targets="attn",
            grad_accum=1,
            n_gpus=8,
            shard="fsdp",
        ),
    ),
    # @30b8519: 8 x A100, 70B_full (FSDP with fsdp_cpu_offload: parameters, gradients and the fused AdamW step on
    # the CPU; chunked CE; checkpointing), compiled
    "TT-13": (
        "llama-3.1-70b",
        "A100 80GB",
        dict(TT_30B8, method="full", quant="none", loss="chunked", n_gpus=8, shard="fsdp", offload="params"),
    ),
    # @30b8519: 8 x A100, 70B_lora (FSDP, r16 q,k,v - lorafit's nearest targets add o -, chunked CE,
    # checkpointing), compiled
    "TT-14": (
        "llama-3.1-70b",
        "A100 80GB",
        dict(
            TT_30B8,
            method="lora",
            quant="none",
            lora_r=16,
            lora_targets="attn",
            loss="chunked",
            n_gpus=8,
            shard="fsdp",
        ),
    ),
    # @30b8519: 8 x A100, 405B_qlora (FSDP, torchao NF4, r16 q,k,v,o + MLP, nn.CrossEntropyLoss, checkpointing;
    # the table's batch 2 without accumulation over the config's 1 x 16), compiled
    "TT-15": (
        "llama-3.1-405b",
        "A100 80GB",
        dict(TT_30B8, method="qlora", lora_r=16, lora_targets="all", n_gpus=8, shard="fsdp"),
    ),
    # @1814feb: + packed dataset (no compile, nn.CrossEntropyLoss, no checkpointing)
    "TT-17": ("llama-3.2-3b", "A100 80GB", dict(TT_1814, method="full", quant="none", grad_ckpt=False)),
    # @1814feb: + torch.compile
    "TT-18": ("llama-3.2-3b", "A100 80GB", dict(TT_1814, method="full", quant="none", grad_ckpt=False)),
    # @1814feb: + chunked cross-entropy (CEWithChunkedOutputLoss), compiled
    "TT-19": (
        "llama-3.2-3b",
        "A100 80GB",
        dict(TT_1814, method="full", quant="none", grad_ckpt=False, loss="chunked"),
    ),
    # @1814feb: + activation checkpointing, compiled
    "TT-20": (
        "llama-3.2-3b",
        "A100 80GB",
        dict(TT_1814, method="full", quant="none", grad_ckpt=True, loss="chunked"),
    ),
    # @1814feb: + AdamW step fused into backward (optimizer_in_bwd; lorafit times the same step), compiled
    "TT-21": (
        "llama-3.2-3b",
        "A100 80GB",
        dict(TT_1814, method="full", quant="none", grad_ckpt=True, loss="chunked"),
    ),
    # @1814feb: + activation offloading to the CPU, compiled
    "TT-22": (
        "llama-3.2-3b",
        "A100 80GB",
        dict(TT_1814, method="full", quant="none", grad_ckpt=True, loss="chunked", offload_activations=True),
    ),
    # @1814feb: + bnb 8-bit AdamW (still in backward), compiled
    "TT-23": (
        "llama-3.2-3b",
        "A100 80GB",
        dict(
            TT_1814,
            method="full",
            quant="none",
            grad_ckpt=True,
            loss="chunked",
            offload_activations=True,
            optimizer="adamw_8bit",
        ),
    ),
    # @1814feb: LoRA r64 q,v,o + MLP (3B config; lorafit's 'all' adds k), packed, chunked CE, checkpointing,
    # activation offloading, AdamW, compiled
    "TT-24": (
        "llama-3.2-3b",
        "A100 80GB",
        dict(
            TT_1814,
            method="lora",
            quant="none",
            lora_r=64,
            lora_targets="all",
            grad_ckpt=True,
            loss="chunked",
            offload_activations=True,
        ),
    ),
    # @1814feb: QLoRA (the README's command line: torchao NF4, r64, packed, compile, chunked CE, checkpointing,
    # activation offloading, AdamW)
    "TT-25": (
        "llama-3.2-3b",
        "A100 80GB",
        dict(
            TT_1814,
            method="qlora",
            lora_r=64,
            lora_targets="all",
            grad_ckpt=True,
            loss="chunked",
            offload_activations=True,
        ),
    ),
    # peft method_comparison/MetaMathQA on one L40S: a plain PyTorch loop, Llama-3.2-3B in bf16, batch 4 of
    # MetaMathQA bucketed by length (no packing; mean 209.9 tokens a sample, so 210 here), no checkpointing, sdpa,
    # torch AdamW (torch.optim.AdamW without `fused`: the multi-tensor foreach step); the published rate counts
    # unpadded tokens only
    "TP-PM-01": ("llama-3.2-3b", "L40S", dict(PM, method="lora", lora_r=32)),
    "TP-PM-02": ("llama-3.2-3b", "L40S", dict(PM, method="lora", lora_r=64)),
    "TP-PM-04": ("llama-3.2-3b", "L40S", dict(PM, method="full")),
    "TP-PM-05": ("llama-3.2-3b", "L40S", dict(PM, method="lora", lora_r=32)),
    # fine-tune-llms-in-2025 on L4s: TRL QLoRA r16 all-linear, 1024-token packed rows, checkpointing; the runs also
    # train the embeddings and LM head in full (modules_to_save: lm_head, embed_tokens, the rows' notes and the
    # recipe): the train_embeddings facet. "Flash Attention ❌"
    # rows: the kernel is not stated, transformers 4.46's default (sdpa) is assumed; the Liger rows (04-06) are
    # timed with the liger facet: its RMSNorm, SwiGLU and rotary kernels (TRL 0.12.1 also let Liger's fused linear
    # cross-entropy run, which TRL 1.16, the pinned stack, turns off for its own fused head: the loss is a few
    # tenths of a percent of the step either way); 4 and 8 GPUs ran DeepSpeed ZeRO-3
    # the table says only "not flash-attention 2": transformers 4.46.3's default, sdpa (as the issue that quotes it)
    "TP-PS-02": ("llama-3.1-8b", "L4", dict(PS_EMB, **TRL_KBIT, micro_batch=2, grad_accum=2, attn="sdpa")),
    "TP-PS-03": ("llama-3.1-8b", "L4", dict(PS_EMB, **TRL_KBIT, micro_batch=2, grad_accum=4)),
    "TP-PS-04": ("llama-3.1-8b", "L4", dict(PS_EMB, **TRL_KBIT, micro_batch=4, grad_accum=4, liger=True)),
    "TP-PS-05": ("llama-3.1-8b", "L4", dict(PS_EMB, micro_batch=8, grad_accum=2, liger=True, n_gpus=4, shard="zero3")),
    "TP-PS-06": ("llama-3.1-8b", "L4", dict(PS_EMB, micro_batch=8, grad_accum=2, liger=True, n_gpus=8, shard="zero3")),
    # fine-tune-llms-in-2024-with-trl @10ad907 on one L4: TRL QLoRA r256 all-linear, packed 2048, batch 1 x accum 8,
    # checkpointing, flash-attention 2, adamw_torch_fused
    "TP-PS-07": (
        "llama-3.1-8b",
        "L4",
        dict(
            method="qlora",
            micro_batch=1,
            grad_accum=8,
            seq_len=2048,
            grad_ckpt=True,
            attn="flash",
            lora_r=256,
            lora_targets="all",
            fused_optimizer=True,
            stack="trl",
            **TRL_KBIT,
        ),
    ),
    # peft method_comparison on one L40S: rsLoRA r64 on q,v (the same matmuls as LoRA r64), the PM loop and data
    "TP-PM-06": ("llama-3.2-3b", "L40S", dict(PM, method="lora", lora_r=64)),
    # fms-acceleration a100_80gb.csv @24bdadb lines the FMS rows do not use: the same scenario (FMS), bf16; 2 GPUs
    # under accelerate's FSDP FULL_SHARD; baseline-peft-bnb is HF's bitsandbytes nf4
    "TP-FA-01": ("mistral-7b-v0.1", "A100 80GB", dict(FMS_PURE, method="full", quant="none", micro_batch=8)),
    "TP-FA-02": (
        "mistral-7b-v0.1",
        "A100 80GB",
        dict(FMS_PURE, method="full", quant="none", micro_batch=4, n_gpus=2, shard="fsdp"),
    ),
    "TP-FA-03": (
        "mistral-7b-v0.1",
        "A100 80GB",
        dict(FMS_PURE, method="lora", quant="none", micro_batch=4, n_gpus=2, shard="fsdp"),
    ),
    "TP-FA-04": ("mistral-7b-v0.1", "A100 80GB", dict(FMS, method="qlora", micro_batch=2, n_gpus=2, shard="fsdp")),
    "TP-FA-05": ("mistral-7b-v0.1", "A100 80GB", dict(FMS, method="qlora", micro_batch=4, n_gpus=2, shard="fsdp")),
    "TP-FA-06": (
        "mixtral-8x7b",
        "A100 80GB",
        dict(FMS_PURE, method="lora", quant="none", micro_batch=2, n_gpus=2, shard="fsdp"),
    ),
    "TP-FA-07": (
        "mixtral-8x7b",
        "A100 80GB",
        dict(FMS_PURE, method="lora", quant="none", micro_batch=4, n_gpus=2, shard="fsdp"),
    ),
    # fsdp_qlora on two RTX 3090s (power limited to 280 W, the catalog's 3090 is the 350 W card), replicated ('ddp')
    "TP-AQ-09": ("llama-2-7b", "RTX 3090", dict(AQ, method="qlora", micro_batch=8, shard="none")),
    "TP-AQ-10": ("llama-2-7b", "RTX 3090", dict(AQ, method="lora", quant="none", micro_batch=4, shard="none")),
    # fsdp_qlora on two RTX 4090s, each on PCIe 4.0 x16
    "TP-AQ-14": ("llama-2-7b", "RTX 4090", dict(AQ, method="lora", quant="none", micro_batch=4, shard="none")),
    "TP-AQ-15": ("llama-2-7b", "RTX 4090", dict(AQ, method="lora", quant="none", micro_batch=6)),
    "TP-AQ-16": ("llama-2-7b", "RTX 4090", dict(AQ, method="lora", quant="none", micro_batch=10, offload="params")),
    "TP-AQ-17": ("llama-2-7b", "RTX 4090", dict(AQ, method="qlora", micro_batch=8, shard="none")),
    "TP-AQ-18": ("llama-2-7b", "RTX 4090", dict(AQ, method="qlora", micro_batch=10)),
    "TP-AQ-19": ("llama-2-7b", "RTX 4090", dict(AQ, method="qlora", micro_batch=12, offload="params")),
    "TP-AQ-20": ("yi-34b", "RTX 4090", dict(AQ, method="qlora", micro_batch=2)),
    "TP-AQ-21": ("yi-34b", "RTX 4090", dict(AQ, method="qlora", micro_batch=4, offload="params")),
    "TP-AQ-22": ("llama-2-70b", "RTX 4090", dict(AQ, method="qlora", micro_batch=2, offload="params")),
    # Mistral-7B-v0.2 base: v0.1's shapes (no sliding window; irrelevant at 2048)
    "TP-AQ-23": ("mistral-7b-v0.1", "RTX 4090", dict(AQ, method="qlora", micro_batch=12, offload="params")),
    # torchtitan @157a12c5 on 64 A100s (8 nodes of 8): pre-training, every weight trained (lorafit's full step), FSDP2
    # with bf16 compute over fp32 master weights, foreach AdamW, sdpa, no compile, contiguous C4 windows; the
    # table's local batch; its own loop (no lorafit stack)
    "TP-TI-03": ("llama-3-70b", "A100 80GB", dict(TI, micro_batch=1, seq_len=8192, grad_ckpt=True)),
    "TP-TI-04": ("llama-2-13b", "A100 80GB", dict(TI, micro_batch=2, seq_len=4096, grad_ckpt=False)),
    "TP-TI-08": ("llama-2-70b", "A100 80GB", dict(TI, micro_batch=2, seq_len=4096, grad_ckpt=True)),
    # Unsloth 2024.1 on a Colab T4: TinyLlama QLoRA r32 on all seven projections, packed 4096-token rows (RoPE scaled
    # 2x past its 2048), batch 2 x accum 4, no checkpointing, adamw_8bit, fp16, xformers attention (timed as sdpa)
    "TP-UT-01": (
        "tinyllama-1.1b",
        "T4",
        dict(
            method="qlora",
            stack="unsloth",
            precision="fp16",
            micro_batch=2,
            grad_accum=4,
            seq_len=4096,
            grad_ckpt=False,
            lora_r=32,
            lora_targets="all",
            lora_dropout=0.0,
            optimizer="adamw_8bit",
            attn="sdpa",
        ),
    ),
}

# Rows run under torch.compile (their notes say so): timed with the torch_compile facet, and summarised apart.
COMPILED = frozenset({"TT-01", *(f"TT-{n}" for n in (*range(10, 16), *range(18, 26)))})

# Sources whose tokens/s is the whole job's, by row-id prefix. torchtune's README tables head the memory column
# "Peak Memory per GPU" and the speed column "Tokens/sec" (no "per GPU"), and read per GPU the 8 x A100 rows
# would exceed an A100's bf16 peak (TT-06: 70B LoRA at 3384 tokens/s is ~1.7 PFLOP/s). The HF Trainer's
# train_tokens_per_second (FMS) is per device: FMS-05's 2 x 4096 tokens / 2.78 s step = its 2946.
PER_JOB = ("TT-",)

# Check rows with a speed that are not compared, and why (read from each row's evidence and notes).
# The rows SKIPPED for a card or link their source does not identify, mapped as if it were the catalog's (the L40,
# the 3090's PCIe 4.0 x16): scored apart, never in the headline, so that what the skip leaves out stays in view.
UNIDENTIFIED: dict[str, tuple[str, str, dict]] = {
    # fms-acceleration on L40s (@8af8fa7d): LoRA r16 q,k,v,o in fp16 weights, packed 4096, checkpointing, flash
    # attention; 2 GPUs under accelerate's FSDP FULL_SHARD
    "TP-FL-01": ("mistral-7b-v0.1", "L40", dict(FL_LORA, micro_batch=4)),
    "TP-FL-02": ("mistral-7b-v0.1", "L40", dict(FL_LORA, micro_batch=8)),
    "TP-FL-03": (
        "mistral-7b-v0.1",
        "L40",
        dict(FL_LORA, micro_batch=2, n_gpus=2, shard="fsdp"),
    ),
    "TP-FL-04": (
        "mistral-7b-v0.1",
        "L40",
        dict(FL_LORA, micro_batch=4, n_gpus=2, shard="fsdp"),
    ),
    # accelerated-peft-bnb: bitsandbytes nf4 through the fms plugin, fp16=True
    "TP-FL-05": ("mistral-7b-v0.1", "L40", dict(FL, method="qlora", micro_batch=4)),
    "TP-FL-06": ("mistral-7b-v0.1", "L40", dict(FL, method="qlora", micro_batch=8)),
    # full fine-tuning (pure fp16 weights and AdamW states) on 2 GPUs, FSDP FULL_SHARD
    "TP-FL-09": (
        "mistral-7b-v0.1",
        "L40",
        dict(FL, method="full", quant="none", micro_batch=2, n_gpus=2, shard="fsdp"),
    ),
    "TP-FL-10": (
        "mistral-7b-v0.1",
        "L40",
        dict(FL, method="full", quant="none", micro_batch=4, n_gpus=2, shard="fsdp"),
    ),
    # fsdp_qlora on the two RTX 3090s whose link is not stated, rows that move weights over it every micro-batch
    "TP-AQ-01": ("llama-2-7b", "RTX 3090", dict(AQ, method="qlora", micro_batch=1, seq_len=512)),
    "TP-AQ-02": ("llama-2-7b", "RTX 3090", dict(AQ, method="qlora", micro_batch=1)),
    "TP-AQ-03": ("llama-2-7b", "RTX 3090", dict(AQ, method="lora", quant="none", micro_batch=1, seq_len=512)),
    "TP-AQ-04": ("llama-2-7b", "RTX 3090", dict(AQ, method="lora", quant="none", micro_batch=1)),
    "TP-AQ-05": ("llama-2-7b", "RTX 3090", dict(AQ, method="qlora", micro_batch=4)),
    "TP-AQ-06": ("llama-2-7b", "RTX 3090", dict(AQ, method="qlora", micro_batch=10)),
    "TP-AQ-07": ("llama-2-7b", "RTX 3090", dict(AQ, method="lora", quant="none", micro_batch=4)),
    "TP-AQ-08": ("llama-2-7b", "RTX 3090", dict(AQ, method="lora", quant="none", micro_batch=6)),
    "TP-AQ-13": ("llama-2-70b", "RTX 3090", dict(AQ, method="qlora", micro_batch=2, offload="params")),
    "TP-AQ-11": ("yi-34b", "RTX 3090", dict(AQ, method="qlora", micro_batch=2)),
    "TP-AQ-12": ("yi-34b", "RTX 3090", dict(AQ, method="qlora", micro_batch=4, offload="params")),
}


SKIPPED = {
    "TT-03": "tokens/s per GPU or per job is ambiguous here: the column is the job's for the 8 x A100 rows (per GPU "
    "they pass the A100's peak), but the recipe logs rank 0's tokens (per GPU), and on 2 x 4090 (FSDP through host "
    "memory) both readings are possible",
    "TT-05": "tokens/s per GPU or per job is ambiguous (as TT-03; 4 x 4090, FSDP full fine-tune)",
    "TT-07": "70B full fine-tune on 8 x A100: the commit has no 70B full config and the row states no "
    "checkpointing, so the step cannot be set",
    "TT-08": "per-row overrides not stated; the 1x 4090 and 1x A6000 rows of one method differ ~2x in memory "
    "(notes), so checkpointing and optimizer settings cannot be determined",
    "TT-09": "per-row overrides not stated (as TT-08)",
    "TT-16": "dynamic padding of alpaca to <= 4096: the tokens per micro-batch are not stated",
    "TTD-05": "GPU not stated; alpaca with dynamic padding to <= 512",
    **{
        f"TAO-{n:02d}": "batch size, sequence length (alpaca, dynamic, max not stated) and checkpointing not stated"
        for n in range(1, 5)
    },
    **{
        f"QW-{n:02d}": "Qwen v1 (QWenLMHeadModel) is not in lorafit's catalog (`lorafit models`), as in "
        "bench/calibration_models.toml"
        for n in (*range(1, 9), *range(16, 27))
    },
    "QW-14": "LoRA (emb) also trains the embeddings and LM head (modules_to_save), which lorafit's LoRA does not "
    "time; and Qwen v1 is not in the catalog",
    "QW-15": "LoRA (emb), as QW-14",
    "TP-PM-03": "LoRA on the MLP projections only (up, gate, down): lorafit's targets are all, attn or qv",
    "TP-AQ-24": "24,576-token context: a dummy row (alpaca prompt + 'output' x 10000) may be shorter than that, so "
    "the tokens of a step are not known",
    **{
        f"TP-AQ-{n}": "the fastest settings found per accelerator: the row's sharding strategy, checkpointing and "
        "gradient accumulation are not stated"
        for n in range(25, 34)
    },
    "TP-PS-01": "not packed: the tokens of a step are not stated (the row has a step time only)",
    # the 2 x RTX 3090 rig's host link is not stated: 'an older motherboard and slow PCI lanes', and the source's
    # conclusion that such a rig, unlike the 4090s' 'full PCIe v4 x16 lanes', lacks x16 to both cards; the rows that
    # move weights over it every micro-batch (FSDP FULL_SHARD gathers through host memory, CPU parameter offload)
    # cannot be timed. Its DDP rows (AQ-09/10) send only the adapters' gradients once a step (about 0.3 GB, a few
    # percent of the step on any PCIe 3.0 x4 or wider link) and stay.
    **{
        row_id: "2 x RTX 3090 on 'an older motherboard and slow PCI lanes': the host link generation and "
        "width are not stated, and this row moves weights over it every micro-batch (FSDP FULL_SHARD gathers "
        "through host memory or CPU parameter offload)"
        for row_id in UNIDENTIFIED
        if row_id.startswith("TP-AQ-")
    },
    # fms-acceleration's l40_40gb.csv: not the committed scenario, and an unnamed card
    **{
        row_id: "fms-acceleration's 'L40-40GB' file (@8af8fa7d, withdrawn 2024-06-01 'remove l40'): no "
        "L40 has 40 GB, so the card is not identified, and the runs took 20 steps where the commit's "
        "defaults.yaml says 100, so their settings are not the committed scenario's"
        for row_id in UNIDENTIFIED
        if row_id.startswith("TP-FL-")
    },
    # the rows bench/memory_accuracy.py excludes for the same reason: a step lorafit does not model
    **{
        row_id: "QLoRA of Mixtral under transformers 4.48 (the row's stack), which holds the experts as nn.Linear "
        "modules that bitsandbytes quantises and runs them one expert at a time; lorafit models transformers 5, "
        "whose fused 3-D expert parameters stay 16-bit and run grouped (as bench/memory_accuracy.py excludes FMS-11)"
        for row_id in ("FMS-11", "TP-FA-08", "TP-FA-09", "TP-FA-10", "TP-FL-08")
    },
    **{
        row_id: "GPTQ 4-bit weights (auto-gptq's kernels): lorafit models bitsandbytes nf4/int8 (as "
        "bench/memory_accuracy.py excludes FMS-08)"
        for row_id in ("FMS-08", "TP-FL-07")
    },
    **{
        f"TP-TI-{n:02d}": "selective activation checkpointing (every N-th layer, N not stated, or torchtitan's "
        "per-op policy): lorafit's checkpointing is all layers or none"
        for n in (1, 2, 5, 6, 7)
    },
}


def published() -> dict[str, dict[str, str]]:
    """The CSV's rows that report a speed (tokens/s or a step time), by id."""
    if not CALIBRATION.is_file():
        sys.exit(f"calibration file not found: {CALIBRATION}")
    with CALIBRATION.open(newline="") as handle:
        return {row["id"]: row for row in csv.DictReader(handle) if row["tokens_per_s"] or row["step_time_s"]}


def published_tokens_per_gpu(row: dict[str, str], settings: Settings) -> float:
    """The row's tokens/s on one GPU, as its source defines the figure (see PER_JOB)."""
    gpus = memory.world_size(settings)
    if row["tokens_per_s"]:
        rate = float(row["tokens_per_s"])
        return rate / gpus if row["id"].startswith(PER_JOB) else rate
    step_tokens = settings.micro_batch * settings.seq_len * settings.grad_accum
    return step_tokens / float(row["step_time_s"])


# The fitted constants of lorafit/timing.py and the fit rows each is solved on (the 16-bit rows first, then the
# 4-bit ones with the share in place).
FITTED = {"MATMUL_SHAPE_SHARE": ("FMS-01", "FMS-03", "FMS-04"), "QUANT_MATMUL_SLOWDOWN": ("FMS-06", "FMS-07")}


def asked_for(name: str, row_id: str, low: float = 0.2, high: float = 3.0) -> float:
    """The value of timing's constant `name` at which the row's prediction equals its published speed."""
    preset, gpu_name, fields = ROWS[row_id]
    spec, gpu, settings = models.resolve(preset), hardware.resolve(gpu_name), Settings(**fields)
    truth = published_tokens_per_gpu(published()[row_id], settings)
    kept = getattr(timing, name)
    try:
        for _ in range(60):  # bisection: speed falls as the slowdown rises and rises with the share
            middle = (low + high) / 2
            setattr(timing, name, middle)
            faster = timing.tokens_per_second(spec, settings, gpu) / memory.world_size(settings) > truth
            low, high = (low, middle) if faster == (name == "MATMUL_SHAPE_SHARE") else (middle, high)
    finally:
        setattr(timing, name, kept)
    return round((low + high) / 2, 3)


def fit_report() -> dict[str, dict[str, float]]:
    """What each fit row asks of each fitted constant, beside the value timing.py uses (their median)."""
    report = {}
    for name, row_ids in FITTED.items():
        asks = {row_id: asked_for(name, row_id) for row_id in row_ids if row_id in ROWS}
        report[name] = asks
        print(f"  {name} = {getattr(timing, name)}; fit rows ask " + ", ".join(f"{r} {v}" for r, v in asks.items()))
    return report


def summary(errors: list[tuple[dict[str, str], float]]) -> dict:
    """n, median and worst |error| (percent) of (row facts, error) pairs."""
    values = [abs(error) for _, error in errors]
    return {
        "n": len(values),
        "median_abs_pct": round(100 * statistics.median(values), 1),
        "worst_abs_pct": round(100 * max(values), 1),
    }


def grouped(errors: list[tuple[dict[str, str], float]], key: str) -> dict[str, dict]:
    groups: dict[str, list[tuple[dict[str, str], float]]] = {}
    for facts, error in errors:
        groups.setdefault(facts[key], []).append((facts, error))
    return {name: summary(members) for name, members in sorted(groups.items())}


ACCURACY = Path(__file__).resolve().parents[1] / "src" / "lorafit" / "catalog" / "time_accuracy.toml"


def accuracy_table(check: list[tuple[dict[str, str], float]]) -> dict[str, dict[str, float]]:
    """Per class of run (costs.run_classes: GPU kind and count, count, all): how many check rows, and the 10th
    and 90th percentiles of the signed error
    (predicted - published) / published, which lorafit's plan turns into its hours range (timing.hours_range)."""
    kinds: dict[str, list[float]] = {"all": [error for _, error in check]}
    for facts, error in check:
        for name in costs.run_classes(facts["kind"], 1 if facts["gpus"] == "one GPU" else 2)[:2]:
            kinds.setdefault(name, []).append(error)
    table = {}
    for kind, errors in kinds.items():
        cuts = statistics.quantiles(errors, n=10, method="inclusive") if len(errors) > 1 else errors * 9
        table[kind] = {"rows": len(errors), "low": round(min(cuts[0], 0.0), 3), "high": round(max(cuts[-1], 0.0), 3)}
    return table


def write_accuracy(table: dict[str, dict[str, float]]) -> None:
    """catalog/time_accuracy.toml, the file lorafit reads its hours range from."""
    lines = [
        "# The time model's signed error, (predicted - published) / published tokens/s, on the check rows of",
        "# `make bench-throughput` (bench/throughput_accuracy.py, rows of bench/calibration/measured_memory.csv),",
        "# by class of run (GPU kind of catalog/gpus.toml and GPU count, GPU count, all): rows, and the 10th (low)",
        "# and 90th (high) percentiles, each bounded by 0. lorafit's plan shows hours x (1 + low) to hours x",
        "# (1 + high) for the narrowest class with 5 rows. Written by that command; a test fails when it is stale.",
    ]
    for kind, entry in table.items():
        lines += ["", f'[kind."{kind}"]', *(f"{key} = {value}" for key, value in entry.items())]
    ACCURACY.write_text("\n".join(lines) + "\n")


def scored(rows: dict[str, tuple[str, str, dict]], measured: dict[str, dict]) -> dict[str, list]:
    """Each row's estimate against its published tokens/s, printed a line each; the errors by split."""
    errors: dict[str, list[tuple[dict[str, str], float]]] = {"fit": [], "check": []}
    for row_id, (preset, gpu_name, fields) in rows.items():
        row = measured[row_id]
        spec, gpu = models.resolve(preset), hardware.resolve(gpu_name)
        settings = Settings(**fields, **({"torch_compile": True} if row_id in COMPILED else {}))
        gpus = memory.world_size(settings)
        predicted = tokens_per_second(spec, settings, gpu) / gpus
        truth = published_tokens_per_gpu(row, settings)
        error = (predicted - truth) / truth
        facts = {
            "gpu": gpu.name,
            "kind": gpu.kind,
            "stack": row["stack"],
            "gpus": "one GPU" if gpus == 1 else "several GPUs",
            "kernels": "compile" if row_id in COMPILED else "liger" if settings.liger else "eager",
        }
        errors[row["split"]].append((facts, error))
        print(
            f"{row_id:7} {preset:15.15} {gpu_name:9.9} {gpus:4} {fields['method']:6} {truth:9.0f} {predicted:8.0f} "
            f"{error:+7.1%}  {row['split']:<5}  {row['stack']:<9}  {facts['kernels']}"
        )
    return errors


def main(write: bool = False) -> dict[str, dict]:
    measured = published()
    print(
        f"{'row':7} {'model':15} {'gpu':9} {'gpus':>4} {'method':6} {'published':>9} {'lorafit':>8} {'error':>7}  "
        "split  stack      kernels"
    )
    errors = scored(ROWS, measured)
    result: dict[str, dict] = {}
    for split in ("check", "fit"):
        if not errors[split]:
            print(f"{split} rows: none")
            continue
        overall = summary(errors[split])
        keys = ("gpu", "kind", "stack", "gpus", "kernels")
        result[split] = overall | {key: grouped(errors[split], key) for key in keys}
        print(
            f"\n{split} rows: {overall['n']}, median |error| {overall['median_abs_pct']}%, "
            f"worst {overall['worst_abs_pct']}%"
        )
        for key in keys:
            for name, figures in result[split][key].items():
                print(
                    f"  {key:8} {name:13} n={figures['n']:<3} median {figures['median_abs_pct']:5.1f}%  "
                    f"worst {figures['worst_abs_pct']:5.1f}%"
                )
    print("\nfitted constants (lorafit/timing.py):")
    result["fitted"] = fit_report()
    result["accuracy"] = accuracy_table(errors["check"])
    if write:
        write_accuracy(result["accuracy"])
        print(f"\nwrote {ACCURACY.relative_to(ACCURACY.parents[3])}: the plan's hours range by class of run")
    print("\nrows skipped for a card or link their source does not identify, as if it were the catalog's:")
    unidentified = scored(UNIDENTIFIED, measured)["check"]
    overall, everything = summary(unidentified), summary(errors["check"] + unidentified)
    result["unidentified"] = overall | {"with_check_rows": everything}
    print(
        f"unidentified rows: {overall['n']}, median |error| {overall['median_abs_pct']}%, worst "
        f"{overall['worst_abs_pct']}%; with the check rows: {everything['n']}, median "
        f"{everything['median_abs_pct']}%, worst {everything['worst_abs_pct']}% (not the headline)"
    )
    result["skipped"] = dict(SKIPPED)
    print(f"\nskipped check rows ({len(SKIPPED)}):")
    for row_id, reason in SKIPPED.items():
        print(f"  {row_id:7} {reason}")
    return result


if __name__ == "__main__":
    main(write=True)
