"""GGUF export of mixture-of-experts families (Qwen3-MoE as llama.cpp's qwen3moe, Mixtral as its llama with
experts, gpt-oss with 16-bit experts as its gpt-oss): the experts transformers saves (per expert, or fused and
transposed), written as llama.cpp reads them, give llama.cpp the logits of transformers; a trained run exports end
to end through the export's own check; a router llama.cpp cannot compute is one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import export_checked, randomize_lora_b, run_cli, run_train
from lorafit.errors import ExportError

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")
pytest.importorskip("llama_cpp", reason="llama-cpp-python is the [gguf] extra")

from test_export_gguf import f32_logit_gap, tiny_model  # noqa: E402

MOE: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128, "norm_topk_prob": True},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    # a sliding window narrower than the text, on every other layer as gpt-oss's layer_types say
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8},
}


def moe_model(folder: Path, tokenizer: Any, model_type: str) -> Any:
    """A tiny random MoE whose router picks clearly (weights far from zero), so that both runtimes route alike,
    saved in two shards with the odd experts in the second, as checkpoints sharded by size can split a layer's."""
    model = tiny_model(folder, tokenizer, model_type, **MOE[model_type])
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight", "mlp.router.weight")):
                parameter.normal_(0.0, 0.5)
            elif name.endswith("_bias"):  # gpt-oss's expert biases, gate and up interleaved
                parameter.normal_(0.0, 0.1)
    model.save_pretrained(folder)
    split_experts(folder)
    return model


def split_experts(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    odd = {name for name in tensors if (part := name.split(".experts.")[-1].split(".")[0]).isdigit() and int(part) % 2}
    shards = {"model-00001-of-00002.safetensors": set(tensors) - odd, "model-00002-of-00002.safetensors": odd}
    for shard, names in shards.items():
        save_file({name: tensors[name] for name in names}, folder / shard, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {name: shard for shard, names in shards.items() for name in names}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "model.safetensors").unlink()


@pytest.mark.parametrize("model_type", MOE)
def test_moe_families_give_llama_cpp_the_logits_of_transformers(
    model_type: str, tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gguf import GGUFReader

    from lorafit.export import gguf

    folder = tmp_path / "model"
    model = moe_model(folder, tokenizer, model_type)
    gap = f32_logit_gap(model, tokenizer, folder)
    assert gap(tmp_path / "model-f32.gguf") < 1e-3
    reader = GGUFReader(tmp_path / "model-f32.gguf")
    tensors = {tensor.name: tuple(int(n) for n in tensor.shape) for tensor in reader.tensors}
    assert tensors["blk.1.ffn_gate_exps.weight"][-1] == 4  # ggml order: columns, rows, experts
    plans = [plan for plan in gguf.tensor_plans(folder, gguf.architecture(folder), "f32") if plan.experts]
    assert model_type == "gpt_oss" or any(len({shard for _, shard in plan.experts}) > 1 for plan in plans)
    assert not any(".experts." in name or name.endswith(("ffn_gate.weight", "ffn_up.weight")) for name in tensors)

    # the comparison can fail: experts stacked in another order, or gate and up rows taken as halves rather than
    # interleaved, compute with the wrong weights
    plans = gguf.tensor_plans

    def wrong_plan(plan: Any) -> Any:
        if plan.experts:
            return gguf.TensorPlan(**(vars(plan) | {"experts": plan.experts[::-1]}))
        if plan.part is not None:
            start, stop, step = plan.part
            halves = (0, stop // 2, 1) if start == 0 else (stop // 2, stop, 1)
            return gguf.TensorPlan(**(vars(plan) | {"part": halves}))
        return plan

    monkeypatch.setattr(gguf, "tensor_plans", lambda *args: [wrong_plan(plan) for plan in plans(*args)])
    assert gap(tmp_path / "wrong.gguf") > 1e-2


def test_a_router_llama_cpp_computes_otherwise_is_one_line(tmp_path: Path) -> None:
    from lorafit.export import gguf

    folder = tmp_path / "model"
    folder.mkdir()
    config = {"model_type": "qwen3_moe", "num_experts": 4, "norm_topk_prob": False}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match="norm_topk_prob = true.*this one has false.*--to merged"):
        gguf.architecture(folder)
    (folder / "config.json").write_text(json.dumps(config | {"norm_topk_prob": True, "mlp_only_layers": [1]}))
    with pytest.raises(ExportError, match="mlp_only_layers"):
        gguf.architecture(folder)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gpt-oss-20b", "mixtral-8x7b"])
def test_a_trained_moe_run_exports_to_checked_gguf(
    name: str, tokenizer: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`lorafit train --lora-targets experts` on a tiny model of the family, its adapter's B made random (a real
    update of every expert), then `export --to gguf` f32 and q4_k_m: the export's own check loads each file in
    llama.cpp and compares it with the merged model in transformers (logits and greedy tokens for f32)."""

    from lorafit.train.demo import build_model, build_tokenizer, corpus
    from test_moe import tiny_moe

    small = build_tokenizer(corpus(), vocab_size=512)
    # bf16 weights, as the hub ships them (f16 holds them exactly), and every expert active: a tiny MoE's top-2 of
    # 4 flips a choice wherever two router logits are within rounding of each other, which a few hundred tokens
    # find; with all 4 the router's weights are continuous (top-2 routing is compared in f32 above)
    spec = tiny_moe(name, len(small)).scaled(num_experts_per_tok=4)
    build_model(tmp_path / "model", small, spec, seed=0, dtype="bfloat16")
    rows = [{"instruction": "hi", "input": "", "output": "yo " * n} for n in range(1, 9)]
    flags = ["--max-steps", "1", "--micro-batch", "2", "--lora-targets", "experts", "--lora-dropout", "0"]
    run = run_train(tmp_path, rows, capsys, *flags)
    randomize_lora_b(run)

    # f32: the check's 24 greedy tokens of a random model (flat next-token distributions) then see the file, not
    # llama.cpp's f16 rounding of activations; the f16 tensors are llama.cpp's converter's (test_bench_export.py)
    output = tmp_path / "gguf"
    export_checked(run, output, capsys, "f32", "q4_k_m")
    assert sorted(path.name for path in output.glob("*.gguf")) == ["run-f32.gguf", "run-q4_k_m.gguf"]


def test_a_run_on_the_mxfp4_gpt_oss_the_hub_ships_exports_to_checked_gguf(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """openai/gpt-oss-* store their experts in MXFP4: `export --to gguf` of a LoRA run on such a base
    dequantises it (transformers' loader) into the merged folder and writes 16-bit experts, checked in llama.cpp;
    before, the base's quantization_config refused it."""
    from lorafit.train.demo import build_model, build_tokenizer, corpus
    from test_moe import save_mxfp4_experts, tiny_moe

    small = build_tokenizer(corpus(), vocab_size=512)
    spec = tiny_moe("gpt-oss-20b", len(small)).scaled(num_experts_per_tok=4)  # every expert: see above
    build_model(tmp_path / "model", small, spec, seed=0, dtype="bfloat16")
    save_mxfp4_experts(tmp_path / "model")
    rows = [{"instruction": "hi", "input": "", "output": "hello"}] * 8
    run = run_train(tmp_path, rows, capsys, "--method", "lora", "--max-steps", "1", "--micro-batch", "2")
    code, out, err = run_cli(["export", str(run), "--to", "gguf", "-o", str(tmp_path / "gguf"), "--json"], capsys)
    assert code == 0, err
    f16 = json.loads(out)["verify"]["f16"]
    assert f16["greedy_match"] is True and f16["max_abs_logit_diff"] <= f16["logit_tolerance"]
