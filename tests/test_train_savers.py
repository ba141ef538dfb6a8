"""The memory savers of `lorafit train` (lorafit.train.savers) on a tiny random Llama, on the CPU: each one gives
the loss and gradients of the plain step, and each keeps in host memory exactly what it says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import run_cli
from lorafit import memory
from lorafit.schema import Settings
from lorafit.train import build, savers
from lorafit.train.demo import tiny_spec

SPEC = tiny_spec(vocab_size=300, hidden_size=64, layers=3, heads=4, kv_heads=2)


def tiny_model(settings: Settings, seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(build.hf_config(SPEC, settings), dtype=torch.float32)
    for param in model.parameters():  # the adapters start at zero: make B non-zero so their gradients count
        torch.nn.init.normal_(param, std=0.05)
    model.train()
    model = build.prepare(model, SPEC, settings)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.05)
    return model


def batch(rows: int = 2, length: int = 40, seed: int = 1) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, SPEC.vocab_size, (rows, length), generator=generator)
    labels = input_ids.clone()
    labels[:, :7] = savers.IGNORE_INDEX  # a prompt that is not scored
    labels[1, -5:] = savers.IGNORE_INDEX  # padding
    return {"input_ids": input_ids, "labels": labels}


def loss_and_grads(model: torch.nn.Module, loss: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    loss.backward()
    grads = {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def assert_same(first: tuple[float, dict], second: tuple[float, dict]) -> None:
    assert first[0] == pytest.approx(second[0], rel=1e-6, abs=1e-7)
    assert first[1].keys() == second[1].keys() and first[1]
    for name, grad in first[1].items():
        torch.testing.assert_close(second[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)


# --- the chunked loss ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [1, 7, 32, 79, 500])
@pytest.mark.parametrize("num_items", [None, 123])
def test_chunked_loss_has_the_loss_and_gradients_of_transformers_loss(chunk: int, num_items: int | None) -> None:
    from transformers.loss.loss_utils import ForCausalLMLoss

    torch.manual_seed(0)
    hidden = torch.randn(2, 40, 16, requires_grad=True)
    head = torch.nn.Linear(16, 50, bias=False)
    labels = torch.randint(0, 50, (2, 40))
    labels[0, :9] = savers.IGNORE_INDEX

    plain = ForCausalLMLoss(head(hidden), labels, vocab_size=50, num_items_in_batch=num_items)
    expected = loss_and_grads_of(plain, hidden, head)
    chunked = savers.causal_lm_loss(hidden, head, labels, chunk_tokens=chunk, num_items_in_batch=num_items)
    got = loss_and_grads_of(chunked, hidden, head)
    assert got[0] == pytest.approx(expected[0], rel=1e-6)
    for name in expected[1]:
        torch.testing.assert_close(got[1][name], expected[1][name], rtol=1e-5, atol=1e-8, msg=name)


def loss_and_grads_of(loss: torch.Tensor, hidden: torch.Tensor, head: torch.nn.Module) -> tuple[float, dict]:
    loss.backward()
    grads = {"hidden": hidden.grad.clone(), "head": head.weight.grad.clone()}
    hidden.grad, head.weight.grad = None, None
    return loss.item(), grads


def test_chunked_loss_caps_the_logits_as_gemma_2_does() -> None:
    torch.manual_seed(0)
    hidden = torch.randn(1, 12, 8)
    head = torch.nn.Linear(8, 20, bias=False)
    labels = torch.randint(0, 20, (1, 12))
    capped = torch.tanh(head(hidden) / 3.0) * 3.0
    expected = torch.nn.functional.cross_entropy(capped[0, :-1].float(), labels[0, 1:])
    got = savers.causal_lm_loss(hidden, head, labels, chunk_tokens=4, softcap=3.0)
    assert got.item() == pytest.approx(expected.item(), rel=1e-6)


def test_chunked_loss_never_holds_the_whole_sequence_of_logits() -> None:
    """The live bytes of the step, counted by the trace's tracker: the chunked loss's peak holds one chunk's
    logits, the plain one every token's."""
    from lorafit.trace.tracker import LiveTensorTracker

    torch.manual_seed(0)
    vocab, tokens = 4000, 512
    head = torch.nn.Linear(32, vocab, bias=False)
    labels = torch.randint(0, vocab, (1, tokens))

    def peak(chunk: int | None) -> int:
        hidden = torch.randn(1, tokens, 32, requires_grad=True)
        with LiveTensorTracker() as tracker:
            savers.causal_lm_loss(hidden, head, labels, chunk_tokens=chunk).backward()
        return tracker.peak[1].total_bytes

    whole, chunked = peak(None), peak(64)
    assert whole > 3 * 4 * vocab * tokens  # fp32 logits, their log-softmax and its gradient
    assert chunked < whole / 4
    assert chunked < 12 * 4 * vocab * 64 + 4 * vocab * tokens  # a few chunks' worth, not the sequence's


# --- the step with the savers ----------------------------------------------------------------------------------
SAVER_SETTINGS = {
    "chunked loss": {"loss": "chunked"},
    "offload activations": {"offload_activations": True},
    "offload embeddings": {"offload_embeddings": True},
    "all": {"loss": "chunked", "offload_activations": True, "offload_embeddings": True},
}


@pytest.mark.parametrize("saver", SAVER_SETTINGS, ids=list(SAVER_SETTINGS))
def test_each_saver_gives_the_loss_and_gradients_of_the_plain_step(saver: str, monkeypatch) -> None:
    monkeypatch.setattr(savers, "LOSS_CHUNK_TOKENS", 16)  # several chunks of the 2 x 39 scored positions
    plain_settings = Settings(method="lora", precision="fp32", grad_ckpt=True, lora_dropout=0.0)
    with_saver = plain_settings.model_copy(update=SAVER_SETTINGS[saver])
    inputs = batch()
    plain_model = tiny_model(plain_settings)
    expected = loss_and_grads(plain_model, plain_model(**inputs).loss)
    model = tiny_model(with_saver)
    got = loss_and_grads(model, savers.micro_batch_loss(model, inputs, with_saver))
    assert_same(expected, got)


def test_activation_offload_keeps_each_layer_input_in_host_memory() -> None:
    """What reaches the host is what the checkpoint keeps, each layer's input; the final norm keeps its own."""
    settings = Settings(method="lora", precision="fp32", grad_ckpt=True, offload_activations=True)
    model = tiny_model(settings)
    host: list[torch.Tensor] = []
    inputs = batch(rows=2, length=24)
    loss = savers.micro_batch_loss(model, inputs, settings, on_host=host.append)
    assert [tuple(t.shape) for t in host] == [(2, 24, SPEC.hidden_size)] * SPEC.num_hidden_layers
    assert all(t.device.type == "cpu" for t in host)
    loss.backward()  # the copies come back for backward
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)


def test_activation_offload_needs_checkpointing_for_its_memory_term() -> None:
    """The estimate's host figure is the checkpointed inputs: layers x tokens x hidden x bytes."""
    settings = Settings(method="lora", precision="bf16", grad_ckpt=True, offload_activations=True, seq_len=1024)
    expected = SPEC.num_hidden_layers * 1024 * SPEC.hidden_size * 2
    assert memory.offloaded_activation_bytes(SPEC, settings) == expected
    assert memory.offloaded_activation_bytes(SPEC, settings.model_copy(update={"grad_ckpt": False})) == 0


def test_the_embedding_table_stays_in_host_memory_when_the_model_moves() -> None:
    settings = Settings(method="lora", precision="fp32", offload_embeddings=True)
    model = tiny_model(settings)
    table = savers.host_tensors(model)
    assert len(table) == 1 and table[0].shape == (SPEC.vocab_size, SPEC.hidden_size)
    assert not table[0].requires_grad
    model.to(torch.float64)  # a move or cast of the whole model (as model.to(device)) stops at the table
    assert savers.host_tensors(model)[0].dtype == torch.float32
    assert model.get_base_model().lm_head.weight.dtype == torch.float64
    embedded = model.get_base_model().get_input_embeddings()(torch.tensor([[1, 2, 3]]))
    assert embedded.shape == (1, 3, SPEC.hidden_size)


def test_the_trace_counts_what_the_savers_keep_in_host_memory() -> None:
    """The `--exact` trace runs the same savers: the offloaded inputs and the embedding table are host bytes."""
    from lorafit.trace.api import trace_step

    settings = Settings(
        method="lora",
        precision="bf16",
        grad_ckpt=True,
        micro_batch=1,
        seq_len=128,
        offload_activations=True,
        offload_embeddings=True,
        loss="chunked",
    )
    trace = trace_step(SPEC, settings)
    table = SPEC.vocab_size * SPEC.hidden_size * 2
    layer_inputs = SPEC.num_hidden_layers * 128 * SPEC.hidden_size * 2
    assert trace.host_peak_bytes == table + layer_inputs == memory.host_saver_bytes(SPEC, settings)
    plain = trace_step(SPEC, settings.model_copy(update={"offload_activations": False, "offload_embeddings": False}))
    assert plain.host_peak_bytes == 0
    assert trace.peak_bytes < plain.peak_bytes


# --- the allocator and the host RAM ----------------------------------------------------------------------------
def test_expandable_segments_join_the_users_allocator_settings() -> None:
    on = Settings(expandable_segments=True)
    assert savers.allocator_environment(Settings(), {}) == {}
    assert savers.allocator_environment(on, {}) == {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    assert savers.allocator_environment(on, {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}) == {
        "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128,expandable_segments:True"
    }
    assert savers.allocator_environment(on, {"PYTORCH_ALLOC_CONF": "expandable_segments:False"}) == {}


def test_offloads_that_the_free_host_ram_cannot_hold_are_refused_in_one_line() -> None:
    from lorafit import models

    spec = models.resolve("llama-3.1-8b")
    settings = Settings(method="qlora", grad_ckpt=True, seq_len=2048, offload_activations=True, offload_embeddings=True)
    needed = memory.host_saver_bytes(spec, settings) / memory.GIB
    assert memory.host_saver_problem(spec, settings, free_gib=needed * 2) is None
    problem = memory.host_saver_problem(spec, settings, free_gib=needed)
    assert problem and "\n" not in problem
    assert "offload_activations and offload_embeddings" in problem and "GiB of host RAM" in problem
    assert memory.host_saver_problem(spec, Settings(method="qlora"), free_gib=0.1) is None


# --- `lorafit train` with the savers ------------------------------------------------------------------------
def demo_curve(out: Path, capsys: pytest.CaptureFixture[str], *savers_flags: str) -> tuple[list[float], float]:
    """(the logged loss of every step, the held-out loss after) of a 10-step demo run."""
    args = ["train", "--demo", "--output-dir", str(out), "--max-steps", "10", "--logging-steps", "1"]
    code, _, err = run_cli([*args, *savers_flags], capsys)
    assert code in (0, 1), err  # 1: ten steps do not teach the demo's facts, which it says
    curve = [row["loss"] for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]
    assert len(curve) == 10
    return curve, json.loads((out / "lorafit-run.json").read_text())["eval_after"]


def test_the_demo_trains_the_same_with_every_saver_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`lorafit train --demo`: the chunked loss gives the full loss's curve and held-out loss, and so do all
    the savers together (the demo model's embeddings are untied, so both offloads apply), up to fp32 rounding.
    The savers really run: the trainer's loss goes through them and the layer inputs reach the offload."""
    calls = {"loss": 0, "offloaded": 0}
    real_loss, real_pack = savers.micro_batch_loss, savers.ActivationOffload.pack

    def counted_loss(*args: object, **kwargs: object) -> torch.Tensor:
        calls["loss"] += 1
        return real_loss(*args, **kwargs)

    def counted_pack(self: savers.ActivationOffload, tensor: torch.Tensor) -> object:
        calls["offloaded"] += 1
        return real_pack(self, tensor)

    monkeypatch.setattr(savers, "micro_batch_loss", counted_loss)
    monkeypatch.setattr(savers.ActivationOffload, "pack", counted_pack)

    full = demo_curve(tmp_path / "full", capsys, "--loss", "full", "--grad-ckpt")
    assert calls == {"loss": 0, "offloaded": 0}  # the plain step is transformers' own
    chunked = demo_curve(tmp_path / "chunked", capsys, "--loss", "chunked", "--grad-ckpt")
    assert calls["loss"] > 0 and calls["offloaded"] == 0
    every = ("--loss", "chunked", "--grad-ckpt", "--offload-activations", "--offload-embeddings")
    all_savers = demo_curve(tmp_path / "all", capsys, *every, "--expandable-segments")
    assert calls["offloaded"] > 0

    for curve, eval_after in (chunked, all_savers):
        assert curve == pytest.approx(full[0], rel=1e-5)
        assert eval_after == pytest.approx(full[1], rel=1e-5)
    settings = json.loads((tmp_path / "all" / "plan.json").read_text())["settings"]
    assert settings["loss"] == "chunked" and settings["offload_activations"] and settings["offload_embeddings"]


def test_savers_that_cannot_apply_are_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cases = {
        ("--offload-activations", "--no-grad-ckpt"): "needs grad_ckpt on",
        ("--method", "full", "--offload-embeddings"): "full fine-tuning trains them",
        ("--loss", "chunky"): "--loss chunky: must be one of full, chunked",
    }
    for flags, expected in cases.items():
        out = tmp_path / "run"
        code, _, err = run_cli(["train", "--demo", "--output-dir", str(out), "--max-steps", "1", *flags], capsys)
        assert (code, err.count("\n")) == (2, 1) and expected in err, (flags, err)
        assert not out.exists()


def test_embeddings_tied_to_the_head_are_not_offloaded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A tied model's input embedding is the head's weight, which runs on the GPU: refused before training."""
    from lorafit.train.demo import build_model, build_tokenizer, corpus

    folder = tmp_path / "tied"
    tokenizer = build_tokenizer(corpus(), vocab_size=512)
    tied = tiny_spec(len(tokenizer), hidden_size=64).model_copy(update={"tie_word_embeddings": True})
    build_model(folder, tokenizer, tied, seed=0)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"q{i}", "output": f"a{i}"}) + "\n" for i in range(8)))
    out = tmp_path / "run"
    args = ["train", "--model", str(folder), "--data", str(data), "--output-dir", str(out), "--offload-embeddings"]
    code, _, err = run_cli(args, capsys)
    assert (code, err.count("\n")) == (2, 1) and "ties its input embeddings to the LM head" in err, err
    assert not out.exists()


def test_a_run_whose_offloads_the_host_ram_cannot_hold_stops_before_training(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CUDA machine the trainer checks the free host RAM against the offloads the plan turned on."""
    from lorafit import hardware, models
    from lorafit.errors import TrainError
    from lorafit.train import setup

    spec = models.resolve("llama-3.1-8b")
    settings = Settings(method="qlora", grad_ckpt=True, seq_len=2048, offload_activations=True, offload_embeddings=True)
    needed = memory.host_saver_bytes(spec, settings) / memory.GIB
    monkeypatch.setattr(hardware, "available_ram_gib", lambda: needed)
    with pytest.raises(TrainError, match="GiB of host RAM") as refused:
        setup.check_device(settings, True, spec)
    assert "\n" not in str(refused.value)
    monkeypatch.setattr(hardware, "available_ram_gib", lambda: 4 * needed)
    setup.check_device(settings, True, spec)
    setup.check_device(
        settings.model_copy(update={"offload_activations": False, "offload_embeddings": False}), True, spec
    )
