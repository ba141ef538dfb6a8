"""The sentences lorafit says to a user, declared once by key: the CLI prints them in English (`say`), the web page
renders the same sentence in its language from a translated catalog keyed the same way (`render`).

An English sentence is parsed back into its key and parameters (`parse`), so that a reason, a suggestion or an
error can travel as the plain text the CLI prints (in a Plan, in an exception) and still be translated where it is
shown. A parameter named `setting...` is a setting as the CLI spells it (--seq-len, seq_len): a page shows its
label instead. A parameter that is itself a sentence of the catalog is translated too.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Mapping
from functools import cache

EN: dict[str, str] = {
    # --- plan: why these settings (plan.explain, explain_savers, explain_gpus) ---
    "plan.peak": "peak {peak:.2f} GiB on the device (nvidia-smi) of {memory:.1f} GiB; {headroom:.0%} kept free "
    "leaves {usable:.2f} GiB",
    "plan.ckpt_on": "gradient checkpointing on: without it even micro-batch {micro_batch:d} needs {peak:.1f} GiB and "
    "the card has {usable:.1f}; it recomputes the forward pass in backward (about a third more compute)",
    "plan.ckpt_off": "gradient checkpointing off: activations fit, so no forward pass is recomputed",
    "plan.accum": "micro-batch {micro_batch:d} x gradient accumulation {grad_accum:d}",
    "plan.accum_gpus": "micro-batch {micro_batch:d} x gradient accumulation {grad_accum:d} x {n_gpus:d} GPUs",
    "plan.batch": "{accum} = effective batch {batch:d}",
    "plan.batch_larger": "{accum} = effective batch {batch:d}: {larger}",
    "plan.larger_fits": "micro-batch {micro_batch:d} fits too ({peak:.1f} GiB) but runs no faster",
    "plan.larger_needs": "micro-batch {micro_batch:d} would need {peak:.1f} GiB",
    "plan.optimizer": "optimizer {optimizer}: 8-bit states are a quarter of 32-bit ones",
    "plan.optimizer_adamw": "optimizer {optimizer}: 8-bit states are a quarter of 32-bit ones (32-bit AdamW would "
    "need {peak:.1f} GiB)",
    "plan.without": "{line}; without it {peak:.2f} GiB",
    "plan.loss": "loss chunked: the LM head and fp32 cross-entropy run {tokens:d} tokens at a time, {chunked:.2f} GiB "
    "instead of {full:.2f} GiB of logits; the head runs again in backward (+{extra:.1%} step time)",
    "plan.offload_embeddings": "offload_embeddings: the frozen input embedding ({moved:.2f} GiB) stays in CPU RAM; "
    "each micro-batch copies its {rows:,} rows over",
    "plan.offload_activations": "offload_activations: the {layers:d} checkpointed layer inputs ({host:.2f} GiB) wait "
    "in pinned CPU RAM, {moved:.2f} GB over the {link:g} GB/s host link per micro-batch (+{extra:.1%} step time)",
    "plan.expandable_segments": "expandable_segments: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; the caching "
    "allocator keeps {kept:.2f} GiB above the allocated peak instead of {plain:.2f} GiB (its simulation, not "
    "measured on a GPU)",
    "plan.qlora": "QLoRA: the frozen base is stored in 4-bit NF4; the LoRA adapters (r={lora_r:d}, {lora_targets} "
    "linear layers) train, in fp32",
    "plan.qlora_double": "QLoRA: the frozen base is stored in 4-bit NF4 with double quantisation; the LoRA "
    "adapters (r={lora_r:d}, {lora_targets} linear layers) train, in fp32",
    "plan.train_embeddings": "train_embeddings: the input embeddings and LM head train in full beside the adapters "
    "({params:,d} more trainable parameters, with their gradients and optimizer states): {more:+.2f} GiB at the peak",
    "plan.gpus_hold": "{world:d} GPU(s), {shard}: each holds {weights:.2f} GiB of weights, {gradients:.2f} GiB of "
    "gradients, {states:.2f} GiB of optimizer states, {gathered:.2f} GiB of gathered layers",
    "plan.communication": "communication: {moved:.2f} GB per GPU per optimizer step over {link} ({speed:.1f} GB/s "
    "as NCCL runs it); {share:.0%} of the step waits for it",
    "plan.offload": "offload {offload}: {host:.1f} GiB in host RAM; the copies over PCIe and the CPU optimizer step "
    "take {share:.0%} of the step",
    "plan.host_ram": "host RAM: {host:.1f} GiB on each machine (the larger of loading and training)",
    # --- plan: a plan that does not fit, no GPU, the CPU ---
    "plan.no_fit": "does not fit: even the smallest configuration needs {peak:.1f} GiB and {gpu} has {usable:.1f} "
    "GiB after {headroom:.0%} headroom",
    "plan.no_fit_savers": "does not fit: even the smallest configuration needs {peak:.1f} GiB (with "
    "{setting_savers}) and {gpu} has {usable:.1f} GiB after {headroom:.0%} headroom",
    "plan.loads_whole": "several {gpu}s do not help {stack}'s trainer with {shards}: it loads the {quant} base whole "
    "({loading:.1f} GiB) onto every GPU before sharding it; {instead} loads it in host memory and moves it to the "
    "GPUs a sharded layer at a time",
    "plan.no_gpu": "no GPU given or detected: settings are the defaults, memory is reported without a verdict",
    "plan.cpu_ckpt_on": "gradient checkpointing on: without it the step needs {need:.1f} GiB of RAM and {free:.1f} "
    "GiB is free",
    "plan.cpu_defaults": "training on the CPU: settings are the defaults, sized to the RAM free now",
    "plan.cpu_ckpt_off": "gradient checkpointing off: the step needs {need:.1f} GiB of the {free:.1f} GiB of RAM "
    "free, so no forward pass is recomputed",
    # --- plan: settings that follow from the model, the GPU or the device ---
    "plan.prequantized": "QLoRA only: {model} is a pre-quantised checkpoint (bitsandbytes {quant}, loaded as "
    "stored); LoRA or full fine-tuning need {base}",
    "plan.prequantized_double": "QLoRA only: {model} is a pre-quantised checkpoint (bitsandbytes {quant}, "
    "double-quantised, loaded as stored); LoRA or full fine-tuning need {base}",
    "plan.dynamic_4bit": "{model} is an Unsloth dynamic 4-bit checkpoint: it keeps some layers in 16-bit (its "
    "config.json's llm_int8_skip_modules, chosen per model), counted here as 4-bit, so the estimate may be low; "
    "--model with its downloaded config.json (a few kB) counts them",
    "plan.unsloth_dynamic_4bit": "stack unsloth loads {model} in 4-bit from Unsloth's dynamic 4-bit copy where it "
    "publishes one, which keeps some layers in 16-bit; counted here as 4-bit, so the estimate may be low",
    "plan.unsloth_dynamic_known": "stack unsloth loads {model} in 4-bit from {repo}, which keeps {params:.2f}B "
    "weights in 16-bit: counted here, {gib:.2f} GiB more than all 4-bit",
    "plan.base_named": "the 16-bit base {base}",
    "plan.base_unnamed": "its 16-bit base",
    "plan.attn": "attention {attn}: {model} has no sdpa kernel in transformers",
    "plan.cpu_fp32": "precision fp32: no GPU, training on the CPU (bf16 there runs ~20x slower)",
    "plan.no_bf16": "precision fp16: the {gpu} has no bf16",
    "plan.packed": "batching {batching}: flash attention takes packed rows exactly",
    "plan.grouped": "batching {batching}: rows of similar length together, so padding wastes little compute",
    "plan.truncates": "sequence length {seq_len:d} truncates {rows:d} rows of the data",
    "plan.vision": "image-text model: its vision tower is counted in memory (frozen, stored like the base) but "
    "images in the data are not modelled: memory and time are for text-only rows",
    "plan.per_layer_inputs": "Gemma 4 E2B / E4B: the per-layer embedding table ({params:.2f}B parameters) is held in "
    "16 bit (4-bit quantisation covers nn.Linear layers only), its audio tower is counted like the vision tower, and "
    "its last {shared:d} layers reuse earlier layers' keys and values (no k_proj / v_proj to adapt)",
    "plan.mllama": "Llama 3.2 Vision: lorafit train loads its language model alone (MllamaForCausalLM, no vision "
    "tower); its {layers:d} cross-attention layers are stored but skipped for text rows, and get no adapters; "
    "images in the data are not modelled",
    "plan.moe_full": "mixture of experts: {experts:d} experts a layer, {per_token:d} per token, held in 16 bit "
    "(4-bit quantisation covers nn.Linear layers only); "
    "every expert trains",
    "plan.moe_experts": "mixture of experts: {experts:d} experts a layer, {per_token:d} per token, held in 16 bit "
    "(4-bit quantisation covers nn.Linear layers only); "
    "LoRA adapts the attention and every expert (peft target_parameters)",
    "plan.moe_attention": "mixture of experts: {experts:d} experts a layer, {per_token:d} per token, held in 16 bit "
    "(4-bit quantisation covers nn.Linear layers only); "
    "LoRA adapts the attention ({setting_targets} experts {setting_dropout} 0 adapts the experts too)",
    "plan.moe_dense_mlp": "mixture of experts: {experts:d} experts a layer, {per_token:d} per token, held in 16 bit "
    "(4-bit quantisation covers nn.Linear layers only); LoRA adapts the attention and the dense MLP that runs "
    "beside the experts ({setting_targets} experts {setting_dropout} 0 adapts the experts instead of the MLP)",
    # --- plan: the smallest changes that fit (plan.suggestions) ---
    "change.seq_len": "sequence length {seq_len:d} instead of {was:d}",
    "change.qlora": "QLoRA (4-bit base) instead of {method}",
    "change.lora": "LoRA instead of full fine-tuning",
    "change.bigger_gpu": "a GPU with more memory: {gpu} ({memory:.0f} GiB)",
    "change.gpus": "{n_gpus:d}x {gpu} with {shard}, {hours:.1f} h",
    "change.gpus_nodes": "{n_gpus:d}x {gpu} on each of {nodes:d} machines with {shard}, {hours:.1f} h",
    "change.gpus_offload": "{n_gpus:d}x {gpu} with {shard} and CPU offload of {offload}, {hours:.1f} h",
    "change.gpus_nodes_offload": "{n_gpus:d}x {gpu} on each of {nodes:d} machines with {shard} and CPU offload of "
    "{offload}, {hours:.1f} h",
    "offload.optimizer": "the optimizer states",
    "offload.params": "the parameters",
    "gpu.by_memory": "{gb:g} GB GPU",
    # --- errors: a setting's value (options.one_line), a request (answers, the web page) ---
    "error.setting": "{setting} {value}: {problem}",
    "error.unknown_key": "unknown key {key!r}; did you mean {setting_close}?",
    "error.unknown_key_init": "unknown key {key!r}; see `lorafit init` for every key",
    "error.gpu_and_vram": "pass {setting_gpu} or {setting_vram}, not both",
    "problem.one_of": "must be one of {choices}",
    "problem.greater_than": "must be greater than {limit}",
    "problem.at_least": "must be at least {limit}",
    "problem.less_than": "must be less than {limit}",
    "problem.at_most": "must be at most {limit}",
    "problem.whole_number": "must be a whole number",
    "problem.number": "must be a number",
    "problem.finite_number": "must be a finite number",
    "problem.true_or_false": "must be true or false",
    "problem.not_empty": "must not be empty",
    "problem.text": "must be text",
    "problem.mapping": "must be a mapping of FIELD: COLUMN",
    "error.bool": "{setting} {value!r}: must be true or false",
    "error.twice": "{setting} is given twice",
    "error.not_here": "{setting}: not a setting of {api}",
    "error.run_one_plan": "/api/run takes the settings of one plan: a model and a GPU, no compare",
    "error.too_large": "{name} is larger than the {limit} MiB an upload of {kind} may be",
    "error.empty": "{name} is empty",
    "upload.unnamed": "the upload",
    "error.upload_kind": "upload kind {kind!r}: must be model (a config.json) or data (a dataset file)",
    "error.data_suffix": "{name}: a dataset upload is {suffixes}",
    "error.not_uploaded": "{setting} {value}: the server reads only files sent to it; upload the file",
    "error.not_an_upload": "{setting} {value}: not an upload of this server",
    "error.upload_gone": "{setting} {value}: no such upload on this server (upload the file again)",
    "error.model_path": "{setting} {value}: the server reads only files sent to it; upload the config.json",
    "error.tokenizer": "{setting}: the server counts a dataset's tokens without a local tokenizer",
    "error.unknown_gpu": "no GPU {name!r} in the catalog; see `lorafit gpus`, or pass {setting_vram} GB",
    "error.unknown_gpu_close": "no GPU {name!r} in the catalog; did you mean {names}? see `lorafit gpus`, or pass "
    "{setting_vram} GB",
    "error.unknown_model": "no model {model!r}: {what} (lorafit never downloads); {hint}for a fine-tune or any "
    "checkpoint of a supported architecture, pass its downloaded folder or its config.json as {setting} (`lorafit "
    "models` lists the catalog)",
    "model.not_in_catalog": "not in the catalog",
    "model.copy_not_in_catalog": "a pre-quantised copy of {base!r}, which is not in the catalog either",
    "model.did_you_mean": "did you mean {names}? ",
    "error.seq_len_past": "{setting} {seq_len:d} is past {model}'s maximum of {limit:d} tokens",
    "error.seq_len_no_rope": "{setting} {seq_len:d} is past {model}'s maximum of {limit:d} tokens, and "
    "{setting_stack} {stack} does not scale RoPE; the stacks that do: {stacks}",
    "plan.rope": "sequence length {seq_len:d} is past {model}'s {limit:d} trained positions: stack {stack} scales RoPE "
    "by a factor of {factor:d} (rope_scaling) to reach it",
    "error.stack_not_offered": "{setting} {name}: not offered ({why}); see `lorafit stacks`",
    "rule.qlora_needs_quant": "{setting_method} qlora needs a quantised base: {setting_quant} nf4 or int8 (for "
    "16-bit weights use {setting_method} lora)",
    "rule.quant_needs_qlora": "{setting_method} {method} trains on 16-bit weights: {setting_quant} must be none (a "
    "quantised base is {setting_method} qlora)",
    "error.prequantized_fp4": "{model}: its weights are stored bitsandbytes 4-bit fp4; lorafit trains a 4-bit base in "
    "NF4 only: use the 16-bit base model",
    "error.prequantized": "{what}: {model} is a pre-quantised {bits}-bit checkpoint: only {setting_method} qlora "
    "{setting_quant} {quant} trains it; for LoRA or full fine-tuning use {base}",
    "error.prequantized_shard": "{setting} {shard}: {model} stores its 4-bit weights as uint8, which ZeRO-3 and FSDP "
    "cannot flatten with the 16-bit ones (train/hf_args.py quant_storage); use {setting} ddp or zero2, or the 16-bit "
    "base {base} with {setting_method} qlora",
    "error.tied_offload": "{setting}: {model} ties its input embeddings to the LM head, which runs on the GPU; turn "
    "{setting} off",
    "error.no_attention": "{setting} {attn}: {model} ({architecture}) has no {attn} attention in transformers; use "
    "{setting} {choices}",
    "error.no_bf16": "{setting} bf16: the {gpu} has no bf16; use {setting} fp16 (or fp32)",
    "error.fp16_cpu": "{setting} fp16 needs a CUDA GPU; on the CPU use {setting} fp32 (or bf16)",
    "error.flash_cpu": "{setting} flash: flash attention runs on CUDA GPUs only; on the CPU use {setting} sdpa",
    "error.unmodelled": "{name}: {family} ({model_type}) is not modelled yet; the nearest supported preset is "
    "{nearest} ({setting_model} {nearest} estimates that one instead; `lorafit models` lists them all)",
    "model.base_unnamed": "its 16-bit base model",
    "error.stack_unknown": "{setting} {name}: not a stack lorafit knows; choose one of {names}",
    "error.stack_families": "{setting} {stack} patches the step of {families} models, not {family}; choose one of "
    "those or another stack (`lorafit stacks`)",
    "error.stack_method": "{setting_method} {method}: {setting} {stack} is modelled for {setting_method} {methods}; "
    "choose that or another stack (`lorafit stacks`)",
    "error.stack_shard": "{setting_shard} {shard}: {setting} {stack} runs on several GPUs only with {shards}; choose "
    "that or another stack (`lorafit stacks`)",
    "error.stack_quant": "{setting_quant} {quant}: {setting} {stack} trains over {setting_quant} {can}; see `lorafit "
    "stacks`",
    "stack.no_quant": "none (no quantised base)",
    "error.stack_saver": "{setting_saver}: {setting} {stack} has no such switch (stacks that do: {others})",
    "error.stack_embeddings": "{setting_embeddings}: {setting} {stack} has no modules_to_save (it trains no module "
    "in full beside its adapters; stacks that do: {others})",
    "error.kbit_peft": "{setting_kbit}: {setting} {stack} does not build its adapters with peft",
    "error.kbit_quant": "{setting_kbit} prepares a quantised base: it needs {setting_method} qlora ({setting_quant} "
    "nf4 or int8)",
    "error.liger_switch": "{setting_liger}: {setting} {stack} has no use_liger_kernel switch (stacks that do: "
    "{others})",
    "error.liger_loss": "{setting_loss} chunked: with {setting_liger}, Liger's fused linear cross-entropy is the loss "
    "and never makes the logits; leave {setting_loss} full",
    "error.liger_model": "{setting_liger}: {pinned} does not patch {name} (model type {model_type}); it patches "
    "{count:d} model types, llama, mistral, qwen2, qwen3, gemma and phi3 among them (catalog/stacks.toml [liger]); "
    "turn {setting_liger} off",
    "error.no_experts": "{setting} experts: {model} has no experts; {setting} all adapts its MLP projections",
    "error.experts_dropout": "{setting} experts with {setting_dropout} {dropout}: peft adapts {model}'s fused experts "
    "through target_parameters, which refuses dropout; set {setting_dropout} 0, or {setting} all (the attention only)",
    "config.vision_text": "{file}: a {family} model with a {text_type!r} text model is not modelled; supported text "
    "models: {known}",
    "config.quant_type": "{file}: bnb_4bit_quant_type {kind!r} is not a bitsandbytes 4-bit type (nf4, fp4)",
    "config.dense_layers": "{file}: layers with a dense MLP (mlp_only_layers {dense}, decoder_sparse_step {step}) are "
    "not modelled; lorafit plans MoE models whose every layer is sparse (mlp_only_layers [], decoder_sparse_step 1, "
    "as in the released Qwen3-MoE checkpoints)",
    "config.bool": "{file}: {key} {value} must be true or false",
    "config.whole": "{file}: {key} {value} must be a whole number",
    "config.past": "{file}: {key} {value} is past what any real model has (at most {limit:,})",
    "config.not_json": "{file} is not valid JSON ({why})",
    "config.long_number": "{file} is not a config.json: it holds a number thousands of digits long",
    "config.too_deep": "{file} is not a config.json: its JSON is nested too deeply",
    "config.not_object": "{file} must hold a JSON object",
    "config.unsupported": "{file}: model_type {model_type!r} is not supported; supported: {known}",
    # --- a dataset's rows (lorafit.data: readers, formats, check): what `lorafit data check` lists ---
    "row.where": "{place} (row {row:d})",
    "row.non_utf8": "non-UTF-8 bytes (0x{byte} at byte {offset:d} of the line)",
    "row.non_utf8_line": "non-UTF-8 bytes (0x{byte}) on line {line:d}",
    "row.invalid_json": "invalid JSON: {reason}",
    "row.invalid_json_at": "invalid JSON: {reason} (line {line:d}, column {column:d})",
    "row.json_column": "{reason} (column {column:d})",
    "row.nested": "nested too deeply",
    # what the json module says (its own words, json.decoder): read back so that a page can say it in its language
    "json.error": "{reason}: line {line:d} column {column:d} (char {char:d})",
    "json.expecting_value": "Expecting value",
    "json.expecting_name": "Expecting property name enclosed in double quotes",
    "json.expecting_comma": "Expecting ',' delimiter",
    "json.expecting_colon": "Expecting ':' delimiter",
    "json.extra_data": "Extra data",
    "json.unterminated": "Unterminated string starting at",
    "json.control": "Invalid control character at",
    "json.escape": "Invalid \\escape",
    "row.surrogate": "invalid Unicode: a lone surrogate escape (\\ud800-\\udfff) that no UTF-8 text can hold",
    "row.one_object": "holds one JSON object (keys: {keys}); expected an array of records or one per line",
    "row.not_array": "expected a JSON array of records",
    "row.invalid_csv": "invalid CSV: {reason}",
    "row.header": "header: {problem}",
    "row.fields": "row has {cells:d} fields, the header has {header:d}",
    "row.parquet": "cannot read Parquet: {reason}",
    "row.encoding": "{what}; lorafit reads UTF-8: convert it, e.g. iconv -f {encoding} -t UTF-8 {name} > utf8-{name}",
    "row.binary": "a binary file (NUL bytes), not text",
    "row.compressed": "{what}, not {suffix} text: extract it, or name it for what it holds",
    "row.not_object": "expected an object with columns, got {type}",
    "row.image_column": "column {column!r} holds an image or audio; lorafit fine-tunes image-text models on text only "
    "(the vision and audio towers stay frozen): drop the image and audio columns and parts, or keep only the text rows",
    "row.image_part": "content part {kind!r} holds an image or audio; lorafit fine-tunes image-text models on text "
    "only (the vision and audio towers stay frozen): drop the image and audio columns and parts, or keep only the text "
    "rows",
    "row.missing_column": "missing column {column!r}",
    "row.turns_type": "wrong type: expected a list of turns, got {type}",
    "row.empty_conversation": "empty conversation",
    "row.turn_type": "wrong type: expected a turn object, got {type}",
    "row.missing_role": "missing {key!r} in a turn",
    "row.role_type": "wrong type: role is {type}, expected a string",
    "row.unknown_role": "unknown role {role!r} (expected {expected})",
    "row.missing_content": "missing {key!r} in a {role} turn",
    "row.content_type": "wrong type: content is {type}, expected a string",
    "row.empty_content": "empty content in a {role} turn",
    "row.part_unsupported": "unsupported content part {kind!r}: only text parts can be trained on",
    "row.null": "{column!r} is null",
    "row.column_type": "wrong type: {column!r} is {type}, expected a string",
    "row.empty_column": "empty {column!r}",
    "row.system_late": "system turn at position {index:d}, after the conversation started: some chat templates "
    "(Llama 2, Mistral, Gemma) refuse it; check with {setting}",
    "row.order_start": "turns out of order: conversation starts with {role}, expected user",
    "row.order_tool": "turns out of order: tool turn at position {index:d} follows {previous}",
    "row.order_twice": "turns out of order: two {role} turns in a row at position {index:d}",
    "row.order_user": "turns out of order: user turn at position {index:d} before the assistant answers a tool",
    "row.last_turn": "last turn is {last}, not assistant: there is no answer to train on",
    "row.template": "rejected by the chat template: {reason}",
    "row.truncated": "{tokens:d} tokens, longer than {setting} {seq_len:d}: would be truncated",
    "row.duplicate": "duplicate of row {row:d}",
    "row.duplicate_line": "duplicate of row {row:d}, line {line:d}",
    "row.duplicate_file": "duplicate of row {row:d} of {file}",
    "row.duplicate_line_file": "duplicate of row {row:d}, line {line:d} of {file}",
    "row.empty_dataset": "no rows: the dataset is empty",
    "type.object": "an object",
    "type.list": "a list",
    "type.string": "a string",
    "type.boolean": "a boolean",
    "type.number": "a number",
    "type.null": "null",
    "data.bad_rows": "{where}: {problem}; run `lorafit data check {path}` for the full list",
    "data.bad_rows_more": "{where}: {problem} (and {more:d} more rows with errors); run `lorafit data check {path}` "
    "for the full list",
    "data.no_rows": "{path} has no rows; run `lorafit data check {path}`",
    "data.no_rows_profile": "{path} has no rows to profile; run `lorafit data check {path}`",
    "data.not_records": "cannot tell the format of {source}: its records are not objects with columns (they are "
    "{kinds}); expected one object per record, e.g. {example}",
    "data.format_unknown": "cannot tell the format of {name}: columns seen: {seen}; expected one of alpaca "
    "(instruction/output), sharegpt (conversations), messages, prompt_completion (prompt/completion) or text; pass "
    "{setting_format}, or {setting_map} FIELD=COLUMN (e.g. {setting_map} instruction=question)",
}


def say(key: str, /, **params: object) -> str:
    """The English sentence `key` with its parameters: what the CLI prints."""
    return EN[key].format(**params)


NUMBER = r"-?[\d,]*\.?\d+%?"
_FIELD = re.compile(r"\{(\w+)(?:![rsa])?(?::[^}]*)?\}")


@cache
def _numbers(key: str) -> frozenset[str]:
    """The parameters of sentence `key` that are printed as numbers (their format is d, f, g, % or ,)."""
    fields = string.Formatter().parse(EN[key])
    return frozenset(name for _, name, spec, _ in fields if name and spec and spec[-1] in "dfg%,")


@cache
def _pattern(key: str) -> re.Pattern[str]:
    """The regular expression that reads sentence `key` back into its parameters (each as it was printed)."""
    parts, seen = [], set()
    for literal, name, _, _ in string.Formatter().parse(EN[key]):
        parts.append(re.escape(literal))
        if name is None:
            continue
        value = NUMBER if name in _numbers(key) else ".*?"  # a number is digits: it cannot swallow words
        parts.append(f"(?P={name})" if name in seen else f"(?P<{name}>{value})")
        seen.add(name)
    return re.compile("".join(parts), re.DOTALL)


@cache
def _most_specific_first() -> list[str]:
    """Keys by how much fixed text their sentence has: a sentence with more words wins over a looser one."""
    fixed = {key: sum(len(literal) for literal, *_ in string.Formatter().parse(text)) for key, text in EN.items()}
    return sorted(EN, key=lambda key: -fixed[key])


def parse(text: str) -> tuple[str, dict[str, str]] | None:
    """(key, parameters as printed) of an English sentence of the catalog; None for any other text."""
    for key in _most_specific_first():
        match = _pattern(key).fullmatch(text)
        if match:
            return key, match.groupdict()
    return None


def render(
    text: str,
    catalog: Mapping[str, str],
    setting_name: Callable[[str], str] = str,
    number: Callable[[str], str] = str,
) -> str:
    """`text` (an English sentence as the CLI prints it) in the language of `catalog` (key -> sentence with
    plain {parameters}); a setting's spelling through `setting_name`, a number's (as printed: 1,234.5) through
    `number`. A sentence the catalog lacks stays English, and text that is no sentence of the catalog (a name, a
    path) stays as it is."""
    lines = text.split("\n")
    if len(lines) > 1:
        return "\n".join(render(line, catalog, setting_name, number) for line in lines)
    found = parse(text)
    if found is None:
        return text
    key, params = found

    def shown(name: str, value: str) -> str:
        if name.startswith("setting"):
            return setting_name(value)
        if name in _numbers(key):
            return number(value)
        return render(value, catalog, setting_name, number)

    said = {name: shown(name, value) for name, value in params.items()}
    template = catalog.get(key)
    if template is None:  # not translated yet: the English sentence, with the settings named as the page names them
        template = EN[key]
    return _FIELD.sub(lambda m: said[m.group(1)], template)
