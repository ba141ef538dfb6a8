"""DeepSpeed ZeRO-2 and ZeRO-3 on two CPU processes (gloo), on the demo base in real bitsandbytes NF4 stored as
bf16: what each process keeps after one training step, counted tensor by tensor, against the estimator's
per-GPU terms for a world of 2 (`memory.shard_factors`: ZeRO-2 keeps the whole weights and half of the
gradients and optimizer states, ZeRO-3 half of all three).

What DeepSpeed keeps beside the estimator's terms, measured here and asserted as such:
- Both stages clone their partition of the trainable parameters into an fp32 master copy, even though the
  adapters are fp32 already with bf16 off: ZeRO-2's `single_partition_of_fp32_groups` (stage_1_and_2.py) always,
  ZeRO-3's `fp32_partitioned_groups_flat` (stage3.py) because its reuse-in-place branch compares the
  tensor's torch.device with the device *name* ("cpu", "cuda:0"), which is never equal (DeepSpeed 0.19.8).
  That is 4 bytes per trainable parameter over the world size, which `memory.optimizer_bytes` counts with the
  two AdamW moments under zero2/zero3.
- ZeRO-3 partitions every parameter, the packed 4-bit weights too (bf16 storage), but not their quantisation
  state: absmax and nested absmax are attributes of bitsandbytes' Params4bit, so every process keeps all of it,
  as `memory.quant_state_bytes` says.
- The reduce buckets (reduce_bucket_size elements, two of them with overlap_comm) are communication buffers,
  `memory.communication_buffer_bytes`, not a sharded term; they are left out of the comparison here."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from conftest import free_port
from lorafit import memory
from lorafit.train.demo import tiny_spec
from test_multi_gpu import qlora

# A bucket big enough for every adapter gradient at once (131,072 on the demo base), so that the buckets stay
# small on a CPU: DeepSpeed's default of 5e8 elements would allocate 2 GB per bucket per process.
REDUCE_BUCKET_ELEMENTS = 200_000


def _zero_step_and_measure(rank: int, world: int, port: int, stage: int, model_dir: str, out_dir: str) -> None:
    """One process: load the demo base in NF4 stored as bf16 (what `lorafit train` loads for a sharded run), add
    the adapters, hand them to DeepSpeed ZeRO at `stage` with torch's AdamW, run one step on a short batch, and
    count the bytes of every tensor each ZeRO structure holds, once per storage."""
    import gc

    os.environ.update(
        DS_ACCELERATOR="cpu",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
    )
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401  (the module patched below)
    import torch

    from lorafit.train import build

    # DeepSpeed's CPU backend compiles a shared-memory all-reduce (a C++ op, a minute or more on first use);
    # gloo runs the same collectives without it.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    settings = qlora(n_gpus=world, shard=f"zero{stage}", lora_dropout=0.0)
    spec = tiny_spec(1024, hidden_size=256)
    model = build.prepare(build.load_model(Path(model_dir), settings), spec, settings)
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    quant_state = []
    for module in model.modules():
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is not None:
            quant_state += [state.absmax, state.state2.absmax]
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {
            "stage": stage,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": REDUCE_BUCKET_ELEMENTS,
        },
        "bf16": {"enabled": False},  # the adapters stay fp32, as peft makes them
        "zero_allow_untested_optimizer": True,  # torch's AdamW: no compiled FusedAdam on the CPU
        "steps_per_print": 2**31 - 1,
    }
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, foreach=False)
    engine, zero, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    def sizes(tensors: list[torch.Tensor]) -> dict[int, int]:
        return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.numel()}

    batch = torch.randint(0, spec.vocab_size, (1, 16), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(input_ids=batch, labels=batch).loss)
    # ZeRO-2 lets its gradient partition go once the step has used it: count it before the step, in the
    # reduced slices it hands the optimizer (views of one flat partition); ZeRO-3 keeps one flat buffer
    if stage == 2:
        gradients = [t for group in zero.averaged_gradients.values() for t in group]
    else:
        gradients = [zero.grad_partitions_flat_buffer]
    gradients_bytes = sum(sizes(gradients).values())
    engine.step()

    def local(parameters: list[torch.nn.Parameter]) -> list[torch.Tensor]:
        # ZeRO-3 leaves each parameter an empty placeholder and keeps this process's partition in ds_tensor
        return [p.ds_tensor if hasattr(p, "ds_tensor") else p.data for p in parameters]

    if stage == 2:
        adapters = zero.bit16_groups_flat  # the adapters, flattened into one buffer their parameters view
        master = zero.single_partition_of_fp32_groups
    else:
        adapters = zero.fp16_partitioned_groups_flat
        master = zero.fp32_partitioned_groups_flat
    moments = [t for s in zero.optimizer.state.values() for t in s.values() if t.dim()]
    gc.collect()
    measured = {
        "frozen": sum(sizes(local(frozen)).values()),
        "quant_state": sum(sizes(quant_state).values()),
        "adapters": sum(sizes(local(trainable) + list(adapters)).values()),
        "gradients": gradients_bytes,
        "moments": sum(sizes(moments).values()),
        "master": sum(sizes(list(master)).values()),
        "trainable": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in trainable),
    }
    print(f"zero{stage} rank {rank}: {measured}", flush=True)
    Path(out_dir, f"zero{stage}-rank{rank}.json").write_text(json.dumps(measured))
    deepspeed.comm.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_shards_the_demo_model_as_the_estimate_says(stage: int, tmp_path: Path) -> None:
    """Each of two gloo processes keeps the estimator's per-GPU weights (ZeRO-2: all of them; ZeRO-3: half of
    the packed weights and the bf16 rest, and all of the quantisation state), adapters, gradients and AdamW
    moments with the fp32 master copy of its half of the adapters, for a world of 2, within 3% (ZeRO pads each
    partition to an aligned length)."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("bitsandbytes")
    import torch.multiprocessing as mp

    from lorafit.train.demo import build_demo_base

    model_dir = tmp_path / "base"
    build_demo_base(model_dir, hidden_size=256)
    args = (2, free_port(), stage, str(model_dir), str(tmp_path))
    mp.spawn(_zero_step_and_measure, args=args, nprocs=2, join=True)

    spec = tiny_spec(1024, hidden_size=256)
    settings = qlora(n_gpus=2, shard=f"zero{stage}", lora_dropout=0.0)
    runtime = memory.stack_runtime(settings)
    w_share, g_share, o_share = memory.shard_factors(settings)
    assert (w_share, g_share, o_share) == ((1.0 if stage == 2 else 0.5), 0.5, 0.5)
    weights = memory.sharded_weight_bytes(spec, settings, runtime)
    state = memory.quant_state_bytes(spec, settings, runtime)
    adapters = memory.adapter_bytes(spec, settings, runtime) * w_share
    gradients = memory.gradient_bytes(spec, settings, runtime) * g_share
    optimizer = memory.optimizer_bytes(spec, settings, runtime) * o_share
    for rank in range(2):
        measured = json.loads((tmp_path / f"zero{stage}-rank{rank}.json").read_text())
        assert measured["trainable"] == memory.trainable_params(spec, settings)
        assert measured["quant_state"] == pytest.approx(state, rel=0.03)
        assert measured["frozen"] + measured["quant_state"] == pytest.approx(weights, rel=0.03)
        assert measured["adapters"] == pytest.approx(adapters, rel=0.03)
        assert measured["gradients"] == pytest.approx(gradients, rel=0.03)
        assert measured["moments"] + measured["master"] == pytest.approx(optimizer, rel=0.03)
        # of which the fp32 master partition, 4 bytes per trainable parameter over the world
        assert measured["master"] == pytest.approx(4 * measured["trainable"] * o_share, rel=0.03)
