"""The analytic estimator, term by term, against arithmetic done by hand in this file.

The tiny model below is small enough to count every tensor on paper. The expected values are written out from
the shapes (hidden 64, intermediate 160, 2 layers, 4 heads of 16, 2 key/value heads, vocabulary 256) and from
what the real modules save for backward (docs/memory-model.md), never from the estimator's own helpers.
The last part checks the properties a user relies on: more tokens or a bigger rank never need less memory,
checkpointing saves memory, QLoRA < LoRA < full, and the verdict follows from the device figure.
"""

from __future__ import annotations

import pytest

from lorafit import hardware, memory, models
from lorafit.memory import GIB, Runtime
from lorafit.schema import Settings

# --- the tiny model, by hand ----------------------------------------------------------------------------------
H, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 64, 160, 2, 4, 2, 16, 256
R = 8
MICRO_BATCH, SEQ = 2, 32  # N = 64 tokens per micro-batch

# The counts used below, by hand:
#   q = 4 heads x 16 = 64, kv = 2 heads x 16 = 32
#   attention linears per layer: q 64x64 + k 64x32 + v 64x32 + o 64x64 = 12288
#   MLP linears per layer: gate, up 64x160 and down 160x64 = 3 x 10240 = 30720
#   linear weights (what NF4 packs): 2 layers x (12288 + 30720) = 86016
#   norms: 2 x 64 per layer; embedding 256 x 64 = 16384, and an untied LM head as large; final norm 64
#   all parameters: 2 x (12288 + 30720 + 128) + 2 x 16384 + 64 = 119104; not quantised: 119104 - 86016 = 33088
#   LoRA at r=8, r x (in + out) per module: q, o 8 x 128 = 1024; k, v 8 x 96 = 768; gate, up, down 8 x 224 = 1792
#   -> all: 2 layers x (1024 + 768 + 768 + 1024 + 3 x 1792) = 2 x 8960 = 17920; q,v: 2 x (1024 + 768) = 3584;
#      attention: 2 x (1024 + 768 + 768 + 1024) = 7168


@pytest.fixture(scope="module")
def tiny() -> models.ModelSpec:
    return models.resolve("llama-2-7b").scaled(
        hidden_size=H,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        vocab_size=VOCAB,
    )


@pytest.fixture(scope="module")
def llama7b() -> models.ModelSpec:
    return models.resolve("llama-2-7b")


def lora(**changes: object) -> Settings:
    """bf16 LoRA, r=8 on every linear, micro-batch 2 x 32 tokens, no checkpointing."""
    values = dict(
        method="lora", quant="none", lora_r=R, lora_alpha=16, micro_batch=MICRO_BATCH, seq_len=SEQ, grad_ckpt=False
    )
    return Settings(**(values | changes))


def full(**changes: object) -> Settings:
    values = dict(method="full", quant="none", micro_batch=MICRO_BATCH, seq_len=SEQ, grad_ckpt=False)
    return Settings(**(values | changes))


# --- parameters -----------------------------------------------------------------------------------------------
def test_tiny_model_counts_match_the_hand_count(tiny: models.ModelSpec) -> None:
    assert tiny.num_params == 119104
    assert tiny.num_hidden_layers * tiny.layer_linear_params == 86016
    assert tiny.lora_params(R, "all") == 17920
    assert tiny.lora_params(R, "qv") == 3584
    assert tiny.lora_params(R, "attn") == 7168
    assert memory.trainable_params(tiny, lora()) == 17920
    assert memory.trainable_params(tiny, full()) == 119104


# --- weights --------------------------------------------------------------------------------------------------
def test_nf4_weights_are_half_a_byte_plus_absmax(tiny: models.ModelSpec) -> None:
    # one absmax per 64 weights: a uint8 plus one fp32 per 256 absmax with double quantisation, else an fp32
    double = 86016 * (0.5 + 1 / 64 + 4 / (64 * 256)) + 33088 * 2
    single = 86016 * (0.5 + 4 / 64) + 33088 * 2
    assert memory.weights_bytes(tiny, lora(method="qlora", quant="nf4"), Runtime()) == pytest.approx(double)
    assert memory.weights_bytes(
        tiny, lora(method="qlora", quant="nf4", double_quant=False), Runtime()
    ) == pytest.approx(single)
    # peft's prepare_model_for_kbit_training upcasts what is not quantised to fp32
    upcast = 86016 * (0.5 + 1 / 64 + 4 / (64 * 256)) + 33088 * 4
    assert memory.weights_bytes(tiny, lora(method="qlora", quant="nf4"), Runtime(kbit_upcast=True)) == pytest.approx(
        upcast
    )


def test_16_bit_weights_are_two_bytes_per_parameter(tiny: models.ModelSpec) -> None:
    assert memory.weights_bytes(tiny, lora(), Runtime()) == 119104 * 2
    assert memory.weights_bytes(tiny, full(precision="fp32"), Runtime()) == 119104 * 4
    assert memory.weights_bytes(tiny, full(), Runtime(amp_master_fp32=True)) == 119104 * 4


def test_a_4_bit_7b_base_takes_3_6_gib(llama7b: models.ModelSpec) -> None:
    # 32 layers x (4 x 4096^2 + 3 x 4096 x 11008) linear weights; embeddings, LM head and norms in bf16
    linear = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)
    rest = 2 * 32000 * 4096 + 32 * 2 * 4096 + 4096
    expected = linear * (0.5 + 1 / 64 + 4 / (64 * 256)) + rest * 2
    settings = Settings(method="qlora", quant="nf4")
    assert memory.weights_bytes(llama7b, settings, Runtime()) == pytest.approx(expected)
    assert expected / GIB == pytest.approx(3.60, abs=0.01)


# --- adapters, gradients, optimizer states -------------------------------------------------------------------
def test_lora_adapters_and_their_gradients_are_fp32(tiny: models.ModelSpec) -> None:
    assert memory.adapter_bytes(tiny, lora(), Runtime()) == 17920 * 4
    assert memory.gradient_bytes(tiny, lora(), Runtime()) == 17920 * 4
    assert memory.adapter_bytes(tiny, lora(), Runtime(lora_dtype="compute")) == 17920 * 2
    assert memory.adapter_bytes(tiny, full(), Runtime()) == 0


def test_full_fine_tuning_gradients_are_in_the_weights_dtype(tiny: models.ModelSpec) -> None:
    assert memory.gradient_bytes(tiny, full(), Runtime()) == 119104 * 2
    assert memory.embedding_grad_bytes(tiny, full(), Runtime()) == 16384 * 2
    assert memory.embedding_grad_bytes(tiny, lora(), Runtime()) == 0


def test_adamw_keeps_two_moments_per_trainable_parameter(tiny: models.ModelSpec) -> None:
    assert memory.optimizer_bytes(tiny, lora(), Runtime()) == 2 * 4 * 17920
    assert memory.optimizer_bytes(tiny, lora(optimizer="paged_adamw_32bit"), Runtime()) == 2 * 4 * 17920
    assert memory.optimizer_bytes(tiny, full(), Runtime()) == 2 * 2 * 119104  # bf16 moments of bf16 weights
    assert memory.optimizer_bytes(tiny, lora(optimizer="sgd"), Runtime()) == 0


def test_bnb_8_bit_states_are_a_byte_plus_blockwise_absmax(tiny: models.ModelSpec) -> None:
    # bitsandbytes keeps 32-bit state for tensors under 4096 elements: at r=8 every adapter of the tiny model
    assert memory.optimizer_bytes(tiny, lora(optimizer="adamw_8bit"), Runtime()) == 2 * 4 * 17920
    # at r=64 only k_proj's and v_proj's B (32 x 64 = 2048 elements) stay small: 2 layers x 2 x 2048
    r64 = 8 * 17920  # LoRA parameters grow linearly with r
    small = 2 * 2 * 32 * 64
    expected = 2 * (r64 - small) * (1 + 4 / 256) + 2 * small * 4  # uint8 per moment + fp32 absmax per 256
    assert memory.optimizer_bytes(tiny, lora(optimizer="adamw_8bit", lora_r=64), Runtime()) == pytest.approx(expected)
    # full fine-tuning: the norm weights (64 elements each, 2 per layer + the final one) stay 32-bit, and so
    # does the input embedding (256 x 64), which transformers' Trainer registers for 32-bit state; the
    # untied LM head is an nn.Linear and gets 8-bit state
    small_full = 2 * 2 * 64 + 64 + 256 * 64
    expected_full = 2 * (119104 - small_full) * (1 + 4 / 256) + 2 * small_full * 4
    assert memory.optimizer_bytes(tiny, full(optimizer="adamw_8bit"), Runtime()) == pytest.approx(expected_full)
    assert memory.optimizer_bytes(tiny, full(optimizer="paged_adamw_8bit"), Runtime()) == pytest.approx(expected_full)


# --- activations, per token -----------------------------------------------------------------------------------
# What one LoRA-wrapped linear saves per token (CUDA, dropout > 0, the HF Trainer's bf16 autocast): lora_A's
# input after autocast's cast of the fp32 dropout output to bf16 (2 x in), dropout's bool mask (1 x in) and
# lora_A's bf16 output that lora_B saves (2 x r).
LORA_H = 64 * (2 + 1) + 8 * 2  # a module reading the hidden state: 208
LORA_INTER = 160 * (2 + 1) + 8 * 2  # down_proj reads the intermediate activation: 496
RMSNORM = 4 * 64 + 4  # the fp32 upcast of the input and the fp32 rsqrt: 260
SDPA = 2 * 64 + 2 * 32 + 2 * 32 + 2 * 64 + 4 * 4  # q, k, v, output (bf16) and the fp32 logsumexp per head: 400
SWIGLU = 3 * 2 * 160  # silu's input (gate), silu(gate) and up, all bf16: 960


def test_lora_layer_saves_what_the_modules_keep(tiny: models.ModelSpec) -> None:
    parts = memory.activation_parts_per_token(tiny, lora(), Runtime())
    assert parts == pytest.approx(
        {
            "attn_norm": RMSNORM,
            "qkv_inputs": 3 * LORA_H,  # q, k and v each cast and drop out their own copy of the input
            "attention": SDPA,
            "o_proj_input": LORA_H,  # o_proj reads q_size = 64 features
            "mlp_norm": RMSNORM,
            "mlp_inputs": 2 * LORA_H,  # gate and up
            "gated_act": SWIGLU,
            "down_input": LORA_INTER,
        }
    )
    assert sum(parts.values()) == pytest.approx(260 + 3 * 208 + 400 + 208 + 260 + 2 * 208 + 960 + 496)  # = 3624


def test_gemma3_layer_adds_its_post_norms_and_qk_norms(tiny: models.ModelSpec) -> None:
    """Gemma 3's text layer: the Llama layer above plus two post-norms (attention and MLP outputs, 260 bytes each,
    as the other norms) and the RMSNorm of every query and key head: the fp32 copy of q (4 x 64) and k (4 x 32)
    and one fp32 rsqrt per head (4 x (4 + 2)): 408 bytes a token. Its MLP is GeGLU, the same three tensors."""
    gemma3 = models.resolve("gemma-3-1b").scaled(**tiny.model_dump(include=set(SHAPE_FIELDS)))
    parts = memory.activation_parts_per_token(gemma3, lora(), Runtime())
    llama = memory.activation_parts_per_token(tiny, lora(), Runtime())
    assert parts == pytest.approx(llama | {"post_norms": 2 * RMSNORM, "qk_norms": 4 * 64 + 4 * 32 + 4 * (4 + 2)})
    # full fine-tuning: each q/k norm also keeps its bf16 normalised input for the weight's gradient (2 x 96)
    full = memory.activation_parts_per_token(gemma3, lora(method="full"), Runtime())
    assert full["qk_norms"] == pytest.approx(408 + 2 * 96)
    # Gemma-2 (soft-capped, four norms) has no q/k norms; Llama neither
    gemma2 = models.resolve("gemma-2-2b").scaled(**tiny.model_dump(include=set(SHAPE_FIELDS)))
    assert "qk_norms" not in memory.activation_parts_per_token(gemma2, lora(attn="eager"), Runtime())
    assert "qk_norms" not in llama


SHAPE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
)


def test_first_lora_layer_saves_no_mask_and_no_norm(tiny: models.ModelSpec) -> None:
    # the frozen embedding's output needs no gradient: the first norm saves nothing, dropout keeps no mask
    parts = memory.activation_parts_per_token(tiny, lora(), Runtime(), input_requires_grad=False)
    assert parts["attn_norm"] == 0
    assert parts["qkv_inputs"] == pytest.approx(3 * (64 * 2 + 8 * 2))
    # after the first LoRA output everything needs a gradient again
    assert parts["o_proj_input"] == pytest.approx(LORA_H)
    # a whole layer: 260 + 3 x 208 + 400 + 208 + 260 + 2 x 208 + 960 + 496 = 3624
    assert sum(parts.values()) == pytest.approx(3624 - 260 - 3 * LORA_H + 3 * 144)  # = 3172


def test_lora_module_saved_bytes_by_device_dropout_and_dtype() -> None:
    settings = lora()
    # under autocast (the HF Trainer's bf16): lora_A saves the bf16 cast of dropout's fp32 output, plus the mask
    assert memory.lora_module_saved_bytes(64, settings, Runtime()) == 64 * (2 + 1) + 8 * 2
    # without autocast lora_A saves the fp32 dropout output itself
    assert memory.lora_module_saved_bytes(64, settings, Runtime(autocast=False)) == 64 * 5 + 8 * 4
    # the CPU dropout kernel keeps its mask in the input dtype (fp32 here), not as bool
    assert memory.lora_module_saved_bytes(64, settings, Runtime(device="cpu")) == 64 * (2 + 4) + 8 * 2
    assert memory.lora_module_saved_bytes(64, settings, Runtime(device="cpu", autocast=False)) == 64 * 8 + 8 * 4
    # no dropout, no mask
    assert memory.lora_module_saved_bytes(64, lora(lora_dropout=0.0), Runtime()) == 64 * 2 + 8 * 2
    assert memory.lora_module_saved_bytes(64, lora(lora_dropout=0.0), Runtime(autocast=False)) == 64 * 4 + 8 * 4
    # adapters kept in bf16: the input is not upcast, the mask is bool
    assert memory.lora_module_saved_bytes(64, settings, Runtime(lora_dtype="compute")) == 64 * (2 + 1) + 8 * 2


def test_eager_attention_saves_scores_of_every_head(tiny: models.ModelSpec) -> None:
    parts = memory.activation_parts_per_token(tiny, lora(attn="eager"), Runtime())
    # q and k repeated to 4 heads for QK^T, the fp32 softmax (4 heads x 32 keys), its bf16 cast, repeated v
    assert parts["attention"] == pytest.approx(2 * 64 + 2 * 64 + (4 + 2) * 4 * 32 + 2 * 64)


def test_full_fine_tuning_layer_saves_linear_inputs_once(tiny: models.ModelSpec) -> None:
    parts = memory.activation_parts_per_token(tiny, full(), Runtime())
    assert parts == pytest.approx(
        {
            "attn_norm": 4 * 64 + 4 + 2 * 64,  # the trainable norm weight also needs the normalised bf16 input
            "qkv_inputs": 2 * 64,  # q, k, v share one saved bf16 input
            "attention": 400,
            "o_proj_input": 0,  # a view of the attention output sdpa already saved
            "mlp_norm": 4 * 64 + 4 + 2 * 64,
            "mlp_inputs": 2 * 64,  # gate and up share one input
            "gated_act": 960,
            "down_input": 2 * 160,
        }
    )
    eager = memory.activation_parts_per_token(tiny, full(attn="eager"), Runtime())
    assert eager["o_proj_input"] == 2 * 64  # eager's transpose().contiguous() is a new tensor


def test_qlora_saves_the_same_activations_as_lora(tiny: models.ModelSpec) -> None:
    # bitsandbytes' MatMul4Bit saves only the packed weight for backward, like a frozen nn.Linear
    qlora = lora(method="qlora", quant="nf4")
    assert memory.activation_parts_per_token(tiny, qlora, Runtime()) == memory.activation_parts_per_token(
        tiny, lora(), Runtime()
    )


def test_all_layers_activations(tiny: models.ModelSpec) -> None:
    assert memory.activation_bytes(tiny, lora(), Runtime()) == pytest.approx((3172 + 3624) * 64)
    # checkpointing keeps each layer's bf16 input only
    assert memory.activation_bytes(tiny, lora(grad_ckpt=True), Runtime()) == 2 * (2 * 64) * 64
    # full fine-tuning: the embedding is trainable, so the first layer saves as much as the others
    assert memory.activation_bytes(tiny, full(), Runtime()) == pytest.approx(2 * 2712 * 64)
    # the final norm: fp32 input + rsqrt; training the head adds the bf16 normalised input twice
    assert memory.head_saved_bytes(tiny, lora(), memory.Runtime()) == (4 * 64 + 4) * 64
    assert memory.head_saved_bytes(tiny, full(), memory.Runtime()) == (4 * 64 + 4 + 2 * 2 * 64) * 64


def test_logits_and_loss_are_12_bytes_per_vocabulary_entry_and_token(tiny: models.ModelSpec) -> None:
    # HF's loss: saved fp32 log-softmax, the gradient nll_loss returns and the one log-softmax returns
    assert memory.logits_bytes(tiny, lora(), Runtime()) == 12 * 256 * 64


def test_dequantised_weight_is_the_largest_linear_in_bf16(tiny: models.ModelSpec) -> None:
    assert memory.dequant_bytes(tiny, lora(method="qlora", quant="nf4")) == 64 * 160 * 2
    assert memory.dequant_bytes(tiny, lora()) == 0


# --- litgpt's step (bench/litgpt_trace.py traces the real one) --------------------------------------------------
# litgpt 0.4 (the LGC rows): bf16 adapters, no autocast, its fused qkv with one LoRA, its loop holding the last
# micro-batch's logits and loss, a separate head; with QLoRA, bitsandbytes 0.42 under Lightning
LITGPT = Runtime(
    loss="chunked_compute",
    lora_dtype="compute",
    autocast=False,
    fused_optimizer=False,
    untied_head=True,
    fused_qkv=True,
    keeps_previous_step=True,
)
LITGPT_QLORA = LITGPT.model_copy(update=dict(bnb_saves_input=True, quantized_head=True, dequant_copies=2))


def test_litgpt_fused_qkv_has_one_dropout_and_keeps_the_padded_adapter_output(tiny: models.ModelSpec) -> None:
    qv = memory.activation_parts_per_token(tiny, lora(lora_targets="qv"), LITGPT)
    # one bf16 dropout output + bool mask of the 64 inputs, lora_A's 2 x 8 outputs (q and v), and the q (64) +
    # v (32) adapter columns zero_pad's index_copy_ keeps
    assert qv["qkv_inputs"] == 64 * (2 + 1) + 16 * 2 + (64 + 32) * 2  # 416
    # q, k and v all adapted: no padding
    attn = memory.activation_parts_per_token(tiny, lora(lora_targets="attn"), LITGPT)
    assert attn["qkv_inputs"] == 64 * 3 + 24 * 2  # 240


def test_litgpt_attention_repeats_k_and_v_and_without_groups_keeps_the_fused_output(tiny: models.ModelSpec) -> None:
    # 2 kv heads for 4: k and v repeated to 4 heads and copied; q, k, v, output in bf16 and the fp32 logsumexp
    grouped = memory.activation_parts_per_token(tiny, lora(lora_targets="qv"), LITGPT)
    assert grouped["attention"] == 2 * 64 + 2 * 64 + 2 * 64 + 2 * 64 + 4 * 4  # 528
    # 4 kv heads: v is a view of the fused qkv output (64 + 2 x 64 columns), which stays alive whole
    mha = tiny.scaled(num_key_value_heads=4)
    ungrouped = memory.activation_parts_per_token(mha, lora(lora_targets="qv"), LITGPT)
    assert ungrouped["attention"] == 2 * 64 + 2 * 64 + 2 * (64 + 128) + 2 * 64 + 4 * 4  # 784


def test_old_bitsandbytes_holds_every_layer_input_until_the_graph_goes(tiny: models.ModelSpec) -> None:
    qlora = lora(method="qlora", quant="nf4", double_quant=False)
    # per layer: the q/k/v input (64), o_proj's (64), gate/up's (64) and down's (160), bf16
    assert memory.activation_parts_per_token(tiny, qlora, LITGPT_QLORA)["bnb_inputs"] == 2 * (64 + 64 + 64 + 160)
    # the first layer's q/k/v input needs no gradient and is not kept; the quantised head keeps its 64 inputs
    assert memory.bnb_held_bytes(tiny, qlora, LITGPT_QLORA) == (576 + 704 + 2 * 64) * 64  # 90112
    assert memory.bnb_held_bytes(tiny, qlora, LITGPT) == 0  # bitsandbytes from 0.43.2 keeps only the weight
    # the loop keeps the last micro-batch's bf16 logits (256 x 64 tokens) and that graph until the next forward
    assert memory.previous_step_bytes(tiny, qlora, LITGPT_QLORA) == 2 * 256 * 64 + 90112
    assert memory.previous_step_bytes(tiny, qlora, Runtime(bnb_saves_input=True)) == 0


def test_litgpt_keeps_its_own_head_and_lightning_quantises_it(tiny: models.ModelSpec) -> None:
    tied = tiny.scaled(tie_word_embeddings=True)  # 119104 - 16384 = 102720 parameters
    assert memory.weights_bytes(tied, lora(), LITGPT) == (102720 + 16384) * 2
    assert memory.weights_bytes(tiny, lora(), LITGPT) == 119104 * 2  # untied already
    # nf4 without double quantisation for the 86016 linear weights and the 16384 of the head; the embedding
    # and the norms (16384 + 320) in bf16: the same for a tied and an untied checkpoint
    qlora = lora(method="qlora", quant="nf4", double_quant=False)
    expected = (86016 + 16384) * (0.5 + 4 / 64) + (16384 + 320) * 2  # 91008
    assert memory.weights_bytes(tied, qlora, LITGPT_QLORA) == pytest.approx(expected)
    assert memory.weights_bytes(tiny, qlora, LITGPT_QLORA) == pytest.approx(expected)


def test_litgpt_chunked_head_and_loss_in_bf16(tiny: models.ModelSpec) -> None:
    one_chunk = dict(micro_batch=1, seq_len=64)  # 64 tokens, one 64-position chunk of the 128-position head
    lora_settings, qlora = lora(**one_chunk), lora(method="qlora", quant="nf4", **one_chunk)
    # loss: the bf16 logits and log-softmax of every token (2 x 2 x 256 x 64), one chunk's gradient and its
    # log-softmax gradient (2 x 256 x 64 each), or instead of the latter the head's dequantised fp16 + bf16 copies
    assert memory.logits_bytes(tiny, lora_settings, LITGPT) == 65536 + 32768 + 32768
    assert memory.logits_bytes(tiny, qlora, LITGPT_QLORA) == 65536 + 32768 + 2 * 2 * 256 * 64
    # the head's forward: the chunk's logits, or its dequantised copies while it runs
    assert memory.head_forward_bytes(tiny, lora_settings, LITGPT) == 2 * 256 * 64
    assert memory.head_forward_bytes(tiny, qlora, LITGPT_QLORA) == 2 * 2 * 256 * 64
    # 512 tokens in 4 chunks: the first three chunks' logits, then the last one's dequantisation or output
    long = lora(method="qlora", quant="nf4", micro_batch=1, seq_len=512)
    assert memory.head_forward_bytes(tiny, long, LITGPT_QLORA) == 2 * 256 * 384 + max(65536, 32768 + 2 * 256 * 128)


def test_litgpt_qlora_peaks_in_the_head_forward_with_the_previous_micro_batch(tiny: models.ModelSpec) -> None:
    qlora = lora(
        method="qlora", quant="nf4", double_quant=False, lora_targets="qv", grad_accum=4, optimizer="paged_adamw_32bit"
    )
    parts, phase = memory.breakdown(tiny, qlora, LITGPT_QLORA)
    assert phase == "forward through the LM head"
    assert parts["previous_micro_batch"] == memory.previous_step_bytes(tiny, qlora, LITGPT_QLORA)
    assert parts["logits_and_loss"] == memory.head_forward_bytes(tiny, qlora, LITGPT_QLORA)
    assert parts["optimizer_states"] == 0  # paged
    # without the loop holding the last micro-batch the same step peaks at the loss
    _, phase = memory.breakdown(tiny, qlora, LITGPT_QLORA.model_copy(update={"keeps_previous_step": False}))
    assert phase == "loss (LM head backward)"


# --- the peak, summed ------------------------------------------------------------------------------------------
def test_checkpointed_lora_peak_is_in_the_first_layers_backward(tiny: models.ModelSpec) -> None:
    settings = lora(grad_ckpt=True)
    weights, adapters, grads, states = 119104 * 2, 17920 * 4, 17920 * 4, 2 * 4 * 17920
    activations = (2 * 2 * 64 + 260) * 64  # two checkpointed layer inputs + the final norm
    # a recomputed layer (3624 per token) + what recomputation and backward hold in flight, 5c x I + 4c x h
    # (10 x 160 + 8 x 64 = 2112)
    layer_backward = (3624 + 2112) * 64
    loss = 12 * 256 * 64
    static = weights + adapters + states
    # at the first layer every adapter gradient is alive and the checkpoints above are freed; at the last layer
    # no gradient exists yet but every checkpoint does; the loss needs less than either
    first, last = static + grads + layer_backward, static + activations + layer_backward
    assert first > last > static + activations + loss
    parts, phase = memory.breakdown(tiny, settings)
    assert phase == "backward through the first layer"
    assert parts["weights"] == weights
    assert parts["lora_adapters"] == adapters
    assert parts["gradients"] == grads
    assert parts["optimizer_states"] == states
    assert parts["activations"] == 0
    assert parts["layer_backward"] == pytest.approx(layer_backward)
    assert parts["logits_and_loss"] == 0
    assert sum(parts.values()) == pytest.approx(first)


def test_large_vocabulary_puts_the_peak_at_the_loss(tiny: models.ModelSpec) -> None:
    wide = tiny.scaled(vocab_size=32000)
    weights = (2 * (12288 + 30720 + 128) + 2 * 32000 * 64 + 64) * 2
    static = weights + 17920 * 4 + 2 * 4 * 17920
    activations = (3172 + 3624 + 260) * 64
    parts, phase = memory.breakdown(wide, lora())
    assert phase == "loss (LM head backward)"
    assert parts["logits_and_loss"] == 12 * 32000 * 64
    assert parts["gradients"] == 0  # the first micro-batch of a step has no gradients yet
    assert sum(parts.values()) == pytest.approx(static + activations + 12 * 32000 * 64)
    # from the second micro-batch of an accumulation on, the gradients are alive in the forward pass too
    accumulated, _ = memory.breakdown(wide, lora(grad_accum=2))
    assert sum(accumulated.values()) - sum(parts.values()) == pytest.approx(17920 * 4)


def test_short_full_fine_tune_peaks_at_the_optimizer_step_without_activations(tiny: models.ModelSpec) -> None:
    settings = full(micro_batch=1, seq_len=4, grad_ckpt=True)
    # backward needs the gradients less the embedding's (2 x 16384 bytes, produced last) plus activations
    # ((2 x 128 + 516) x 4 tokens) and a recomputed layer with its buffers ((2712 + 3 x 2 x 64 + 2 x 160) x 4):
    # 3088 + 13664 < 32768, so the step itself, with every gradient and no activation, is the peak
    assert (2 * 128 + 516) * 4 + (2712 + 704) * 4 < 16384 * 2
    parts, phase = memory.breakdown(tiny, settings)
    assert phase == "optimizer step"
    assert parts["activations"] == 0 and parts["layer_backward"] == 0
    assert sum(parts.values()) == 119104 * (2 + 2 + 2 * 2)  # bf16 weights, gradients and two moments


def test_breakdown_adds_up_to_the_allocated_peak(llama7b: models.ModelSpec) -> None:
    result = memory.estimate(llama7b, Settings(method="qlora", quant="nf4", micro_batch=4))
    device_side = {"allocator_reserve", "cuda_context", "paged_optimizer_states"}
    allocated = sum(gib for name, gib in result.breakdown_gib.items() if name not in device_side)
    assert allocated == pytest.approx(result.peak_allocated_gib, abs=1e-3)
    assert result.peak_allocated_gib <= result.peak_reserved_gib <= result.peak_device_gib
    assert result.trainable_params == llama7b.lora_params(16, "all")
    assert result.total_params == llama7b.num_params


# --- properties a user relies on ------------------------------------------------------------------------------
def peak_bytes(spec: models.ModelSpec, settings: Settings) -> float:
    parts, _ = memory.breakdown(spec, settings)
    return sum(parts.values())


@pytest.mark.parametrize("method", ["qlora", "lora", "full"])
@pytest.mark.parametrize("grad_ckpt", [True, False])
def test_more_tokens_never_need_less_memory(llama7b: models.ModelSpec, method: str, grad_ckpt: bool) -> None:
    quant = "nf4" if method == "qlora" else "none"
    by_batch = [
        peak_bytes(llama7b, Settings(method=method, quant=quant, micro_batch=b, seq_len=512, grad_ckpt=grad_ckpt))
        for b in (1, 2, 4, 8, 16)
    ]
    by_length = [
        peak_bytes(llama7b, Settings(method=method, quant=quant, seq_len=s, grad_ckpt=grad_ckpt))
        for s in (128, 256, 512, 1024, 2048, 4096)
    ]
    # non-decreasing (a short full fine-tune peaks at the optimizer step, whatever the length), and growing
    assert by_batch == sorted(by_batch) and by_batch[-1] > by_batch[0]
    assert by_length == sorted(by_length) and by_length[-1] > by_length[0]


def test_a_bigger_lora_rank_needs_more_memory(llama7b: models.ModelSpec) -> None:
    for targets in ("all", "attn", "qv"):
        peaks = [
            peak_bytes(llama7b, Settings(lora_r=r, lora_alpha=2 * r, lora_targets=targets)) for r in (4, 8, 16, 64, 256)
        ]
        assert peaks == sorted(peaks) and len(set(peaks)) == len(peaks)
    assert peak_bytes(llama7b, Settings(lora_targets="qv")) < peak_bytes(llama7b, Settings(lora_targets="all"))


@pytest.mark.parametrize("method", ["qlora", "lora", "full"])
def test_checkpointing_lowers_activations_and_the_peak(llama7b: models.ModelSpec, method: str) -> None:
    quant = "nf4" if method == "qlora" else "none"
    on = memory.estimate(llama7b, Settings(method=method, quant=quant, grad_ckpt=True))
    off = memory.estimate(llama7b, Settings(method=method, quant=quant, grad_ckpt=False))
    assert on.breakdown_gib.get("activations", 0) < off.breakdown_gib["activations"] or method == "full"
    if method == "full":
        # a 7B full fine-tune peaks where every gradient and both Adam moments are alive (first layer's backward
        # or the optimizer step), which checkpointing does not change: it can only not make the peak higher
        assert on.peak_device_gib <= off.peak_device_gib
        assert memory.activation_bytes(
            llama7b, on_settings := Settings(method="full", quant="none", grad_ckpt=True), Runtime()
        ) < memory.activation_bytes(llama7b, on_settings.model_copy(update={"grad_ckpt": False}), Runtime())
    else:
        assert on.peak_device_gib < off.peak_device_gib


def test_qlora_needs_less_than_lora_which_needs_less_than_full(llama7b: models.ModelSpec) -> None:
    qlora = memory.estimate(llama7b, Settings(method="qlora", quant="nf4"))
    lora_ = memory.estimate(llama7b, Settings(method="lora", quant="none"))
    full_ = memory.estimate(llama7b, Settings(method="full", quant="none"))
    assert qlora.peak_device_gib < lora_.peak_device_gib < full_.peak_device_gib
    assert qlora.breakdown_gib["weights"] < lora_.breakdown_gib["weights"] == full_.breakdown_gib["weights"]


def test_paged_optimizer_state_counts_on_the_device_but_not_as_allocated(tiny: models.ModelSpec) -> None:
    plain = memory.estimate(tiny, full(optimizer="adamw_8bit"))
    paged = memory.estimate(tiny, full(optimizer="paged_adamw_8bit"))
    small = 2 * 2 * 64 + 64 + 256 * 64  # norms and the embedding keep 32-bit state
    state_gib = (2 * (119104 - small) * (1 + 4 / 256) + 2 * small * 4) / GIB
    assert "optimizer_states" not in paged.breakdown_gib
    assert paged.breakdown_gib["paged_optimizer_states"] == pytest.approx(state_gib, abs=1e-4)
    assert plain.breakdown_gib["optimizer_states"] == pytest.approx(state_gib, abs=1e-4)
    assert paged.peak_allocated_gib < plain.peak_allocated_gib
    # on top of reserved memory the device figure carries the managed memory of the paged state
    extra_paged = paged.peak_device_gib - paged.peak_reserved_gib
    extra_plain = plain.peak_device_gib - plain.peak_reserved_gib
    assert extra_paged - extra_plain == pytest.approx(state_gib, abs=2e-4)


@pytest.mark.parametrize("headroom", [0.0, 0.1, 0.3])
def test_fits_follows_from_the_device_peak_and_the_headroom(llama7b: models.ModelSpec, headroom: float) -> None:
    settings = Settings(micro_batch=2)
    device_gib = memory.estimate(llama7b, settings).peak_device_gib
    card = hardware.resolve("RTX 4090")
    for margin, expected in ((1.001, True), (0.999, False)):
        gpu = card.model_copy(update={"memory_gib": device_gib * margin / (1 - headroom)})
        result = memory.estimate(llama7b, settings, gpu, headroom)
        assert result.fits is expected
        assert result.peak_device_gib == device_gib  # the card does not change the estimate
        assert result.gpu_memory_gib == pytest.approx(gpu.memory_gib)
    assert memory.estimate(llama7b, settings).fits is None  # no GPU: no verdict


def test_fits_uses_the_share_of_unified_memory_a_mac_can_wire(llama7b: models.ModelSpec) -> None:
    settings = Settings(micro_batch=2)
    device_gib = memory.estimate(llama7b, settings).peak_device_gib
    mac = next(gpu for gpu in hardware.catalog().values() if gpu.kind == "apple")
    usable = mac.usable_fraction
    assert usable < 1
    just_enough = mac.model_copy(update={"memory_gib": device_gib * 1.001 / usable / 0.9})
    too_little = mac.model_copy(update={"memory_gib": device_gib * 0.999 / usable / 0.9})
    assert memory.estimate(llama7b, settings, just_enough).fits is True
    assert memory.estimate(llama7b, settings, too_little).fits is False


def test_zero3_divides_weights_gradients_and_states_by_the_gpu_count(llama7b: models.ModelSpec) -> None:
    # grad_accum 2: the gradients of the first micro-batch are alive at the loss, where a 7B full run peaks
    one = Settings(method="full", quant="none", grad_accum=2)
    one_parts, one_phase = memory.breakdown(llama7b, one)
    for n_gpus in (2, 4, 8):
        parts, phase = memory.breakdown(llama7b, one.model_copy(update={"n_gpus": n_gpus, "shard": "zero3"}))
        assert phase == one_phase == "loss (LM head backward)"
        for name in ("weights", "gradients"):
            assert parts[name] == pytest.approx(one_parts[name] / n_gpus)
        # DeepSpeed steps an fp32 master partition with fp32 moments: 4 + 2 x 4 bytes a parameter, where the
        # bf16 run on one GPU keeps two bf16 moments
        assert one_parts["optimizer_states"] == pytest.approx(2 * 2 * llama7b.num_params)
        assert parts["optimizer_states"] == pytest.approx(12 * llama7b.num_params / n_gpus)
        assert parts["activations"] == one_parts["activations"]  # data parallel: every GPU runs its micro-batch
        assert parts["sharded_gather"] > 0
        zero2, _ = memory.breakdown(llama7b, one.model_copy(update={"n_gpus": n_gpus, "shard": "zero2"}))
        assert zero2["weights"] == one_parts["weights"]
        assert zero2["gradients"] == pytest.approx(one_parts["gradients"] / n_gpus)
        assert zero2["optimizer_states"] == pytest.approx(12 * llama7b.num_params / n_gpus)
        ddp, _ = memory.breakdown(llama7b, one.model_copy(update={"n_gpus": n_gpus, "shard": "ddp"}))
        assert ddp["weights"] == one_parts["weights"] and ddp["optimizer_states"] == one_parts["optimizer_states"]


def test_zero3_gathers_two_layers_of_weights(llama7b: models.ModelSpec) -> None:
    # the current layer and the prefetched next one, in bf16: 2 x (4 x 4096^2 + 3 x 4096 x 11008 + 2 x 4096) x 2
    settings = Settings(method="full", quant="none", n_gpus=4, shard="zero3")
    layer = 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096
    assert memory.gathered_layer_bytes(llama7b, settings, Runtime()) == 2 * layer * 2


# --- memory savers ----------------------------------------------------------------------------------------------
# By hand for the tiny model (h 64, V 256, c 2 for bf16), at micro-batch 2 x 1024 tokens: N = 2048, so lorafit's
# chunked loss runs two chunks of 1024 tokens.
LONG = {"micro_batch": 2, "seq_len": 1024}


def test_chunked_loss_keeps_one_chunk_of_fp32_logits_and_the_hidden_state_gradient(tiny: models.ModelSpec) -> None:
    full_loss = memory.logits_bytes(tiny, lora(**LONG), Runtime())
    chunked = memory.logits_bytes(tiny, lora(**LONG, loss="chunked"), Runtime())
    assert full_loss == 12 * 256 * 2048  # every token's fp32 logits, their gradient and the one they produce
    # one chunk's 12 x V bytes per token, plus the bf16 gradient of the final hidden states of all N tokens
    assert chunked == 12 * 256 * 512 + 2 * 64 * 2048 == 1_835_008
    # a micro-batch shorter than a chunk is one chunk of its own length
    assert memory.logits_bytes(tiny, lora(loss="chunked"), Runtime()) == 12 * 256 * 64 + 2 * 64 * 64


def test_offloaded_embeddings_leave_the_gpu_weights(tiny: models.ModelSpec) -> None:
    qlora = {"method": "qlora", "quant": "nf4"}
    for base in ({}, qlora):
        kept = memory.weights_bytes(tiny, lora(**base), Runtime())
        moved = memory.weights_bytes(tiny, lora(**base, offload_embeddings=True), Runtime())
        assert kept - moved == 256 * 64 * 2  # the bf16 V x h input embedding; the untied head stays
    # peft's kbit upcast made the embedding fp32 first
    upcast = Runtime(kbit_upcast=True)
    assert (
        memory.weights_bytes(tiny, lora(**qlora), upcast)
        - memory.weights_bytes(tiny, lora(**qlora, offload_embeddings=True), upcast)
        == 256 * 64 * 4
    )


def test_offloaded_embeddings_do_nothing_when_they_are_the_head(tiny: models.ModelSpec) -> None:
    tied = tiny.model_copy(update={"tie_word_embeddings": True})
    assert memory.offloaded_embedding_bytes(tied, lora(offload_embeddings=True), Runtime()) == 0
    assert memory.weights_bytes(tied, lora(offload_embeddings=True), Runtime()) == memory.weights_bytes(
        tied, lora(), Runtime()
    )


def test_offloaded_activations_keep_two_checkpointed_inputs_on_the_gpu(tiny: models.ModelSpec) -> None:
    deep = tiny.scaled(num_hidden_layers=6)
    ckpt = lora(grad_ckpt=True)
    # N = 64 tokens; a checkpointed layer keeps its bf16 input: 2 x 64 x 64 = 8192 bytes
    assert memory.activation_bytes(deep, ckpt, Runtime()) == 6 * 8192
    offloaded = ckpt.model_copy(update={"offload_activations": True})
    assert memory.activation_bytes(deep, offloaded, Runtime()) == 2 * 8192
    assert memory.offloaded_activation_bytes(deep, offloaded) == 6 * 8192  # all of them in pinned host memory
    assert memory.offloaded_activation_bytes(deep, ckpt) == 0


def test_expandable_segments_shrink_only_the_reserve(llama7b: models.ModelSpec) -> None:
    step = Settings(micro_batch=1, grad_ckpt=True)
    plain = memory.estimate(llama7b, step)
    expandable = memory.estimate(llama7b, step.model_copy(update={"expandable_segments": True}))
    assert expandable.peak_allocated_gib == plain.peak_allocated_gib
    # the two fits of bench/allocator_fit.py: 0.27 x T + 0.0125 x A + 0.60 GiB against 0.20 x T + 0.013 x A,
    # and the 0.54 GiB a run strands beyond the simulated step, none with expandable segments
    transient = memory.transient_bytes(llama7b, step, Runtime()) / GIB
    shrink = (0.27 - 0.20) * transient + (0.0125 - 0.013) * plain.peak_allocated_gib + 0.60 + 0.54
    assert plain.peak_reserved_gib - expandable.peak_reserved_gib == pytest.approx(shrink, abs=1e-3)


def test_savers_together_bring_an_8b_qlora_step_down_by_a_third() -> None:
    spec = models.resolve("llama-3.1-8b")
    step = Settings(method="qlora", micro_batch=1, seq_len=2048, grad_ckpt=True, optimizer="paged_adamw_8bit")
    every = step.model_copy(
        update={"loss": "chunked", "offload_embeddings": True, "offload_activations": True, "expandable_segments": True}
    )
    plain, saved = memory.estimate(spec, step), memory.estimate(spec, every)
    # by hand: the input embedding 128256 x 4096 x 2 bytes = 0.98 GiB leaves the weights
    assert plain.breakdown_gib["weights"] - saved.breakdown_gib["weights"] == pytest.approx(
        128256 * 4096 * 2 / GIB, abs=1e-3
    )
    # the loss: 12 x V x 2048 tokens (2.94 GiB) becomes one 512-token chunk plus the hidden-state gradient
    assert memory.logits_bytes(spec, every, Runtime()) == 12 * 128256 * 512 + 2 * 4096 * 2048
    assert saved.peak_device_gib < plain.peak_device_gib * 2 / 3
