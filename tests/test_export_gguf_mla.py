"""GGUF export of DeepSeek-style latent attention (DeepSeek-V2, V2-Lite and V3 as llama.cpp's deepseek2, Mistral
Small 4 as its mistral4): a dense first block then MoE blocks with a shared expert, queries from q_proj (V2-Lite) or
the q_a/q_b low-rank pair (V2), yarn rope as the released checkpoints configure it; llama.cpp gives the logits of
transformers, a trained run exports end to end through the export's own check, and a router or rope llama.cpp
computes otherwise is one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import run_cli, train_tiny
from lorafit.errors import ExportError

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")
pytest.importorskip("llama_cpp", reason="llama-cpp-python is the [gguf] extra")

from test_export_gguf import f32_logit_gap  # noqa: E402

# DeepSeek-V2-Lite's yarn (config.json: factor 40, mscale and mscale_all_dim 0.707, beta_fast 32, beta_slow 1),
# over a shorter original context so that the tiny model's positions reach the scaled frequencies
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707, "mscale_all_dim": 0.707}
YARN |= {"original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1}
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "v2-lite": ("deepseek_v2", {"q_lora_rank": None, "rope_parameters": YARN}),
    "v2": ("deepseek_v2", {"q_lora_rank": 64, "routed_scaling_factor": 2.5}),
    # DeepSeek-V3's router: sigmoid scores with a correction bias, the best 2 of 4 groups, renormalised and scaled;
    # its released yarn has mscale = mscale_all_dim = 1
    "v3": (
        "deepseek_v3",
        {"q_lora_rank": 64, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5}
        | {"rope_parameters": YARN | {"mscale": 1.0, "mscale_all_dim": 1.0}},
    ),
    # Mistral Small 4's: a softmax router within groups (the released one has a single group), renormalised; its
    # query temperature (beta 0.4, the released 0.1) over an original context the text crosses four times
    "mistral4": (
        "mistral4",
        {"q_lora_rank": 64, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 1.5}
        | {
            "rope_parameters": YARN
            | {"mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.4}
            | {"original_max_position_embeddings": 32}
        },
    ),
}


def deepseek_model(folder: Path, tokenizer: Any, model_type: str, **extra: Any) -> Any:
    """A random DeepSeek of three blocks (the first dense) and 8 experts, norms away from 1 and a router that picks
    clearly, so that both runtimes route alike: a softmax router's weights far from zero, a sigmoid router's small
    enough that no two scores saturate at 1."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        n_shared_experts=1,
        first_k_dense_replace=1,
        vocab_size=len(tokenizer),
        max_position_embeddings=512,
        **extra,
    )
    torch.manual_seed(0)
    if model_type == "mistral4":  # transformers 5.25 lists Mistral4ForCausalLM in no auto table
        from transformers import Mistral4ForCausalLM

        model = Mistral4ForCausalLM(config).to(torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 1:
                parameter.normal_(1.0, 0.1)
            elif name.endswith("mlp.gate.weight"):
                parameter.normal_(0.0, 0.05 if model_type == "deepseek_v3" else 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
        model.get_output_embeddings().weight.normal_(0.0, 0.1)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model.eval()


@pytest.mark.parametrize("variant", VARIANTS)
def test_deepseek_gives_llama_cpp_the_logits_of_transformers(
    variant: str, tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gguf as gguf_py
    from gguf import GGUFReader

    from lorafit.export import gguf

    folder = tmp_path / "model"
    model_type, extra = VARIANTS[variant]
    model = deepseek_model(folder, tokenizer, model_type, **extra)
    gap = f32_logit_gap(model, tokenizer, folder)
    assert gap(tmp_path / "model-f32.gguf") < 1e-3
    reader = GGUFReader(tmp_path / "model-f32.gguf")
    tensors = {tensor.name for tensor in reader.tensors}
    assert {"blk.0.ffn_gate.weight", "blk.1.ffn_gate_exps.weight", "blk.2.ffn_up_shexp.weight"} <= tensors
    assert ("blk.0.attn_q_a.weight" in tensors) == (variant != "v2-lite")
    assert ("blk.1.exp_probs_b.bias" in tensors) == (variant == "v3")
    if variant == "mistral4":
        assert reader.get_field("mistral4.attention.temperature_length").contents() == 32

    # the comparison can fail: experts stacked in another order (Mistral 4's fused gate_up: its gate and up halves
    # swapped), or (V2-Lite) yarn's attention scale, or (Mistral 4) the query temperature, left out
    plans = gguf.tensor_plans

    def swapped(part: tuple[int, int, int]) -> tuple[int, int, int]:
        start, stop, step = part
        shift = stop - start if start == 0 else start - stop
        return start + shift, stop + shift, step

    def reversed_experts(*args: Any) -> Any:
        return [
            gguf.TensorPlan(**(vars(p) | {"experts": p.experts[::-1], "part": p.part and swapped(p.part)}))
            for p in plans(*args)
        ]

    with monkeypatch.context() as patch:
        patch.setattr(gguf, "tensor_plans", reversed_experts)
        assert gap(tmp_path / "wrong.gguf") > 1e-2
    if variant == "mistral4":  # the query temperature left out
        monkeypatch.setattr(gguf_py.GGUFWriter, "add_attn_temperature_scale", lambda *args: None)
        assert gap(tmp_path / "wrong-temperature.gguf") > 1e-2
    if variant == "v2-lite":
        monkeypatch.setattr(gguf_py.GGUFWriter, "add_rope_scaling_yarn_log_mul", lambda *args: None)
        assert gap(tmp_path / "wrong-yarn.gguf") > 1e-2


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1}, "topk_method"),
        ({"rope_parameters": YARN | {"mscale": 1.0}}, "mscale_all_dim"),
    ],
)
def test_a_router_or_rope_llama_cpp_computes_otherwise_is_one_line(
    change: dict[str, Any], named: str, tmp_path: Path
) -> None:
    from lorafit.export import gguf

    folder = tmp_path / "model"
    folder.mkdir()
    config = {"model_type": "deepseek_v2", "topk_method": "greedy", "rope_parameters": YARN} | change
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match=f"{named}.*export --to merged"):
        gguf.architecture(folder)


@pytest.mark.parametrize("name", ["deepseek-v2-lite", "deepseek-v3", "mistral-small-4-119b"])
def test_a_trained_deepseek_run_exports_to_checked_gguf(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`lorafit train` (LoRA on the latent attention's projections and the experts) on a tiny model, then
    `export --to gguf` f32 and f16: the export's own check loads each file in llama.cpp and compares it with the
    merged model in transformers. Every expert is active (a tiny router's top-2 of 16 flips a choice wherever two
    logits are within rounding, which the check's greedy tokens find; top-k routing is compared above)."""
    from test_mla import tiny_deepseek

    def spec_of(vocab: int) -> Any:
        return tiny_deepseek(name, vocab_size=vocab).scaled(num_experts_per_tok=16)

    run, _ = train_tiny(tmp_path, spec_of, capsys)
    output = tmp_path / "gguf"
    args = ["export", str(run), "--to", "gguf", "-o", str(output), "--quant", "f32", "--quant", "f16", "--json"]
    code, out, err = run_cli(args, capsys)
    assert code == 0, err
    verify = json.loads(out)["verify"]
    for quant in ("f32", "f16"):
        assert verify[quant]["greedy_match"] is True, verify[quant]
        assert verify[quant]["max_abs_logit_diff"] <= verify[quant]["logit_tolerance"]
    assert verify["f32"]["tokenizer_match"] is True
    assert sorted(path.name for path in output.glob("*.gguf")) == ["run-f16.gguf", "run-f32.gguf"]


def test_mistral_small_4_as_the_hub_ships_it(tokenizer: Any, tmp_path: Path) -> None:
    """Mistral Small 4's hub folder is Mistral3ForConditionalGeneration with a mistral4 text_config: its language
    model gives llama.cpp the logits of the same weights as a Mistral4ForCausalLM, the vision tower left out."""
    from gguf import GGUFReader
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    text = deepseek_model(tmp_path / "text", tokenizer, "mistral4", **VARIANTS["mistral4"][1])
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    vision |= {"image_size": 32, "patch_size": 8, "head_dim": 16}
    config = Mistral3Config(text_config=text.config.to_dict(), vision_config=vision, tie_word_embeddings=False)
    model = Mistral3ForConditionalGeneration(config)
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.lm_head.load_state_dict(text.lm_head.state_dict())
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    assert f32_logit_gap(text, tokenizer, folder)(tmp_path / "model-f32.gguf") < 1e-3
    assert GGUFReader(tmp_path / "model-f32.gguf").get_field("general.architecture").contents() == "mistral4"
