"""`--from FILE` (lorafit.configs): a config another trainer publishes reads to the lorafit settings that run
would have, what lorafit cannot model is named key by key, and a file that cannot be read is refused in one line
that names it. The expected settings are read off each file by hand, with the tool's documented defaults."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import run_cli
from lorafit import configs, options
from lorafit.errors import InvalidConfig

FIXTURES = Path(__file__).parent / "data" / "configs"

# file -> (kind, values, unmodelled)
PUBLISHED: dict[str, tuple[str, dict[str, Any], list[str]]] = {
    "axolotl_llama3_qlora.yml": (
        "axolotl",
        {
            "stack": "axolotl",
            "model": "NousResearch/Meta-Llama-3-8B",
            "method": "qlora",
            "lora_r": 32,
            "lora_alpha": 16,
            "lora_dropout": 0.05,
            "lora_targets": "all",  # lora_target_linear
            "micro_batch": 2,
            "grad_accum": 4,
            "seq_len": 4096,
            "epochs": 4,
            "grad_ckpt": True,
            "attn": "flash",
            "optimizer": "paged_adamw_32bit",
            # bf16: auto sets no precision: bf16 where the GPU has it, as lorafit's own default
        },
        [],  # sample_packing fills rows to sequence_len: the micro_batch x seq_len step lorafit estimates
    ),
    "axolotl_llama3_lora_8b.yml": (
        "axolotl",
        {
            "stack": "axolotl",
            "model": "NousResearch/Meta-Llama-3-8B",
            "method": "qlora",  # LoRA over load_in_8bit
            "quant": "int8",
            "lora_r": 32,
            "lora_alpha": 16,
            "lora_dropout": 0.05,
            "lora_targets": "all",
            "micro_batch": 2,
            "grad_accum": 4,
            "seq_len": 4096,
            "epochs": 4,
            "grad_ckpt": True,
            "attn": "flash",
            "optimizer": "adamw_8bit",  # adamw_bnb_8bit
            "train_embeddings": True,  # lora_modules_to_save: [embed_tokens, lm_head]
        },
        [
            "deepspeed: deepspeed_configs/zero2.json (a DeepSpeed config file is not read; give shard zero2 or zero3,"
            " and offload)",
        ],
    ),
    "llama_factory_llama3_qlora_sft_bnb_npu.yaml": (
        "llama-factory",
        {
            "stack": "llama-factory",
            "model": "meta-llama/Meta-Llama-3-8B-Instruct",
            "method": "qlora",
            "double_quant": False,
            "lora_r": 8,
            "lora_dropout": 0.0,  # LLaMA-Factory's default
            "lora_targets": "all",
            "micro_batch": 1,
            "grad_accum": 8,
            "seq_len": 2048,
            "epochs": 3.0,
            "precision": "bf16",
            "autocast": True,
            "grad_ckpt": True,  # on unless disable_gradient_checkpointing
            "optimizer": "adamw",
        },
        [],
    ),
    "llama_factory_llama3_lora_sft.yaml": (
        "llama-factory",
        {
            "stack": "llama-factory",
            "model": "meta-llama/Meta-Llama-3-8B-Instruct",
            "method": "lora",
            "lora_r": 8,
            "lora_dropout": 0.0,
            "lora_targets": "all",
            "micro_batch": 1,
            "grad_accum": 8,
            "seq_len": 2048,
            "epochs": 3.0,
            "precision": "bf16",
            "autocast": True,
            "grad_ckpt": True,
            "optimizer": "adamw",
        },
        [],
    ),
    "llama_factory_llama3_full_sft.yaml": (
        "llama-factory",
        {
            "stack": "llama-factory",
            "model": "meta-llama/Meta-Llama-3-8B-Instruct",
            "method": "full",
            "micro_batch": 1,
            "grad_accum": 2,
            "seq_len": 2048,
            "epochs": 3.0,
            "precision": "bf16",
            "autocast": True,
            "grad_ckpt": True,
            "optimizer": "adamw",
        },
        [
            "deepspeed: examples/deepspeed/ds_z3_config.json (a DeepSpeed config file is not read; give shard zero2"
            " or zero3, and offload)"
        ],
    ),
    "trl_sft_lora_args.json": (
        "trl",
        {
            "stack": "trl",
            "model": "Qwen/Qwen2-0.5B",
            "method": "lora",
            "lora_r": 32,
            "lora_alpha": 16,
            "lora_targets": "qv",  # no lora_target_modules: peft's default for Qwen2, q_proj and v_proj
            "micro_batch": 2,
            "grad_accum": 8,
            "seq_len": 1024,  # SFTConfig's max_length, which packing fills
            "epochs": 1,
            "grad_ckpt": True,
            "precision": "bf16",  # SFTConfig's bf16 unless fp16
            "autocast": True,
            "optimizer": "adamw",
            "fused_optimizer": True,  # adamw_torch_fused
        },
        [],
    ),
    "trl_sft_qlora.yaml": (
        "trl",
        {
            "stack": "trl",
            "model": "mistralai/Mistral-7B-v0.1",
            "method": "qlora",
            "double_quant": False,  # ModelConfig's use_bnb_nested_quant
            "lora_r": 16,
            "lora_alpha": 16,
            "lora_dropout": 0.05,
            "lora_targets": "all",
            "micro_batch": 4,
            "grad_accum": 2,
            "seq_len": 2048,
            "epochs": 1,
            "grad_ckpt": True,
            "precision": "bf16",
            "autocast": True,
            "attn": "flash",
            "optimizer": "adamw",
        },
        [],
    ),
    "torchtune_llama2_7b_qlora_single_device.yaml": (
        "torchtune",
        {
            "stack": "torchtune",
            "model": "/tmp/Llama-2-7b-hf",  # the checkpointer's directory
            "method": "qlora",  # qlora_llama2_7b
            "lora_r": 8,
            "lora_alpha": 16,
            "lora_dropout": 0.0,
            "lora_targets": "all",  # q, k, v, output_proj and the MLP
            "micro_batch": 2,
            "grad_accum": 8,
            "epochs": 1,
            "grad_ckpt": True,
            "offload_activations": False,
            "precision": "bf16",
            "autocast": False,
            "optimizer": "adamw",
            "fused_optimizer": True,
            "loss": "chunked",  # CEWithChunkedOutputLoss
        },
        [],
    ),
    "litgpt_llama2_7b_qlora.yaml": (
        "litgpt",
        {
            "stack": "litgpt",
            "model": "meta-llama/Llama-2-7b-hf",
            "method": "qlora",
            "double_quant": False,  # bnb.nf4, not bnb.nf4-dq
            "lora_r": 32,
            "lora_alpha": 16,
            "lora_dropout": 0.05,
            "lora_targets": "qv",  # lora_query and lora_value
            "micro_batch": 2,
            "batch_size": 8,
            "seq_len": 512,
            "epochs": 4,
            "n_gpus": 1,
            "nodes": 1,
            "grad_ckpt": False,  # litgpt checkpoints activations only when it shards over several GPUs
            "precision": "bf16",
            "autocast": False,  # bf16-true
            "optimizer": "paged_adamw_32bit",  # litgpt swaps AdamW for bitsandbytes' PagedAdamW when quantised
        },
        [],
    ),
    "lorafit_train.yaml": (
        "lorafit",
        {
            "stack": "lorafit",
            "model": "llama-3.1-8b",
            "data": "data/train.jsonl",
            "method": "qlora",
            "quant": "nf4",  # stated in the file: a lorafit YAML is read as it is
            "lora_r": 16,
            "lora_targets": "all",
            "optimizer": "paged_adamw_8bit",
            "micro_batch": 2,
            "grad_accum": 8,
            "seq_len": 4096,
            "grad_ckpt": True,
            "learning_rate": 0.0002,
            "output_dir": "runs/llama-3.1-8b-qlora",
        },
        [],
    ),
}


def write(tmp_path: Path, name: str, content: str | dict[str, Any]) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(content) if isinstance(content, dict) else content)
    return path


# --- the published configs ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_a_published_config_reads_to_the_settings_its_run_has(name: str) -> None:
    kind, values, unmodelled = PUBLISHED[name]
    imported = configs.read(FIXTURES / name)
    assert imported.kind == kind
    assert imported.values == values
    assert imported.unmodelled == unmodelled


def test_every_fixture_is_checked() -> None:
    assert {path.name for path in FIXTURES.iterdir() if path.suffix != ".md"} == set(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_every_value_is_a_lorafit_setting_that_plan_accepts(name: str) -> None:
    values = configs.read(FIXTURES / name).values
    assert set(values) <= set(options.BY_NAME)
    plan_keys = set(options.config_keys("plan"))
    options.validate("plan", {key: value for key, value in values.items() if key in plan_keys}, source=name)


@pytest.mark.parametrize(
    ("fixture", "misleading_name", "kind"),
    [
        ("axolotl_llama3_qlora.yml", "trl_sft_args.json", "axolotl"),
        ("trl_sft_lora_args.json", "axolotl.yml", "trl"),
        ("litgpt_llama2_7b_qlora.yaml", "7B_qlora_single_device.yaml", "litgpt"),
        ("torchtune_llama2_7b_qlora_single_device.yaml", "config.json", "torchtune"),
        ("llama_factory_llama3_lora_sft.yaml", "lorafit.yaml", "llama-factory"),
    ],
)
def test_the_kind_comes_from_the_keys_not_the_file_name(
    tmp_path: Path, fixture: str, misleading_name: str, kind: str
) -> None:
    path = write(tmp_path, misleading_name, (FIXTURES / fixture).read_text())
    assert configs.read(path).kind == kind


# --- refusals: one line naming the file -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "content", "says"),
    [
        ("missing.yaml", None, "no such file"),
        ("broken.yaml", "base_model: [unclosed\nadapter: qlora\n", "is not valid YAML (line"),
        ("broken.json", '{"per_device_train_batch_size": 2,\n "bf16": true', "is not valid JSON (line"),
        ("list.yaml", "- base_model: x\n- adapter: lora\n", "must hold a mapping of settings at the top level"),
        ("empty.yaml", "", "must hold a mapping of settings at the top level, not nothing"),
        ("unknown.yaml", "foo: 1\nbar: [2]\n", "cannot tell which trainer"),
        ("nothing.json", "{}", "cannot tell which trainer"),
        ("optim.json", {"per_device_train_batch_size": 2, "optim": "adafactor"}, "optim adafactor: not an optimizer"),
        ("freeze.yaml", "stage: sft\nfinetuning_type: freeze\n", "finetuning_type freeze"),
        ("adapter.yml", "base_model: x\nadapter: llama-adapter\nmicro_batch_size: 1\n", "adapter llama-adapter"),
        ("quantize.yaml", "checkpoint_dir: checkpoints/x\nquantize: gptq\n", "quantize gptq"),
        (
            "optimizer.yaml",
            "model: {_component_: torchtune.models.llama2.lora_llama2_7b}\noptimizer:\n"
            "  _component_: torch.optim.Adagrad\n",
            "optimizer torch.optim.Adagrad",
        ),
        ("loss.json", {"use_peft": True, "loss_type": "focal"}, "loss_type focal"),
    ],
)
def test_a_file_that_cannot_be_read_is_refused_in_one_line_naming_it(
    tmp_path: Path, name: str, content: str | dict[str, Any] | None, says: str
) -> None:
    path = tmp_path / name if content is None else write(tmp_path, name, content)
    with pytest.raises(InvalidConfig) as refused:
        configs.read(path)
    message = str(refused.value)
    assert says in message
    assert str(path) in message
    assert "\n" not in message


# a ~350-byte YAML whose aliases expand to 9^9 (387 million) strings: a "billion laughs"
LAUGHS = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f"{name}: &{name} [{', '.join(['*' + previous] * 9)}]\n"
    for previous, name in zip("abcdefgh", "bcdefghi", strict=True)
)
# files that ended in a traceback, or in exhausting memory, before they were bounded
HOSTILE: dict[str, tuple[str, str, str]] = {
    "an alias inside itself": ("recursive.yaml", "method: lora\nlora_targets: &a [*a]\n", "inside its own anchor"),
    "20,000-deep YAML": ("deep.yaml", "method: " + "[" * 20_000 + "]" * 20_000 + "\n", "nested more than"),
    "100,000-deep JSON": ("deep.json", '{"use_peft": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested more than"),
    "a 5,000-digit YAML number": ("long.yaml", "method: lora\nlora_r: " + "7" * 5000 + "\n", "5000 digits"),
    "a 5,000-digit JSON number": ("long.json", '{"use_peft": true, "lora_r": ' + "7" * 5000 + "}", "5000 digits"),
    "a billion laughs": ("laughs.yaml", LAUGHS, "values once aliases expand"),
    "a date that does not exist": ("date.yaml", "method: lora\nseed: 2024-02-30\n", "day is out of range"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_file_is_refused_in_one_line_naming_it(tmp_path: Path, case: str) -> None:
    name, content, says = HOSTILE[case]
    path = write(tmp_path, name, content)
    assert len(LAUGHS) < 500
    with pytest.raises(InvalidConfig) as refused:
        configs.read(path)
    message = str(refused.value)
    assert says in message and str(path) in message and "\n" not in message


def test_plan_from_a_hostile_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name, content, says in HOSTILE.values():
        path = write(tmp_path, name, content)
        code, out, err = run_cli(["plan", "--gpu", "RTX 4090", "--from", str(path)], capsys)
        assert (code, out, err.count("\n")) == (2, "", 1) and says in err and str(path) in err, err


@pytest.mark.parametrize(
    ("deepspeed", "says"),
    [
        ({"zero_optimization": "stage3"}, "deepspeed.zero_optimization stage3: must be a mapping"),
        ({"zero_optimization": [3]}, "deepspeed.zero_optimization [3]: must be a mapping"),
        ([{"zero_optimization": {"stage": 3}}], "a DeepSpeed config is the path to its file or a mapping"),
        ({"zero_optimization": {"stage": [3]}}, "deepspeed.zero_optimization.stage [3]: DeepSpeed ZeRO has stages"),
        ({"zero_optimization": {"stage": True}}, "deepspeed.zero_optimization.stage true: DeepSpeed ZeRO has stages"),
        (
            {"zero_optimization": {"stage": 3, "offload_param": "cpu"}},
            "deepspeed.zero_optimization.offload_param cpu: must be a mapping such as {device: cpu}",
        ),
        (
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "disk"}}},
            "offload_optimizer.device disk: DeepSpeed offloads to none, cpu or nvme",
        ),
    ],
)
def test_a_malformed_deepspeed_section_is_one_line(tmp_path: Path, deepspeed: Any, says: str) -> None:
    for base in ({"use_peft": True}, {"base_model": "x", "adapter": "lora"}, {"stage": "sft", "cutoff_len": 512}):
        path = write(tmp_path, "ds.json", base | {"deepspeed": deepspeed})
        with pytest.raises(InvalidConfig) as refused:
            configs.read(path)
        assert says in str(refused.value) and str(path) in str(refused.value), base


@pytest.mark.parametrize(
    ("name", "content", "says"),
    [
        # values of the wrong shape or type, deeper than the top level
        ("lf_bits.yaml", "stage: sft\nfinetuning_type: lora\nquantization_bit: [4]\n", "quantization_bit [4]"),
        ("lf_attn.yaml", "stage: sft\nflash_attn: [fa2]\n", "flash_attn [fa2]: use one of"),
        ("trl_loss.json", {"use_peft": True, "loss_type": ["nll"]}, "loss_type [nll]"),
        ("tt_dtype.yaml", "model: {_component_: torchtune.models.llama2.llama2_7b}\ndtype: [bf16]\n", "dtype [bf16]"),
        (
            "litgpt_batch.yaml",
            "checkpoint_dir: checkpoints/x\ntrain: {global_batch_size: '16'}\n",
            "train.global_batch_size 16: must be a whole number",
        ),
        (
            "litgpt_fused.yaml",
            "checkpoint_dir: checkpoints/x\noptimizer: {class_path: torch.optim.AdamW, init_args: [fused]}\n",
            "optimizer.init_args [fused]: must be a mapping",
        ),
        ("key.yaml", "1: lora\nmethod: lora\n", "the key 1 is not a setting's name"),
        # true/false settings that are neither, and a number that is a boolean
        ("maybe.yml", "base_model: x\nadapter: lora\nload_in_4bit: maybe\n", "load_in_4bit maybe: must be true or"),
        ("maybe.json", {"use_peft": True, "load_in_8bit": "maybe"}, "load_in_8bit maybe: must be true or false"),
        ("peft.json", {"use_peft": "yes please"}, "use_peft yes please: must be true or false"),
        ("ckpt.yaml", "stage: sft\ndisable_gradient_checkpointing: 1\n", "disable_gradient_checkpointing 1: must be"),
        ("offload.yml", "base_model: x\nactivation_offloading: 1\n", "activation_offloading 1: must be true or false"),
        ("batch.json", {"use_peft": True, "per_device_train_batch_size": True}, "per_device_train_batch_size true"),
        ("lorafit.yaml", "method: lora\nmicro_batch: true\n", "micro_batch true: must be a whole number"),
        # what transformers' torch_dtype cannot be
        ("dtype.json", {"use_peft": True, "torch_dtype": "float8"}, "torch_dtype float8: use one of bfloat16"),
        # a base in 4 and in 8 bits at once
        (
            "bits.yml",
            "base_model: x\nadapter: lora\nload_in_4bit: true\nload_in_8bit: true\n",
            "load_in_4bit and load_in_8bit both ask for a quantised base",
        ),
        ("qlora8.yml", "base_model: x\nadapter: qlora\nload_in_8bit: true\n", "adapter qlora and load_in_8bit"),
        (
            "bits.json",
            {"use_peft": True, "load_in_4bit": True, "load_in_8bit": True},
            "load_in_4bit and load_in_8bit both",
        ),
    ],
)
def test_a_value_lorafit_would_misread_is_refused_in_one_line(
    tmp_path: Path, name: str, content: str | dict[str, Any], says: str
) -> None:
    path = write(tmp_path, name, content)
    with pytest.raises(InvalidConfig) as refused:
        configs.read(path)
    assert says in str(refused.value) and str(path) in str(refused.value) and "\n" not in str(refused.value)


def test_true_and_false_may_be_spelled_as_words(tmp_path: Path) -> None:
    values = configs.read(write(tmp_path, "sft.json", {"use_peft": "true", "load_in_4bit": "True"})).values
    assert (values["method"], values.get("quant", "nf4")) == ("qlora", "nf4")


def test_a_lorafit_config_with_a_typo_is_read_as_lorafit_and_names_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`lora_rank` is LLaMA-Factory's name, but beside lorafit's `method` it is a typo of lora_r: the file is not
    read as LLaMA-Factory's (where method qlora would become lora without a word)."""
    path = write(tmp_path, "run.yaml", "model: llama-2-7b\nmethod: qlora\nlora_rank: 8\n")
    with pytest.raises(InvalidConfig, match="unknown key 'lora_rank'; did you mean lora_r"):
        configs.read(path)
    code, out, err = run_cli(["plan", "--gpu", "RTX 4090", "--from", str(path)], capsys)
    assert code == 2 and out == "" and "did you mean lora_r" in err
    without_method = write(tmp_path, "bare.yaml", "model: llama-2-7b\nlora_rank: 8\nseq_len: 512\n")
    with pytest.raises(InvalidConfig, match="unknown key 'lora_rank'"):
        configs.read(without_method)


def test_a_file_with_lorafit_keys_and_more_of_another_tool_is_not_guessed(tmp_path: Path) -> None:
    path = write(tmp_path, "mixed.yaml", "method: qlora\nlora_rank: 8\ncutoff_len: 512\n")
    with pytest.raises(InvalidConfig) as refused:
        configs.read(path)
    assert "it has lorafit's keys and LLaMA-Factory's (cutoff_len, lora_rank)" in str(refused.value)


def test_an_unknown_kind_names_the_kinds_understood(tmp_path: Path) -> None:
    with pytest.raises(InvalidConfig) as refused:
        configs.read(write(tmp_path, "notes.yaml", "title: my run\n"))
    for kind in ("axolotl", "LLaMA-Factory", "TRL", "TrainingArguments", "torchtune", "litgpt", "lorafit"):
        assert kind in str(refused.value)


def test_a_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidConfig, match="is a directory"):
        configs.read(tmp_path)


# --- how each tool's keys map ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("optim", "optimizer", "fused"),
    [
        ("adamw_torch", "adamw", False),
        ("adamw_torch_fused", "adamw", True),
        ("adamw_bnb_8bit", "adamw_8bit", None),
        ("adamw_8bit", "adamw_8bit", None),
        ("paged_adamw_8bit", "paged_adamw_8bit", None),
        ("paged_adamw_32bit", "paged_adamw_32bit", None),
        ("sgd", "sgd", None),
    ],
)
def test_transformers_optimizer_names(tmp_path: Path, optim: str, optimizer: str, fused: bool | None) -> None:
    values = configs.read(write(tmp_path, "args.json", {"use_peft": True, "optim": optim})).values
    assert values["optimizer"] == optimizer
    assert values.get("fused_optimizer") == fused


def test_a_training_arguments_file_alone_leaves_the_method_to_the_user(tmp_path: Path) -> None:
    """transformers' own defaults: 8 sequences a device, no checkpointing, no autocast; no LoRA keys at all."""
    imported = configs.read(write(tmp_path, "training_args.json", {"output_dir": "out", "do_train": True}))
    assert imported.kind == "trl"
    assert imported.values == {
        "stack": "trl",
        "micro_batch": 8,
        "grad_ckpt": False,
        "autocast": False,
        "optimizer": "adamw",
    }
    assert imported.unmodelled == [
        "method: not stated (a TrainingArguments file does not say whether the script adds LoRA; set method)"
    ]


def test_trl_max_length_null_means_no_truncation(tmp_path: Path) -> None:
    values = configs.read(write(tmp_path, "sft.json", {"use_peft": True, "max_length": None})).values
    assert "seq_len" not in values


def test_an_inline_deepspeed_config_sets_shard_and_offload(tmp_path: Path) -> None:
    zero3 = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    values = configs.read(write(tmp_path, "ds.json", {"use_peft": True, "deepspeed": zero3})).values
    assert (values["shard"], values["offload"]) == ("zero3", "optimizer")
    zero1 = {"zero_optimization": {"stage": 1}}
    imported = configs.read(write(tmp_path, "ds1.json", {"use_peft": True, "deepspeed": zero1}))
    assert imported.values["shard"] == "zero2"
    assert imported.unmodelled == [
        "deepspeed.zero_optimization.stage: 1 (ZeRO-1 keeps whole gradients; estimated as zero2)"
    ]
    options.validate("plan", {"shard": "zero3", "offload": "optimizer", "n_gpus": 2})


def test_axolotl_defaults_and_switches(tmp_path: Path) -> None:
    """What axolotl does when a key is left out (sequence_len 512, no checkpointing, fused AdamW, no dropout),
    its offloaded checkpoints, FSDP with offloaded parameters, and the kernels lorafit does not model."""
    text = (
        "base_model: meta-llama/Llama-3.1-8B\nadapter: lora\nlora_r: 16\nmicro_batch_size: 1\n"
        "gradient_accumulation_steps: 4\nlora_target_modules: [q_proj, k_proj, v_proj]\n"
        "fsdp_config: {fsdp_version: 2, offload_params: true}\nliger_fused_linear_cross_entropy: true\n"
        "cut_cross_entropy: true\n"
    )
    imported = configs.read(write(tmp_path, "axolotl.yml", text))
    assert imported.values == {
        "stack": "axolotl",
        "model": "meta-llama/Llama-3.1-8B",
        "method": "lora",
        "lora_r": 16,
        "lora_dropout": 0.0,
        "lora_targets": "attn",
        "micro_batch": 1,
        "grad_accum": 4,
        "seq_len": 512,
        "grad_ckpt": False,
        "optimizer": "adamw",
        "fused_optimizer": True,
        "shard": "fsdp",
        "offload": "params",
    }
    assert imported.unmodelled == [
        "lora_target_modules: [q_proj, k_proj, v_proj] (estimated as lora_targets attn, which adapts o_proj too)",
        "liger_fused_linear_cross_entropy: true (Liger's fused loss is not modelled; lorafit's nearest is loss"
        " chunked)",
        "cut_cross_entropy: true (Cut Cross-Entropy is not modelled; lorafit's nearest is loss chunked)",
    ]
    offloaded = configs.read(write(tmp_path, "offload.yml", text + "gradient_checkpointing: offload\n")).values
    assert (offloaded["grad_ckpt"], offloaded["offload_activations"]) == (True, True)


def test_llama_factory_defaults(tmp_path: Path) -> None:
    """LLaMA-Factory's own defaults: rank 8 on every linear layer, no dropout, cutoff 2048, checkpointing on, and
    transformers' 8 sequences a device without autocast."""
    text = "model_name_or_path: Qwen/Qwen2.5-7B\nstage: sft\nfinetuning_type: lora\nquantization_bit: 4\n"
    assert configs.read(write(tmp_path, "lf.yaml", text)).values == {
        "stack": "llama-factory",
        "model": "Qwen/Qwen2.5-7B",
        "method": "qlora",
        "double_quant": True,
        "lora_r": 8,
        "lora_dropout": 0.0,
        "lora_targets": "all",
        "micro_batch": 8,
        "seq_len": 2048,
        "grad_ckpt": True,
        "autocast": False,
        "optimizer": "adamw",
    }


def test_liger_switches_read_as_the_liger_facet(tmp_path: Path) -> None:
    """TRL's use_liger_kernel and LLaMA-Factory's enable_liger_kernel turn the liger facet on (no longer a line of
    what is not modelled); the answer's estimate runs with it."""
    trl = configs.read(write(tmp_path, "sft.json", {"use_peft": True, "use_liger_kernel": True}))
    text = "model_name_or_path: Qwen/Qwen2.5-7B\nfinetuning_type: lora\nenable_liger_kernel: true\n"
    factory = configs.read(write(tmp_path, "lf.yaml", text))
    for imported in (trl, factory):
        assert imported.values["liger"] is True and not any("liger" in line for line in imported.unmodelled)
        options.validate("plan", {"stack": imported.values["stack"], "liger": True})
    off = configs.read(write(tmp_path, "off.json", {"use_peft": True, "use_liger_kernel": False}))
    assert "liger" not in off.values


def test_torchtune_full_fine_tune_with_what_lorafit_does_not_model(tmp_path: Path) -> None:
    text = (
        "model: {_component_: torchtune.models.llama3_1.llama3_1_8b}\nbatch_size: 4\ngradient_accumulation_steps: 1\n"
        "optimizer: {_component_: bitsandbytes.optim.PagedAdamW8bit, lr: 2e-5}\noptimizer_in_bwd: True\n"
        "compile: True\ndtype: bf16\nfsdp_cpu_offload: True\n"
    )
    imported = configs.read(write(tmp_path, "full.yaml", text))
    assert imported.values == {
        "stack": "torchtune",
        "method": "full",
        "micro_batch": 4,
        "grad_accum": 1,
        "grad_ckpt": False,
        "autocast": False,
        "precision": "bf16",
        "optimizer": "paged_adamw_8bit",
        "shard": "fsdp",
        "offload": "params",
    }
    assert imported.unmodelled == [
        "compile: true (torch.compile changes what is kept for backward; not modelled)",
        "optimizer_in_bwd: true (stepping the optimizer inside backward (no whole-model gradients) is not modelled)",
    ]


def test_litgpt_on_several_gpus_shards_and_checkpoints(tmp_path: Path) -> None:
    """Several devices: litgpt's FSDPStrategy with activation checkpointing; no quantize: torch's AdamW; the
    LoRA switches it leaves out take setup()'s defaults (query and value)."""
    text = "checkpoint_dir: checkpoints/meta-llama/Llama-2-7b-hf\ndevices: 4\nlora_r: 8\nprecision: bf16-mixed\n"
    assert configs.read(write(tmp_path, "lora.yaml", text)).values == {
        "stack": "litgpt",
        "model": "meta-llama/Llama-2-7b-hf",
        "method": "lora",
        "lora_r": 8,
        "lora_targets": "qv",
        "n_gpus": 4,
        "shard": "fsdp",
        "grad_ckpt": True,
        "precision": "bf16",
        "autocast": True,
        "optimizer": "adamw",
        "fused_optimizer": False,
    }


@pytest.mark.parametrize(
    ("modules", "targets", "line"),
    [
        ("q_proj,v_proj", "qv", None),
        ("q_proj,k_proj,v_proj,o_proj", "attn", None),
        ("all", "all", None),
        ("q_proj,v_proj,o_proj", "attn", "lora_target: [q_proj, v_proj, o_proj] (estimated as lora_targets attn"),
        ("down_proj", "all", "lora_target: [down_proj] (estimated as lora_targets all"),
        ("q_proj,v_proj,lm_head", "qv", "lora_target: [lm_head] (LoRA on the embeddings or LM head is not modelled)"),
    ],
)
def test_lora_modules_map_to_the_smallest_choice_that_covers_them(
    tmp_path: Path, modules: str, targets: str, line: str | None
) -> None:
    imported = configs.read(write(tmp_path, "lf.yaml", f"finetuning_type: lora\nlora_target: {modules}\n"))
    assert imported.values["lora_targets"] == targets
    lines = [entry for entry in imported.unmodelled if entry.startswith("lora_target")]
    if line is None:
        assert lines == []
    else:
        assert len(lines) == 1 and lines[0].startswith(line)
