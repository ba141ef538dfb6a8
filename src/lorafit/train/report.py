"""What a person reads after a run: the loss curve (loss.png) and the model card (README.md)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorafit.files import atomic_writer
from lorafit.render import settings_line
from lorafit.schema import Plan
from lorafit.train import runfolder
from lorafit.train.progress import Speed


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "step" in record:
            records.append(record)
    return records


def plot_loss(metrics: list[dict[str, Any]], path: Path, title: str, eval_before: float | None = None) -> None:
    """Training loss per logged step and eval loss per eval step (the eval before training at step 0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in metrics if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in metrics if "eval_loss" in r]
    if eval_before is not None:
        evals = [(0, eval_before), *evals]
    figure, axes = plt.subplots(figsize=(7, 4), dpi=120)
    if train:
        axes.plot(*zip(*train, strict=True), label="train loss", linewidth=1.2)
    if evals:
        axes.plot(*zip(*evals, strict=True), "o-", label="eval loss", linewidth=1.2, markersize=4)
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("loss (answer tokens)")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    try:
        with atomic_writer(path, binary=True) as handle:
            figure.savefig(handle, format="png")
    finally:
        plt.close(figure)


@dataclass(frozen=True)
class Finished:
    """What a finished run reports, in its model card and its last console lines."""

    output_dir: Path
    base_model: str
    data: str
    rows: int
    eval_rows: int
    steps: int
    seconds: float
    speed: Speed
    train_loss: float | None
    eval_before: float | None
    eval_after: float | None


def model_card(run: Finished, plan: Plan) -> str:
    """A short README.md: what was trained on what, how well, and how to use it. It travels with the run folder,
    so it names no absolute path of this machine (`runfolder.shown_path`): the snippets load the run by its
    folder name from the folder above it."""
    run_name = run.output_dir.expanduser().resolve().name
    base_model = runfolder.shown_path(run.base_model, run.output_dir)
    data = runfolder.shown_path(run.data, run.output_dir)
    settings = plan.settings
    method = settings.method
    adapter = method != "full"
    lines = [
        f"# {run_name}",
        "",
        f"{'A LoRA adapter' if adapter else 'A fine-tuned model'} trained with lorafit ({method}) on `{base_model}`.",
        "",
        "| | |",
        "|---|---|",
        f"| base model | `{base_model}` |",
        f"| data | `{data}` ({run.rows} training rows, {run.eval_rows} held out) |",
        f"| settings | {settings_line(settings)} |",
        f"| steps | {run.steps} (effective batch {settings.effective_batch} sequences) |",
        f"| time | {run.seconds:.0f} s; {run.speed.label()} (trained: the answer tokens of the loss) |",
    ]
    if run.train_loss is not None:
        lines.append(f"| final training loss | {run.train_loss:.4f} |")
    if run.eval_after is not None:
        before = f"{run.eval_before:.4f} before training, " if run.eval_before is not None else ""
        lines.append(f"| eval loss (held-out rows, answer tokens) | {before}{run.eval_after:.4f} after |")
    lines += [
        "",
        "The loss curve is `loss.png`; every logged step is a line of `metrics.jsonl`. The settings "
        "and the memory estimate are in `plan.json` / `plan.yaml`, the resolved config in `config.yaml`.",
        "",
        "## Use it",
        "",
    ]
    if adapter:
        lines += [
            "```python",
            "from peft import PeftModel",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "",
            f'base = AutoModelForCausalLM.from_pretrained("{base_model}")',
            f'model = PeftModel.from_pretrained(base, "{run_name}")',
            f'tokenizer = AutoTokenizer.from_pretrained("{run_name}")',
            "```",
        ]
    else:
        lines += [
            "```python",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "",
            f'model = AutoModelForCausalLM.from_pretrained("{run_name}")',
            f'tokenizer = AutoTokenizer.from_pretrained("{run_name}")',
            "```",
        ]
    lines += ["", f'or from the command line: `lorafit chat {run_name} --prompt "..."`', ""]
    return "\n".join(lines)
