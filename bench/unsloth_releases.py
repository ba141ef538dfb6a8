"""What each Unsloth notebook row ran beyond the pinned step lorafit models for `--stack unsloth`, read from the
release its banner names: the loss of that release (UNSLOTH_RELEASE_LOSS, shorter_peak_at) and, for the rows that
loaded one of Unsloth's dynamic 4-bit repos, the 16-bit layers it kept (DYNAMIC_REPO, with_dynamic_layers).
bench/calibration_rows.py applies them when it maps a row; bench/calibration/README.md says how each was read.
"""

from __future__ import annotations

import re

from lorafit.memory import CUT_CE_MIN_TOKENS, Runtime, breakdown
from lorafit.model_spec import PreQuantized
from lorafit.models import ModelSpec
from lorafit.schema import Settings

# Unsloth's loss by release (Runtime.loss, Runtime.fused_chunk_sizing; read from unsloth/models/llama.py and
# unsloth_zoo/fused_losses/cross_entropy_loss.py at each date, after the rows' errors were seen: check rows on
# that ground only): its Triton cross-entropy over the whole logits up to 2024-11, Apple's cut cross-entropy
# from 2024-11-17 (the context-length table of 2025-01, USC-*, and USN-08's 2025.4.4), its fused loss sized by
# half the free memory, uncapped, from 2025-08-13 (USN-09 and USM-*: 2025.8.5-2025.9.1) until the pinned
# version's 4 GiB cap (2026-07-06)
UNSLOTH_RELEASE_LOSS: dict[str, dict[str, str]] = {
    **{row: dict(loss="compute_logits") for row in (*(f"USN-{n:02d}" for n in range(1, 8)), "USN-10")},
    **{row: dict(loss="cut_ce") for row in ("USN-08", *(f"USC-{n:02d}" for n in range(1, 10)))},
    **{row: dict(fused_chunk_sizing="half_free") for row in ("USN-09", "USM-01", "USM-02", "USM-03")},
    # the rows added from the other notebooks, by their banners' releases (PyPI upload dates; 2024.1-2024.6 are
    # not on PyPI and predate 2024.8): 2024.1-2024.11.6 (2024-11-12) the Triton loss, 2025.1.5-2025.5.9 cut
    # cross-entropy, 2025.8.9 (2025-08-20) to 2026.4.4 (2026-04-06) the uncapped fused loss
    **{row: dict(loss="compute_logits") for row in (f"USN-{n}" for n in (11, 12, 13, 14, 15, 17, 18, 19, 20, 26))},
    **{row: dict(loss="cut_ce") for row in ("USN-16", "USN-21", "USN-22", "USN-23", "USN-25")},
    **{
        row: dict(fused_chunk_sizing="half_free")
        for row in ("USN-24", "USN-27", "USN-28", "USN-29", *(f"USM-{n:02d}" for n in range(6, 13)))
    },
}

# The rows that loaded one of Unsloth's dynamic 4-bit repos (`*-unsloth-bnb-4bit`: some layers kept 16-bit, named
# in the repo's config.json llm_int8_skip_modules): the notebook's model_name with load_in_4bit, as
# unsloth/models/mapper.py mapped it in its banner's month (USN-08's cell names its repo itself)
DYNAMIC_REPO = {
    "USN-08": "unsloth/Qwen3-14B-Base-unsloth-bnb-4bit",
    "USN-16": "unsloth/phi-4-unsloth-bnb-4bit",  # mapper.py @ 2025-01 (banner 2025.1.5)
    "USN-21": "unsloth/Llama-3.2-1B-Instruct-unsloth-bnb-4bit",  # @ 2025-04 (2025.4.7)
    "USN-23": "unsloth/Qwen3-14B-unsloth-bnb-4bit",  # @ 2025-05 (2025.5.9; USN-22, excluded, loaded it too)
    "USN-24": "unsloth/Qwen3-32B-unsloth-bnb-4bit",  # @ 2025-09 (2025.9.1)
    "USM-01": "unsloth/gpt-oss-20b-unsloth-bnb-4bit",  # @ 2025-08 (2025.8.5)
    "USM-02": "unsloth/gpt-oss-120b-unsloth-bnb-4bit",  # @ 2025-09 (2025.9.1)
    "USM-03": "unsloth/gemma-3-27b-it-unsloth-bnb-4bit",  # @ 2025-09 (2025.9.1)
    "USM-06": "unsloth/gemma-4-31b-it-unsloth-bnb-4bit",  # @ 2026-04 (2026.4.4)
    "USM-10": "unsloth/gemma-4-E4B-it-unsloth-bnb-4bit",  # @ 2026-04 (2026.4.4)
}
AFTER_LOADING = re.compile(r"'([\d.]+) GB of memory reserved' after loading")


def after_loading_gib(notes: str) -> float | None:
    """The notebook's max_memory_reserved once the model and its adapters are loaded (its cell divides by
    1024**3), where a row's notes quote it."""
    found = AFTER_LOADING.search(notes)
    return float(found.group(1)) if found else None


def loaded_bytes(spec: ModelSpec, settings: Settings, runtime: Runtime) -> float:
    """What lorafit holds once the model is loaded and its adapters made, before the first step."""
    parts, _ = breakdown(spec, settings, runtime)
    return parts["weights"] + parts["lora_adapters"]


def with_dynamic_layers(
    row_id: str, notes: str, spec: ModelSpec, settings: Settings, runtime: Runtime
) -> tuple[ModelSpec, str]:
    """A row that loaded a dynamic 4-bit repo whose skip list no stored source gives: its decoder linears kept
    16-bit, as many as its notebook's after-loading figure holds above lorafit's 4-bit weights and adapters
    (on the rows that loaded plain 4-bit repos the two agree: `make bench-memory`, "loaded"). Only the loaded
    weights change; the step's terms are not fitted to anything."""
    after = after_loading_gib(notes)
    if row_id not in DYNAMIC_REPO or after is None or settings.quant == "none":
        return spec, ""
    probe = 10**9  # bytes per kept parameter: what keeping a billion more 16-bit adds to the loaded weights
    kept = spec.model_copy(update={"prequantized": PreQuantized(quant="nf4", kept_16bit_params=probe)})
    all_4bit = loaded_bytes(spec, settings, runtime)
    per_param = (loaded_bytes(kept, settings, runtime) - all_4bit) / probe
    excess = after * 2**30 - all_4bit
    params = min(max(0, round(excess / per_param)), spec.num_hidden_layers * spec.layer_linear_params)
    kept = spec.model_copy(update={"prequantized": PreQuantized(quant="nf4", kept_16bit_params=params)})
    note = (
        f"{DYNAMIC_REPO[row_id]}: {params / 1e9:.2f}B decoder weights kept 16-bit "
        f"({excess / 2**30:+.2f} GiB after loading, {after} GB reserved)"
    )
    return kept, note


def shorter_peak_at(padded: bool, settings: Settings, runtime: Runtime) -> Settings | None:
    """The longest micro-batch Unsloth's releases with cut cross-entropy still scored through the logits (at most
    CUT_CE_MIN_TOKENS tokens), for a row padded to each batch's longest: its rows' peak is the highest over the
    lengths up to the cap, which may be there rather than at the cap. `padded`: the row's length is a cap."""
    fits = CUT_CE_MIN_TOKENS // settings.micro_batch
    if runtime.loss != "cut_ce" or not padded or settings.tokens_per_micro_batch <= CUT_CE_MIN_TOKENS:
        return None
    return settings.model_copy(update={"seq_len": fits}) if fits else None
