"""Several GPUs and offload: the per-GPU memory, the host RAM, the interconnects, the communication time, the
suggestions, the refusals, and torch's FSDP2 sharding the demo model over two CPU processes.

Expected numbers are worked out by hand from the formulas in the docstrings (ZeRO's partitioning, ring
collectives), on the demo's tiny Llama (2 layers, width 256) where the sums are short."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from conftest import free_port, run_cli
from lorafit import hardware, memory, models, timing, transfers
from lorafit.memory import Runtime
from lorafit.schema import Settings
from lorafit.train.demo import tiny_spec

GIB = 2**30


@pytest.fixture(scope="module")
def spec() -> models.ModelSpec:
    # width 256, 2 layers, 4 heads of 64, 2 kv heads, MLP 512, vocabulary 1024, untied head
    return tiny_spec(1024, hidden_size=256)


# One layer of the width-256 spec: q 256x256, k and v 256x128, o 256x256, gate/up 256x512, down 512x256
LAYER_LINEAR = 2 * 65536 + 2 * 32768 + 3 * 131072  # 589,824
LINEAR = 2 * LAYER_LINEAR
REST = 2 * 2 * 256 + 2 * 1024 * 256 + 256  # norms, embeddings, LM head, final norm: 525,568
ABSMAX = 1 / 64 + 4 / (64 * 256)  # bytes per weight of double-quantised NF4 state


def qlora(**values: Any) -> Settings:
    return Settings(**({"method": "qlora", "precision": "bf16", "micro_batch": 1, "grad_accum": 1} | values))


def test_the_spec_is_the_one_worked_by_hand(spec: models.ModelSpec) -> None:
    assert spec.num_hidden_layers * spec.layer_linear_params == LINEAR
    assert spec.num_params - LINEAR == REST


def test_every_gpu_of_every_node_takes_its_share() -> None:
    assert memory.shard_factors(Settings(n_gpus=2, nodes=2, shard="zero3")) == (1 / 4, 1 / 4, 1 / 4)
    assert memory.shard_factors(Settings(n_gpus=4, nodes=2, shard="zero2")) == (1.0, 1 / 8, 1 / 8)
    assert memory.shard_factors(Settings(n_gpus=8, shard="ddp")) == (1.0, 1.0, 1.0)


def test_fsdp_shards_the_packed_4_bit_weights_and_keeps_their_state_on_every_gpu(spec: models.ModelSpec) -> None:
    runtime = Runtime()
    state = LINEAR * ABSMAX
    whole = 0.5 * LINEAR + state + 2 * REST  # packed weights, their state, the rest in bf16
    assert memory.weights_bytes(spec, qlora(), runtime) == pytest.approx(whole)
    halves = memory.sharded_weight_bytes(spec, qlora(n_gpus=2, shard="fsdp"), runtime)
    assert halves == pytest.approx((0.5 * LINEAR + 2 * REST) / 2 + state)
    offloaded = memory.sharded_weight_bytes(spec, qlora(n_gpus=2, shard="fsdp", offload="params"), runtime)
    assert offloaded == pytest.approx(state)
    # two layers in flight, packed linears and bf16 norms
    gathered = memory.gathered_layer_bytes(spec, qlora(n_gpus=2, shard="fsdp"), runtime)
    assert gathered == pytest.approx(2 * (0.5 * LAYER_LINEAR + 2 * 2 * 256))


def test_an_offload_moves_gradients_and_optimizer_states_off_the_gpu(spec: models.ModelSpec) -> None:
    settings = Settings(method="full", precision="bf16", n_gpus=2, shard="zero2", offload="optimizer", grad_accum=1)
    parts, _ = memory.breakdown(spec, settings, Runtime())
    assert parts["optimizer_states"] == 0 and parts["gradients"] == 0
    host = memory.offloaded_state_bytes(spec, settings, Runtime())
    assert host == {"offloaded_optimizer": pytest.approx(spec.num_params * 16 / 2)}  # fp32 master, grad, 2 moments


def test_host_ram_is_the_larger_of_loading_and_training(spec: models.ModelSpec) -> None:
    big = models.resolve("llama-2-7b")
    # LoRA in bf16: each of 4 processes builds the whole model in host memory before it moves to the GPU
    loading = memory.host_ram_parts(big, Settings(method="lora", n_gpus=4, shard="fsdp"), Runtime())
    assert loading == {"processes": 4 * 3 * GIB, "model_loading": 4 * big.num_params * 2}
    # QLoRA under ZeRO-3 with the parameters offloaded (the base loaded onto the GPUs, one file at a time through
    # host memory): the two processes' halves of the packed base, and their runtimes
    huge = models.resolve("llama-2-70b")
    settings = qlora(n_gpus=2, shard="zero3", offload="params", lora_r=8)
    training = memory.host_ram_parts(huge, settings, Runtime())
    linear = huge.num_hidden_layers * huge.layer_linear_params
    base = 0.5 * linear + 2 * (huge.num_params - linear)  # packed 4-bit linears, the rest in bf16
    # the same under FSDP: each process loads the whole packed base in host memory (and one 5 GB file being
    # quantised) before fully_shard moves it to the GPU, which is larger than what training keeps there
    fsdp = memory.host_ram_parts(huge, settings.model_copy(update={"shard": "fsdp"}), Runtime())
    state = memory.quant_state_bytes(huge, settings, Runtime())
    assert fsdp == {"processes": 2 * 3 * GIB, "model_loading": pytest.approx(2 * (base + state + 5e9))}
    adapters = huge.lora_params(8, "all") * 4
    assert training["processes"] == 2 * 3 * GIB
    assert training["offloaded_weights"] == pytest.approx(2 * (base + adapters) / 2)
    assert training["offloaded_optimizer"] == pytest.approx(2 * huge.lora_params(8, "all") * 16 / 2)
    estimate = memory.estimate(huge, settings, hardware.resolve("RTX 4090"))
    assert estimate.host_ram_gib == pytest.approx(sum(training.values()) / GIB, abs=1e-3)
    assert estimate.world_size == 2 and estimate.per_gpu_gib["sharded_weights"] < 1.5


def test_each_gpu_has_the_link_its_board_gives_it() -> None:
    within, between = hardware.links_of(hardware.resolve("RTX 4090"))
    assert within.via_host and within.gbs_for(hardware.resolve("RTX 4090")) == 31.5 / 2
    a100 = hardware.resolve("A100 80GB")
    assert [link.name for link in hardware.links_of(a100)] == ["nvlink-3", "infiniband-hdr-200"]
    assert hardware.links_of(hardware.resolve("L40S"))[0].gbs_for(hardware.resolve("L40S")) == 31.5
    every = hardware.links()
    assert all(link.source and link.as_of for link in every.values())
    # over two machines the ring runs at the slower link: 25 GB/s of HDR, not NVLink's 300
    rate = transfers.collective_bytes_per_second(Settings(n_gpus=8, nodes=2, shard="zero3"), a100)
    assert rate == pytest.approx(25e9 * transfers.COLLECTIVE_EFFICIENCY)
    assert between.name == "ethernet-25"


def test_communication_volume_follows_zero(spec: models.ModelSpec) -> None:
    lora_params = spec.lora_params(16, "all")
    ddp = transfers.communication_bytes(spec, qlora(n_gpus=4, shard="ddp"))
    assert ddp == (0.0, pytest.approx(2 * 3 / 4 * lora_params * 4))  # all-reduce of fp32 adapter gradients
    zero3 = transfers.communication_bytes(spec, qlora(n_gpus=4, shard="zero3"))
    params = 0.5 * LINEAR + 2 * REST + lora_params * 4  # packed base, bf16 rest, fp32 adapters
    assert zero3 == (pytest.approx(3 / 4 * (2 * params + lora_params * 4)), 0.0)
    full = Settings(method="full", precision="bf16", n_gpus=2, shard="fsdp")
    psi = spec.num_params * 2
    assert transfers.communication_bytes(spec, full)[0] == pytest.approx(1 / 2 * 3 * psi)  # 3 Psi x (n-1)/n


def test_deepspeed_buckets_are_allocated_whole(spec: models.ModelSpec) -> None:
    """ZeRO-2 double-buffers each reduce bucket (overlap_comm), ZeRO-3 keeps one in the communication dtype
    (bf16 here), of 5e7 elements whatever the model's size; DDP's buckets are a second copy of every gradient;
    FSDP has none of its own."""
    runtime = Runtime()
    fp32 = 4  # the adapters' gradients
    buffers = {shard: memory.communication_buffer_bytes(spec, qlora(n_gpus=2, shard=shard), runtime) for shard in
               ("ddp", "zero2", "zero3", "fsdp")}  # fmt: skip
    assert buffers["zero2"] == 2 * 50_000_000 * fp32
    assert buffers["zero3"] == 50_000_000 * 2
    assert buffers["ddp"] == spec.lora_params(16, "all") * fp32
    assert buffers["fsdp"] == 0.0


def test_one_gpu_keeps_the_time_it_had(spec: models.ModelSpec) -> None:
    gpu = hardware.resolve("RTX 4090")
    settings = qlora(grad_accum=4, micro_batch=2)
    step, optimizer = timing.step_seconds(spec, settings, gpu), timing.optimizer_seconds(spec, settings, gpu)
    expected = settings.tokens_per_micro_batch * 4 / (4 * step + optimizer)
    assert timing.tokens_per_second(spec, settings, gpu) == pytest.approx(expected)


def test_a_slow_link_costs_what_it_cannot_hide() -> None:
    big = models.resolve("llama-2-7b")
    settings = Settings(method="full", precision="bf16", n_gpus=4, shard="zero3", micro_batch=1, grad_accum=4)
    over_pcie = timing.step_time(big, settings, hardware.resolve("RTX 4090"))
    over_nvlink = timing.step_time(big, settings, hardware.resolve("H100 SXM"))
    assert over_pcie.communication > 0.5 * over_pcie.compute  # 3 x 13.5 GB a micro-batch at ~12 GB/s
    assert over_nvlink.communication == 0.0  # hidden behind compute at 340 GB/s


def test_70b_qlora_on_rtx_4090s_suggests_two_cards_with_offloaded_parameters(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # lorafit's trainer loads the 4-bit base in host memory and FSDP moves it to the GPUs a sharded layer at a time
    code, out, _ = run_cli(
        ["plan", "--model", "llama-2-70b", "--method", "qlora", "--gpu", "rtx-4090", "--json"], capsys
    )
    assert code == 0
    answer = json.loads(out)
    assert not answer["fits"]
    several = [s for s in answer["suggestions"] if s["n_gpus"] > 1]
    assert several[0]["n_gpus"] == 2 and several[0]["offload"] == "params" and several[0]["hours"] > 0
    assert several[0]["settings"]["shard"] == "fsdp"
    assert several[0]["estimate"]["fits"] and several[0]["estimate"]["host_ram_gib"] > 30
    assert several[0]["estimate"]["loading_peak_gib"] is None
    assert several[0]["change"].startswith("2x RTX 4090 with FSDP and CPU offload of the parameters, ")
    assert any(s["n_gpus"] >= 4 and s["offload"] == "none" for s in several)  # the fewest without offload
    # FSDP has one CPU offload (parameters, gradients and the step): no "offload of the optimizer states" row
    assert not any(s["offload"] == "optimizer" for s in several)


HOST_LOADING = [
    # stack, shard, whole base onto every GPU first
    ("lorafit", "fsdp", False),
    ("lorafit", "zero3", True),
    ("trl", "fsdp", True),
    ("trl", "zero3", True),
]


@pytest.mark.parametrize(("stack", "shard", "whole"), HOST_LOADING)
def test_a_base_loaded_whole_on_every_gpu_rules_out_sharding_it_over_cards_smaller_than_it(
    stack: str, shard: str, whole: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 4-bit base quantised on each process's GPU, whole, before FSDP/ZeRO-3 shard it: 70B in nf4 (about 0.5
    byte a weight plus the quantisation state) never fits a 24 GB card while loading. lorafit's trainer loads
    it in host memory under FSDP instead: every process holds the packed base there until FSDP moves it."""
    args = ["--model", "llama-2-70b", "--method", "qlora", "--gpu", "rtx-4090", "--stack", stack]
    code, out, _ = run_cli(["estimate", *args, "--n-gpus", "4", "--shard", shard, "--json"], capsys)
    assert code == 0
    answer = json.loads(out)
    nf4_bytes_per_weight = 0.5 + 4 / 64  # packed weight + fp32 absmax per 64 (double quantisation shrinks it)
    packed_gib = 69e9 * nf4_bytes_per_weight / 2**30
    assert answer["peak_allocated_gib"] < answer["gpu_memory_gib"]  # the sharded step itself fits
    loading = answer["host_ram_breakdown_gib"].get("model_loading", 0.0)
    if whole:
        assert answer["loading_peak_gib"] > 0.9 * packed_gib > answer["gpu_memory_gib"]
        # and the cache keeps what loading reserved while the step runs in it (memory.device_side)
        assert answer["peak_device_gib"] > answer["loading_peak_gib"]
        assert answer["fits"] is False
        assert loading < 4 * 5  # each process holds one checkpoint file (5 GB) on its way to the GPU
    else:
        assert answer["loading_peak_gib"] is None and answer["fits"] is True
        assert loading > 4 * 0.9 * packed_gib  # four processes, each its packed copy


def test_what_loading_the_whole_base_reserved_stays_cached_through_the_sharded_step(spec: models.ModelSpec) -> None:
    """ZeRO-3 shards a base loaded whole onto the GPU by freeing the whole tensors into PyTorch's cache, which
    nothing empties before the step: reserved is at least the whole base, and nvidia-smi that plus the CUDA
    context and NCCL. A base that was never whole on the GPU leaves the reserve as the step makes it."""
    settings = qlora(n_gpus=2, shard="zero3")
    runtime = Runtime()
    whole = memory.gpu_loading_bytes(spec, settings, runtime)
    assert whole == memory.weights_bytes(spec, settings, runtime) > 0
    extra = (runtime.cuda_context_gib + runtime.nccl_gib) * GIB
    step_reserved, _ = memory.device_side(1 * GIB, 0.0, settings, runtime)
    assert 1 * GIB < step_reserved < 3 * GIB
    assert memory.device_side(1 * GIB, 0.0, settings, runtime, kept_from_loading=3 * GIB) == (3 * GIB, 3 * GIB + extra)
    # below the step's own reserve, what loading left changes nothing
    assert memory.device_side(1 * GIB, 0.0, settings, runtime, kept_from_loading=GIB)[0] == step_reserved
    # the estimate passes the base it loaded whole, and only then
    zero3 = memory.estimate(spec, settings)
    assert zero3.peak_reserved_gib * GIB >= whole and zero3.loading_peak_gib is not None
    fsdp = memory.estimate(spec, qlora(n_gpus=2, shard="fsdp"))
    assert fsdp.loading_peak_gib is None


@pytest.mark.parametrize("stack", ["lorafit", "trl"])
def test_the_plan_says_when_several_cards_do_not_help_and_what_does(
    stack: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--model", "llama-2-70b", "--method", "qlora", "--gpu", "rtx-4090", "--stack", stack, "--json"]
    code, out, _ = run_cli(["plan", *args], capsys)
    plan = json.loads(out)
    several = [s for s in plan["suggestions"] if s["n_gpus"] > 1]
    said = [reason for reason in plan["reasons"] if "loads the nf4 base whole" in reason]
    if stack == "lorafit":
        assert several and not said
    else:
        assert not several and said and "--stack lorafit" in said[0]
    code, out, _ = run_cli(["plan", *args, "--shard", "zero3", "--n-gpus", "2"], capsys)
    pinned = json.loads(out)
    said = [reason for reason in pinned["reasons"] if "loads the nf4 base whole" in reason]
    assert said and ("--shard fsdp" if stack == "lorafit" else "--stack lorafit") in said[0]


def test_estimate_json_has_the_per_gpu_figures_and_the_host_ram(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["estimate", "--model", "llama-2-70b", "--method", "qlora", "--gpu", "rtx-4090", "--n-gpus", "2"]
    code, out, _ = run_cli([*args, "--shard", "zero3", "--offload", "params", "--json"], capsys)
    assert code == 0
    answer = json.loads(out)
    assert answer["world_size"] == 2 and answer["settings"]["offload"] == "params"
    assert set(answer["per_gpu_gib"]) >= {"sharded_weights", "gradients", "optimizer_states", "gathered_layers"}
    assert answer["host_ram_gib"] > answer["host_ram_breakdown_gib"]["offloaded_weights"] > 30
    assert "peak_device_gib" in answer and "breakdown_gib" in answer  # the keys scripts read stay
    code, out, _ = run_cli(args[:-2] + ["--n-gpus", "2", "--nodes", "2", "--shard", "zero3"], capsys)
    assert code == 0 and "per GPU of 4" in out and "host RAM per machine" in out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--method", "qlora", "--quant", "int8", "--n-gpus", "2", "--shard", "fsdp"], "use quant nf4"),
        (["--n-gpus", "2", "--shard", "ddp", "--offload", "optimizer"], "use shard zero2"),
        (["--n-gpus", "2", "--shard", "zero2", "--offload", "params"], "use shard zero3"),
        (["--n-gpus", "2", "--shard", "zero3", "--offload", "optimizer", "--optimizer", "adamw_8bit"], "use optimizer"),
        (["--n-gpus", "32"], "use n_gpus 8 with nodes 4"),
        (["--n-gpus", "1", "--shard", "fsdp"], "use shard none"),
    ],
)
def test_a_strategy_that_cannot_apply_is_one_line_and_exit_2(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(["estimate", "--gpu", "rtx-4090", *flags], capsys)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err


def test_one_gpu_on_each_of_two_nodes_shards(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(["estimate", "--gpu", "rtx-4090", "--nodes", "2", "--shard", "zero3"], capsys)
    assert code == 0, err
    code, _, err = run_cli(["plan", "--gpu", "rtx-4090", "--n-gpus", "2", "--nodes", "2", "--batch-size", "6"], capsys)
    assert code == 2 and "use a batch_size that is a multiple of 4" in err


# --- FSDP2 on two CPU processes -----------------------------------------------------------------------------
def _shard_and_measure(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    """One process: load the demo base in 4-bit NF4 stored as bf16 (what `lorafit train` loads for FSDP), add
    the adapters, shard every decoder layer and the root with FSDP2's fully_shard, give each trainable shard a
    gradient and let AdamW make its states; then count every live tensor's bytes once per storage."""
    import gc

    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from lorafit.train import build

    settings = qlora(n_gpus=world, shard="fsdp", lora_dropout=0.0)
    spec = tiny_spec(1024, hidden_size=256)
    model = build.prepare(build.load_model(Path(model_dir), settings), spec, settings)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    trainable = [p for p in model.parameters() if p.requires_grad]
    for parameter in trainable:
        parameter.grad = torch.zeros_like(parameter)
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, foreach=False)
    optimizer.step()

    def local(tensor: torch.Tensor) -> torch.Tensor:
        return tensor._local_tensor if isinstance(tensor, DTensor) else tensor

    def sizes(tensors: list[torch.Tensor]) -> dict[int, int]:
        return {local(t).untyped_storage().data_ptr(): local(t).untyped_storage().nbytes() for t in tensors}

    gc.collect()
    live = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and not isinstance(o, torch.nn.Parameter)]
    live += list(model.parameters())
    quant_state = []
    for module in model.modules():
        # bitsandbytes keeps it on the module too, where FSDP's DTensor weight has none
        state = getattr(module, "quant_state", None) or getattr(getattr(module, "weight", None), "quant_state", None)
        if state is not None:
            quant_state += [state.absmax, state.state2.absmax]
    measured = {
        "total": sum(sizes(live + quant_state).values()),
        "frozen": sum(sizes([p for p in model.parameters() if not p.requires_grad]).values()),
        "quant_state": sum(sizes(quant_state).values()),
        "adapters": sum(sizes(trainable).values()),
        "gradients": sum(sizes([p.grad for p in trainable]).values()),
        "optimizer": sum(sizes([t for s in optimizer.state.values() for t in s.values() if t.dim()]).values()),
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(measured))
    dist.destroy_process_group()


def test_fsdp2_shards_the_demo_model_as_the_estimate_says(tmp_path: Path) -> None:
    """Two gloo processes shard the demo base (width 256) in NF4 with bf16 storage; each holds its half of the
    packed weights, the bf16 rest and the adapters, all of the quantisation state, and its half of the
    gradients and AdamW states: the estimator's per-GPU weights, adapters, gradients and optimizer states for
    a world of 2, within 3% (FSDP2 pads each shard to a whole row of the mesh)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("bitsandbytes")
    import torch.multiprocessing as mp

    from lorafit.train.demo import build_demo_base

    model_dir = tmp_path / "base"
    build_demo_base(model_dir, hidden_size=256)
    mp.spawn(_shard_and_measure, args=(2, free_port(), str(model_dir), str(tmp_path)), nprocs=2, join=True)
    spec = tiny_spec(1024, hidden_size=256)
    settings = qlora(n_gpus=2, shard="fsdp", lora_dropout=0.0)
    parts, _ = memory.breakdown(spec, settings, memory.stack_runtime(settings))
    optimizer = memory.optimizer_bytes(spec, settings, memory.stack_runtime(settings)) / 2
    gradients = memory.gradient_bytes(spec, settings, memory.stack_runtime(settings)) / 2
    state = memory.quant_state_bytes(spec, settings, memory.stack_runtime(settings))
    for rank in range(2):
        measured = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert measured["quant_state"] == pytest.approx(state, rel=0.03)
        assert measured["frozen"] + measured["quant_state"] == pytest.approx(parts["weights"], rel=0.03)
        assert measured["adapters"] == pytest.approx(parts["lora_adapters"], rel=0.03)
        assert measured["gradients"] == pytest.approx(gradients, rel=0.03)
        assert measured["optimizer"] == pytest.approx(optimizer, rel=0.03)
        estimated = parts["weights"] + parts["lora_adapters"] + gradients + optimizer
        assert measured["total"] == pytest.approx(estimated, rel=0.05)
    assert torch is not None


def _adapted_demo(model_dir: str, world: int) -> Any:
    """The demo base in NF4, loaded as `lorafit train` loads a base FSDP shards (recipe.load_device_map: in host
    memory, whatever GPU the process has), with adapters whose B is not zero, so that every adapter gets a
    gradient."""
    import torch

    from lorafit.train import build, recipe

    settings = qlora(n_gpus=max(world, 2), shard="fsdp", lora_dropout=0.0)  # a run planned for several GPUs
    device_map = recipe.load_device_map(settings, gpu=0)
    assert device_map == {"": "cpu"}
    torch.manual_seed(0)
    model = build.prepare(
        build.load_model(Path(model_dir), settings, device_map=device_map), tiny_spec(1024, 256), settings
    )
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return model


def _batches(world: int) -> Any:
    import torch

    return torch.randint(0, 1024, (world, 24), generator=torch.Generator().manual_seed(2))


def _shard_and_step(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    """One process: the host-loaded base sharded as accelerate's FSDP2 shards it (each decoder layer, then the
    root), one forward and backward on this process's row; rank 0 saves the loss and the whole gradients."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _adapted_demo(model_dir, world)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    row = _batches(world)[rank : rank + 1]
    loss = model(input_ids=row, labels=row).loss
    loss.backward()
    losses = [torch.zeros(()) for _ in range(world)]
    dist.all_gather(losses, loss.detach().float())
    gradients = {name: p.grad.full_tensor() for name, p in model.named_parameters() if p.requires_grad}
    if rank == 0:
        torch.save({"losses": torch.stack(losses), "gradients": gradients}, Path(out_dir, "sharded_step.pt"))
    dist.barrier()  # no process tears its group down while another still uses it (an abort in gloo's threads)
    dist.destroy_process_group()


def test_a_base_loaded_in_host_memory_and_sharded_by_fsdp2_steps_as_one_process_does(tmp_path: Path) -> None:
    """What `lorafit train` does under FSDP with a 4-bit base: every process loads it in host memory and FSDP2
    shards it a layer at a time. Two gloo processes, one row each, give the losses and the (averaged) adapter
    gradients of one unsharded process over both rows: the 4-bit weights and their quantisation state
    survive the sharding, and nothing but the shard of each weight stays with a process."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("bitsandbytes")
    import torch.multiprocessing as mp

    from lorafit.train.demo import build_demo_base

    model_dir = tmp_path / "base"
    build_demo_base(model_dir, hidden_size=256)
    mp.spawn(_shard_and_step, args=(2, free_port(), str(model_dir), str(tmp_path)), nprocs=2, join=True)
    sharded = torch.load(tmp_path / "sharded_step.pt")

    model = _adapted_demo(str(model_dir), 2)
    rows = _batches(2)
    losses = []
    for index in range(2):
        loss = model(input_ids=rows[index : index + 1], labels=rows[index : index + 1]).loss
        (loss / 2).backward()  # FSDP averages the gradients over the processes
        losses.append(loss.detach().float())
    assert torch.allclose(sharded["losses"], torch.stack(losses), rtol=1e-5)
    expected = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    assert set(sharded["gradients"]) == set(expected) and len(expected) > 10
    for name, gradient in expected.items():
        assert gradient.abs().sum() > 0, name
        assert torch.allclose(sharded["gradients"][name], gradient, rtol=1e-3, atol=1e-6), name


def _fsdp_checkpoint(rank: int, world: int, port: int, model_dir: str, out_dir: str, mode: str) -> None:
    """One process of an FSDP2 run (host-loaded NF4 demo base, sharded per layer, AdamW): `save` takes one step
    and writes the checkpoint with accelerate's save_fsdp_model / save_fsdp_optimizer, as the Trainer saves
    under `fsdp_state_dict_type: SHARDED_STATE_DICT`; `load` reads it back into a fresh run with
    load_fsdp_model / load_fsdp_optimizer. Rank 0 writes the whole adapters and AdamW moments it then has."""
    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from accelerate import PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import load_fsdp_model, load_fsdp_optimizer, save_fsdp_model, save_fsdp_optimizer
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    state = PartialState(cpu=True)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    model = _adapted_demo(model_dir, world)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    checkpoint = Path(out_dir, "checkpoint")
    if mode == "save":
        rows = _batches(world)[rank : rank + 1]
        model(input_ids=rows, labels=rows).loss.backward()
        optimizer.step()
        save_fsdp_model(plugin, state, model, str(checkpoint))
        save_fsdp_optimizer(plugin, state, optimizer, model, str(checkpoint))
    else:
        load_fsdp_model(plugin, state, model, str(checkpoint))
        load_fsdp_optimizer(plugin, state, optimizer, model, str(checkpoint))
    names = {p: name for name, p in model.named_parameters()}
    whole = {f"adapter {names[p]}": p.detach().full_tensor() for p in names if p.requires_grad}
    for parameter, moments in optimizer.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            whole[f"{key} {names[parameter]}"] = moments[key].full_tensor()
    if rank == 0:
        torch.save(whole, Path(out_dir, f"{mode}-{world}.pt"))
    dist.barrier()  # as in _shard_and_step
    dist.destroy_process_group()
    # leave without the interpreter's teardown: a background thread of the checkpoint or gloo still joinable
    # then aborts the process now and then ("terminate called without an active exception", SIGABRT), after
    # everything this process had to do is done and written
    os._exit(0)


def test_an_fsdp_checkpoint_resumes_on_another_number_of_processes(tmp_path: Path) -> None:
    """A checkpoint written by 2 FSDP2 processes, as accelerate writes it for the Trainer (torch.distributed
    .checkpoint), loads on 1 and on 3: the adapters and the AdamW moments each then holds, put together, are
    the 2-process run's exactly. Why `lorafit train --resume` lets an FSDP run change its GPU count
    (distributed.check_resume) and refuses it for DeepSpeed, which cannot re-partition its ZeRO states."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("bitsandbytes")
    import torch.multiprocessing as mp

    from lorafit.train.demo import build_demo_base

    model_dir = tmp_path / "base"
    build_demo_base(model_dir, hidden_size=256)
    for world, mode in ((2, "save"), (1, "load"), (3, "load")):
        mp.spawn(_fsdp_checkpoint, args=(world, free_port(), str(model_dir), str(tmp_path), mode), nprocs=world)
    saved = torch.load(tmp_path / "save-2.pt")
    assert sum(key.startswith("exp_avg_sq ") for key in saved) > 10
    assert all(value.abs().sum() > 0 for key, value in saved.items() if key.startswith("exp_avg"))
    for world in (1, 3):
        loaded = torch.load(tmp_path / f"load-{world}.pt")
        assert set(loaded) == set(saved)
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), (world, key)
