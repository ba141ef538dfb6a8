"""The GGUF writer against llama.cpp itself: every supported family, tied embeddings, rope scaling, byte-level
and SentencePiece vocabularies, the pre-tokenizer identified by behaviour, q8_0 and the K-quants."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lorafit.errors import ExportError

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")
pytest.importorskip("llama_cpp", reason="llama-cpp-python is the [gguf] extra")

TEXT = "Which animal lives on Duvik? ¿Dónde está la estación? Não sei, señor. The lighthouse is black. " * 3
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama-3-rope": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 500000.0,
            }
        },
    ),
    "llama-linear-rope": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
    "mistral": ("mistral", {}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {}),
    "gemma": ("gemma", {"tie_word_embeddings": True}),
    # Gemma 3 1B's text-only model: the real models' query scale (1/sqrt(head_dim)), a window narrower than TEXT
    "gemma3-text": (
        "gemma3_text",
        {"query_pre_attn_scalar": 64, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
    ),
    "phi": ("phi3", {"pad_token_id": None}),
}


def tiny_model(folder: Path, tokenizer: Any, model_type: str, hidden: int = 256, **extra: Any) -> Any:
    """A random model of `model_type`, rows of 256 (whole K-quant blocks), norms away from 1 so that a norm
    written wrong shows in the logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        vocab_size=len(tokenizer),
        max_position_embeddings=512,
        **extra,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for parameter in model.parameters():
        if parameter.dim() == 1:
            torch.nn.init.normal_(parameter, 0.0 if model_type == "gemma" else 1.0, 0.1)
    torch.nn.init.normal_(model.get_output_embeddings().weight, std=0.1)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    model.eval()
    return model


def llama_cpp_logits(path: Path, ids: list[int]) -> Any:
    from lorafit.export import verify

    with verify.llama(path, 512) as runtime:
        return verify._llama_logits(runtime, ids)


def hf_logits(model: Any, ids: list[int]) -> Any:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def f32_logit_gap(model: Any, tokenizer: Any, folder: Path) -> Callable[[Path], float]:
    """The check of `folder` against transformers' `model` on TEXT: a function that writes `folder` as an f32 GGUF
    at the path it is given (through whatever export code is patched in by then) and returns llama.cpp's largest
    logit difference as a fraction of transformers' largest logit."""
    from lorafit.export import gguf

    ids = tokenizer(TEXT)["input_ids"]
    reference = hf_logits(model, ids)

    def gap(path: Path) -> float:
        gguf.write_gguf(folder, path, "f32")
        return float(np.abs(llama_cpp_logits(path, ids) - reference).max() / np.abs(reference).max())

    return gap


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_gives_llama_cpp_the_logits_of_transformers(family: str, tokenizer: Any, tmp_path: Path) -> None:
    from lorafit.export import gguf, verify

    model_type, extra = FAMILIES[family]
    folder = tmp_path / "model"
    model = tiny_model(folder, tokenizer, model_type, **extra)
    written = gguf.write_gguf(folder, tmp_path / "model-f32.gguf", "f32")
    ids = tokenizer(TEXT)["input_ids"]
    reference = hf_logits(model, ids)
    ours = llama_cpp_logits(written.path, ids)
    assert np.abs(ours - reference).max() < 1e-3 * np.abs(reference).max()
    with verify.llama(written.path, 512) as runtime:
        assert verify.tokenizer_matches(runtime, tokenizer, written.vocabulary)
        assert verify.template_matches(runtime, tokenizer, written.vocabulary)


def test_a_missing_rotary_permutation_would_be_caught(
    tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The comparison above can fail: a Llama written without the q/k permutation gives other logits."""
    from lorafit.export import gguf

    folder = tmp_path / "model"
    model = tiny_model(folder, tokenizer, "llama")
    original = gguf.architecture
    monkeypatch.setattr(
        gguf, "architecture", lambda path: gguf.Architecture(**(vars(original(path)) | {"permute_qk": False}))
    )
    assert f32_logit_gap(model, tokenizer, folder)(tmp_path / "wrong.gguf") > 1e-2


def test_tied_embeddings_write_no_output_tensor(tokenizer: Any, tmp_path: Path) -> None:
    from gguf import GGUFReader

    from lorafit.export import gguf

    folder = tmp_path / "model"
    tiny_model(folder, tokenizer, "qwen2", tie_word_embeddings=True)
    written = gguf.write_gguf(folder, tmp_path / "m.gguf", "f16")
    names = {tensor.name for tensor in GGUFReader(written.path).tensors}
    assert "token_embd.weight" in names and "output.weight" not in names


def sentencepiece_tokenizer() -> Any:
    """A Llama-2-style SentencePiece BPE (prepend + replace normalizer, byte fallback, <s> added), trained here."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from lorafit.train import demo

    trainer_side = Tokenizer(models.BPE())
    trainer_side.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    trainer_side.train_from_iterator(demo.corpus(), trainers.BpeTrainer(vocab_size=800, show_progress=False))
    trained = json.loads(trainer_side.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{i:02X}>": 3 + i for i in range(256)}
    for token, _ in sorted(trained["vocab"].items(), key=lambda item: item[1]):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_sentencepiece_vocabulary_round_trips(tmp_path: Path) -> None:
    from lorafit.export import gguf, verify

    tokenizer = sentencepiece_tokenizer()
    folder = tmp_path / "model"
    model = tiny_model(folder, tokenizer, "llama")
    written = gguf.write_gguf(folder, tmp_path / "spm.gguf", "f32")
    vocabulary = written.vocabulary
    assert vocabulary.model == "llama" and vocabulary.add_bos and vocabulary.add_space_prefix
    assert vocabulary.types[3] == 6 and vocabulary.types[0] == 2  # <0x00> is a byte token, <unk> unknown
    with verify.llama(written.path, 512) as runtime:
        assert verify.tokenizer_matches(runtime, tokenizer, vocabulary)  # accents and emoji go through bytes
    ids = tokenizer(TEXT)["input_ids"]
    reference = hf_logits(model, ids)
    assert np.abs(llama_cpp_logits(written.path, ids) - reference).max() < 1e-3 * np.abs(reference).max()


def byte_level(pre_tokenizer: Any, ignore_merges: bool = False) -> Any:
    from tokenizers import Tokenizer, decoders, models, trainers

    from lorafit.train import demo

    backend = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(demo.corpus()[:1], trainers.BpeTrainer(vocab_size=300, show_progress=False))
    return backend


def split_then_bytes(pattern: str) -> Any:
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


WORDS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
REST = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
LLAMA3 = WORDS + r"\p{N}{1,3}" + REST
QWEN2 = WORDS + r"\p{N}" + REST


def test_pretokenizer_is_identified_by_behaviour() -> None:
    """The expressions of Llama 3's and Qwen2's tokenizer.json (as their model repositories ship them) are
    recognised as llama.cpp's llama-bpe and qwen2, the GPT-2 byte-level default as gpt-2; one that splits
    digits differently is refused, not guessed."""
    from tokenizers import pre_tokenizers

    from lorafit.export.gguf_vocab import identify_pretokenizer

    assert identify_pretokenizer(byte_level(pre_tokenizers.ByteLevel(add_prefix_space=False)), False) == "gpt-2"
    assert identify_pretokenizer(byte_level(split_then_bytes(LLAMA3), True), True) == "llama-bpe"
    assert identify_pretokenizer(byte_level(split_then_bytes(QWEN2)), False) == "qwen2"
    with pytest.raises(ExportError, match="splits text unlike every llama.cpp pre-tokenizer"):
        identify_pretokenizer(byte_level(split_then_bytes(LLAMA3.replace("{1,3}", "{1,2}")), True), True)
    with pytest.raises(ExportError, match="splits text unlike"):  # a leading space llama.cpp would not add
        identify_pretokenizer(byte_level(pre_tokenizers.ByteLevel(add_prefix_space=True)), False)


def test_unsupported_family_and_quantised_folder_are_refused(tmp_path: Path) -> None:
    from lorafit.export import gguf

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt_neox"}))
    with pytest.raises(ExportError, match="cannot write 'gpt_neox' models as GGUF"):
        gguf.architecture(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": {"bits": 4}}))
    with pytest.raises(ExportError, match="quantised weights"):
        gguf.architecture(folder)


def test_quant_types_and_k_quant_blocks(tokenizer: Any, tmp_path: Path) -> None:
    """q8_0 written here holds Q8_0 matrices; llama.cpp's q4_k_m of rows of 256 holds real Q4_K (and its Q6_K
    share), not only the fallbacks a narrow model gets."""
    from gguf import GGUFReader

    from lorafit.export import gguf

    folder = tmp_path / "model"
    tiny_model(folder, tokenizer, "llama")
    f16 = gguf.write_gguf(folder, tmp_path / "m-f16.gguf", "f16")
    q8 = gguf.write_gguf(folder, tmp_path / "m-q8_0.gguf", "q8_0")
    gguf.quantize(f16.path, tmp_path / "m-q4_k_m.gguf", "q4_k_m")

    def types(path: Path) -> dict[str, str]:
        return {tensor.name: tensor.tensor_type.name for tensor in GGUFReader(path).tensors}

    assert types(f16.path)["blk.0.attn_q.weight"] == "F16" and types(f16.path)["blk.0.attn_norm.weight"] == "F32"
    assert types(q8.path)["blk.0.ffn_up.weight"] == "Q8_0"
    k_types = set(types(tmp_path / "m-q4_k_m.gguf").values())
    assert {"Q4_K", "Q6_K"} <= k_types
    assert (tmp_path / "m-q4_k_m.gguf").stat().st_size < q8.path.stat().st_size < f16.path.stat().st_size


def test_a_file_whose_logits_are_nan_fails_the_check_and_is_not_written(tokenizer: Any, tmp_path: Path) -> None:
    """NaN compares false with every tolerance: a model whose logits are all NaN must still fail the check."""
    from lorafit.export import job

    folder = tmp_path / "model"
    model = tiny_model(folder, tokenizer, "llama")
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")
    model.save_pretrained(folder)
    output = tmp_path / "out"
    with pytest.raises(ExportError, match="not finite"):
        job.export_gguf(folder, output, ["f16"], overwrite=False, check=True, ollama=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # nothing written, no staging folder left


def chatml_tokenizer() -> Any:
    """The demo tokenizer with ChatML turns: each ends on <|im_end|>, a special token that is not EOS."""
    from lorafit.train import demo

    chatml = demo.build_tokenizer(demo.corpus(), vocab_size=1024)
    chatml.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    chatml.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return chatml


def chain_model(folder: Path, tokenizer: Any, start: int, chain: list[int], hidden: int = 64) -> None:
    """A Llama whose attention and MLP add nothing, so each next token depends on the last one only: after
    `start` it answers chain[0], chain[1], ... and then the last of `chain` (by construction, in both runtimes)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama",
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight.zero_()
        model.model.layers[0].mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.mul_(0.01)
        head = model.lm_head.weight
        head.zero_()
        for position, (token, following) in enumerate(zip([start, *chain[:-1]], chain, strict=True)):
            model.model.embed_tokens.weight[token] = 0.0
            model.model.embed_tokens.weight[token, position] = 1.0
            head[following, position] = 10.0
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def test_stops_count_answers_that_end_on_the_end_of_turn_token(tmp_path: Path) -> None:
    """An instruct model's answer ends on its end-of-turn token (<|im_end|>, not EOS) after more tokens than the
    greedy comparison reads: the stop check counts it, as llama.cpp and `lorafit chat` stop there."""
    from lorafit.export import gguf, verify

    chatml = chatml_tokenizer()
    start = verify.prompts(chatml, ["hi"])[0][-1]
    end_of_turn = chatml.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn != chatml.eos_token_id
    answer = [token for token in range(40, 100) if token != start][:40]
    folder = tmp_path / "model"
    chain_model(folder, chatml, start, [*answer, end_of_turn])
    written = gguf.write_gguf(folder, tmp_path / "m-f16.gguf", "f16")
    figures = verify.verify(folder, {"f16": written.path}, written.vocabulary)["f16"]
    assert figures.prompts == 3 and figures.stops == 3
    assert figures.greedy_match is True and verify.failures({"f16": figures}) == []


def test_chat_with_a_prompt_longer_than_the_gguf_context_is_one_line(
    tokenizer: Any, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from conftest import run_cli
    from lorafit.export import gguf

    folder = tmp_path / "model"
    tiny_model(folder, tokenizer, "llama")
    written = gguf.write_gguf(folder, tmp_path / "m-f16.gguf", "f16")
    capsys.readouterr()  # what saving the tiny model printed (transformers' progress bar) is not the command's
    prompt = "the lighthouse keeper counts the boats " * 200
    code, _, err = run_cli(["chat", str(written.path), "--prompt", prompt, "--max-new-tokens", "4"], capsys)
    assert code == 2 and "shorten the prompt" in err and len(err.strip().splitlines()) == 1, err


def test_the_check_reads_llama_cpp_with_an_f32_cache(tokenizer: Any, tmp_path: Path) -> None:
    """The check compares the file, not llama.cpp's cache: with keys and values kept in f32 an f32 file gives
    transformers' logits to 1e-5 of the largest, where llama.cpp's default f16 cache alone moves them ~1e-3."""

    folder = tmp_path / "model"
    model = tiny_model(folder, tokenizer, "llama")
    assert f32_logit_gap(model, tokenizer, folder)(tmp_path / "model-f32.gguf") < 1e-5
