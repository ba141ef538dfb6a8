"""The bytes a step moves beyond the GPU's compute (lorafit.transfers): what each optimizer implementation streams,
an offload's CPU step, a paged optimizer's migrations over the host link; the collectives are in
tests/test_multi_gpu.py. llama-2-7b, worked out by hand as in tests/test_timing.py.
"""

from __future__ import annotations

import pytest

from lorafit import hardware, models, timing, transfers
from lorafit.schema import Settings

A100_BYTES = 2039e9 * 0.85  # spec bandwidth x BANDWIDTH_SHARE


@pytest.fixture(scope="module")
def spec() -> models.ModelSpec:
    return models.resolve("llama-2-7b")


def full(**fields) -> Settings:
    return Settings(**({"method": "full", "quant": "none", "micro_batch": 1, "seq_len": 2048} | fields))


def test_optimizer_traffic_by_implementation(spec, a100) -> None:
    """Per trainable parameter, p = g = s = 2 bytes in pure bf16: fused 2p + g + 4s = 14, torch's foreach
    loop 4p + 3g + 12s = 38, bitsandbytes' 32-bit paged kernel keeps fp32 moments (2p + g + 16 = 22), each
    plus clipping's 3g = 6."""
    runtime = timing.memory.stack_runtime(full())
    assert transfers.optimizer_traffic_bytes(full(), runtime) == 14 + 6
    assert (
        transfers.optimizer_traffic_bytes(
            full(fused_optimizer=False), runtime.model_copy(update={"fused_optimizer": False})
        )
        == 38 + 6
    )
    assert transfers.optimizer_traffic_bytes(full(optimizer="paged_adamw_32bit"), runtime) == 22 + 6
    fused = timing.optimizer_seconds(spec, full(), a100)
    assert fused == pytest.approx(spec.num_params * 20 / A100_BYTES)
    assert timing.optimizer_seconds(spec, full(fused_optimizer=False), a100) == pytest.approx(fused * 44 / 20)


def test_the_cpu_step_of_an_offload_moves_what_its_optimizer_keeps(spec, a100) -> None:
    """The offloaded optimizer step runs on the host at HOST_MEMORY_GBS, shared by the machine's 8 GPUs' shards of
    7B/8 parameters each. FSDP's CPU offload steps bf16 parameters with torch's fused AdamW, whose moments stay bf16
    (2p + g + 4s = 14 bytes, plus clipping's 6); ZeRO-3's CPU Adam steps an fp32 master copy with fp32 moments and
    writes the bf16 copy back (2 x 4 + 2 + 4 x 4 + 2 = 28, plus 6)."""
    host = transfers.HOST_MEMORY_GBS * 1e9
    fsdp = full(n_gpus=8, shard="fsdp", offload="params")
    zero3 = full(n_gpus=8, shard="zero3", offload="params")

    def cpu_step(settings: Settings) -> float:
        copies = spec.num_params / 8 * (2 + 2) / transfers.host_link_bytes_per_second(a100)  # gradients out, weights in
        return transfers.offload_seconds(spec, settings, a100)[1] - copies

    assert cpu_step(fsdp) == pytest.approx(spec.num_params * 20 / host)
    assert cpu_step(zero3) == pytest.approx(spec.num_params * 34 / host)


def test_paged_states_that_do_not_fit_cross_the_host_link_every_step(spec) -> None:
    """7B full fine-tuning with bitsandbytes' paged 32-bit AdamW: 54 GB of fp32 moments cannot sit beside the
    bf16 weights on a 24 GB card, so what does not fit is migrated in and out each step; a 3B model's fit on an
    80 GB card and nothing pages."""
    paged = full(micro_batch=4, grad_ckpt=True, optimizer="paged_adamw_32bit")
    rtx4090, a100 = hardware.resolve("RTX 4090"), hardware.resolve("A100 80GB")
    estimate = timing.memory.estimate(spec, paged, rtx4090)
    overflow = (estimate.peak_device_gib - rtx4090.memory_gib) * 1024**3
    moments = 2 * 4 * spec.num_params  # fp32, whatever the parameters' dtype
    assert overflow > moments  # the card is so full that every paged moment moves
    assert transfers.paging_seconds(spec, paged, rtx4090) == pytest.approx(
        2 * moments / transfers.host_link_bytes_per_second(rtx4090)
    )
    assert transfers.paging_seconds(models.resolve("llama-3.2-3b"), paged, a100) == 0.0
    assert transfers.paging_seconds(spec, full(micro_batch=4, grad_ckpt=True), rtx4090) == 0.0
    assert timing.step_time(spec, paged, rtx4090).optimizer > transfers.paging_seconds(spec, paged, rtx4090)
