"""What an out-of-memory error at micro-batch 1 suggests: only changes that would lower this run's peak."""

from __future__ import annotations

import pytest

from lorafit.schema import Settings
from lorafit.train.guard import memory_savers, out_of_memory_at_one

QLORA_LEAN = Settings(method="qlora", quant="nf4", grad_ckpt=True, optimizer="paged_adamw_8bit", seq_len=4096)


def test_a_qlora_run_that_saves_everything_is_told_only_to_shorten_its_sequences() -> None:
    message = str(out_of_memory_at_one(7, QLORA_LEAN))
    assert message.startswith("out of memory in step 7 at micro-batch 1; try a shorter --seq-len (now 4096)")
    for already in ("qlora", "--grad-ckpt", "paged_adamw_8bit", "--attn"):
        assert already not in message


@pytest.mark.parametrize(
    ("change", "suggested"),
    [
        ({"grad_ckpt": False}, "--grad-ckpt"),
        ({"optimizer": "adamw"}, "--optimizer paged_adamw_8bit"),
        ({"optimizer": "paged_adamw_32bit"}, "--optimizer paged_adamw_8bit"),
        ({"method": "lora", "quant": "none"}, "--method qlora"),
        ({"method": "full", "quant": "none"}, "--method qlora or lora"),
        ({"quant": "int8"}, "--quant nf4"),
        ({"double_quant": False}, "--double-quant"),
        ({"attn": "eager"}, "--attn sdpa"),
    ],
)
def test_each_saving_the_run_does_not_use_yet_is_suggested(change: dict, suggested: str) -> None:
    savers = memory_savers(QLORA_LEAN.model_copy(update=change))
    assert any(saver.startswith(suggested) for saver in savers), savers
    assert len(savers) == 2  # that one and the sequence length


def test_sgd_is_not_told_to_use_an_8bit_optimizer() -> None:
    assert not any("optimizer" in saver for saver in memory_savers(QLORA_LEAN.model_copy(update={"optimizer": "sgd"})))
