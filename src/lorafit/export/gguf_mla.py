"""DeepSeek-style multi-head latent attention (MLA) as llama.cpp's deepseek2 reads it.

llama.cpp computes MLA two ways (src/models/deepseek2.cpp, llama-cpp-python 0.3.36): with the key_length_mla /
value_length_mla keys written, from attn_k_b / attn_v_b (kv_b_proj split, its key half transposed); without them,
from the unsplit attn_kv_b as ordinary multi-head attention whose keys are qk_nope + qk_rope wide and values
v_head_dim wide. lorafit writes the second: the tensors keep the Hugging Face layout (gguf-py's map names them),
and only these hyper-parameters differ from the generic ones. The rope part of each query and key is already in
llama.cpp's interleaved pairs (transformers' deepseek_v2 rotates adjacent pairs as complex numbers), so nothing is
permuted.
"""

from __future__ import annotations

from typing import Any

from lorafit.errors import ExportError


def check(config: dict[str, Any]) -> None:
    """Refuse what llama.cpp's deepseek2 computes otherwise: yarn's rope scale (transformers' attention_factor,
    mscale over mscale_all_dim) is 1 in llama.cpp, which reads mscale_all_dim only (as the released DeepSeek
    checkpoints, whose two are equal, need)."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    mscale, all_dims = rope.get("mscale"), rope.get("mscale_all_dim")
    if (mscale or all_dims) and mscale != all_dims:
        raise ExportError(
            f"llama.cpp's deepseek2 scales yarn rope by mscale_all_dim alone, and this model has mscale {mscale} "
            f"with mscale_all_dim {all_dims}: its GGUF would answer differently; export --to merged"
        )


def write_metadata(writer: Any, config: dict[str, Any], entry: dict[str, Any]) -> None:
    """The deepseek2 keys convert_hf_to_gguf.py's DeepseekV2Model writes, in the non-absorbed layout, and the
    router's: DeepSeek-V2's a softmax whose top-k weights transformers scales by routed_scaling_factor and never
    renormalises (modeling_deepseek_v2.py DeepseekV2Moe.route_tokens_to_experts); DeepSeek-V3's (catalog
    gating = "sigmoid") sigmoid scores, chosen with e_score_correction_bias (ffn_exp_probs_b) within the
    topk_group groups of the best two-expert sums, renormalised as norm_topk_prob says (modeling_deepseek_v3.py
    DeepseekV3TopkRouter; llama.cpp's llama-graph.cpp build_moe_ffn computes the same); Mistral 4's (catalog
    grouped_softmax) softmax scores chosen within groups the same way, renormalised as norm_topk_prob says
    (modeling_mistral4.py Mistral4TopkRouter). Mistral 4's query temperature is llama.cpp's attention.temperature_*
    (llama-graph.cpp llm_graph_input_attn_temp: 1 + scale log(floor(pos / length) + 1))."""
    import gguf

    writer.add_key_length(int(config["qk_nope_head_dim"]) + int(config["qk_rope_head_dim"]))
    writer.add_value_length(int(config["v_head_dim"]))
    writer.add_kv_lora_rank(int(config["kv_lora_rank"]))
    # 0: queries from attn_q (V2-Lite's q_proj); llama.cpp needs the key but for the layer counts of its Lite models
    writer.add_q_lora_rank(int(config.get("q_lora_rank") or 0))
    experts = config.get("n_routed_experts")
    writer.add_leading_dense_block_count(int(config.get("first_k_dense_replace") or 0) if experts else 0)
    writer.add_expert_shared_count(int(config.get("n_shared_experts") or 0))
    if not experts:  # llama.cpp reads the expert width even with no experts
        writer.add_expert_feed_forward_length(int(config["intermediate_size"]))
    writer.add_expert_weights_scale(float(config.get("routed_scaling_factor") or 1.0))
    sigmoid = entry.get("gating") == "sigmoid"
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX)
    if sigmoid or entry.get("grouped_softmax"):
        writer.add_expert_weights_norm(bool(config.get("norm_topk_prob")))
        if int(config.get("n_group") or 1) > 1:
            writer.add_expert_group_count(int(config["n_group"]))
            writer.add_expert_group_used_count(int(config["topk_group"]))
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("mscale_all_dim") is not None:  # yarn's attention scale, in the converter's units (x 0.1)
        writer.add_rope_scaling_yarn_log_mul(0.1 * float(rope["mscale_all_dim"]))
    if rope.get("llama_4_scaling_beta"):  # Mistral 4's queries x (1 + beta log(1 + floor(pos / original context)))
        writer.add_attn_temperature_scale(float(rope["llama_4_scaling_beta"]))
        writer.add_attn_temperature_length(int(rope["original_max_position_embeddings"]))
