"""The settings of the whole job that are not a training step's: several nodes, data, schedule, checkpoints,
chat, export, serve and the command switches; declared as lorafit.options declares the step's (see there)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from lorafit.choices import Batching, DataFormat, ExportTarget, GgufType, Scheduler
from lorafit.declaration import MAX_STEPS, MAX_TOKENS_PER_EPOCH, About


class RunOptions:
    """The rest of what the commands take: the whole job, data, schedule, checkpoints, chat, export, serve, and
    the command switches."""

    # several nodes
    node_rank: Annotated[
        int | None,
        Field(ge=0),
        About("this machine's rank among the nodes (0 is the main one)", ("train",), "gpus", auto="0"),
    ] = None
    main_address: Annotated[
        str | None,
        About(
            "address of node 0 that every node connects to (several nodes)",
            ("train",),
            "gpus",
            auto="127.0.0.1 on one node",
        ),
    ] = None
    main_port: Annotated[int, Field(gt=0, le=65535), About("port on node 0 for the rendezvous", ("train",), "gpus")] = (
        29500
    )
    # the whole job
    batch_size: Annotated[
        int | None,
        Field(gt=0, le=1 << 20),
        About(
            "effective batch in sequences: micro_batch x grad_accum x n_gpus",
            ("plan", "train"),
            "job",
            auto="16, or micro_batch x grad_accum (x n_gpus) when both are set",
            flags=("--target-batch",),
        ),
    ] = None
    epochs: Annotated[float, Field(gt=0, le=10000), About("passes over the data", ("plan", "train"), "job")] = 3.0
    max_steps: Annotated[
        int | None, Field(gt=0, le=MAX_STEPS), About("optimizer steps; overrides epochs", ("train",), "job")
    ] = None
    tokens_per_epoch: Annotated[
        int | None,
        Field(gt=0, le=MAX_TOKENS_PER_EPOCH),
        About(
            "training tokens per epoch",
            ("plan",),
            "job",
            auto="the data's, else an Alpaca-sized 15M",
            flags=("--tokens",),
        ),
    ] = None
    rent_price: Annotated[
        float | None,
        Field(gt=0, le=1000),
        About(
            "what renting the GPU costs you, for the rented cost (not with --compare, which prices each card)",
            ("plan",),
            "job",
            auto="the catalog's price of the GPU",
            unit="USD per GPU-hour",
        ),
    ] = None
    kwh_price: Annotated[
        float,
        Field(ge=0, le=100),
        About("electricity price for the own-card cost", ("plan",), "job", unit="USD per kWh"),
    ] = 0.3
    max_price_hour: Annotated[
        float | None,
        Field(ge=0),
        About(
            "a cap on the rental price: `gpus` lists only the GPUs under it, `plan --compare` also names the cheapest "
            "under it",
            ("plan", "gpus"),
            "job",
            auto="no cap",
            unit="USD per GPU-hour",
        ),
    ] = None
    min_vram: Annotated[
        float | None,
        Field(ge=0, le=4096),
        About(
            "only GPUs with at least this much memory, as sold (a '24 GB' card counts as 24)",
            ("gpus",),
            "job",
            auto="no minimum",
            unit="GB as sold",
        ),
    ] = None
    # serving the merged model
    serve_context: Annotated[
        int,
        Field(gt=0, le=1 << 22),
        About(
            "context length to size the serving memory of the merged model at (KV cache)",
            ("plan",),
            "serving",
            auto="4096, or the model's maximum when that is shorter",
            unit="tokens",
        ),
    ] = 4096
    # data for training
    data_format: Annotated[
        DataFormat | None, About("format of the data", ("train",), "data", auto="detected from the first rows")
    ] = None
    data_mapping: Annotated[
        dict[str, str] | None,
        About(
            "read a field from another column: FIELD=COLUMN[,FIELD=COLUMN...]", ("train",), "data", auto="no renames"
        ),
    ] = None
    eval_data: Annotated[
        str | None, About("held-out dataset for the eval loss", ("train",), "data", auto="eval_split of the data")
    ] = None
    eval_split: Annotated[
        float,
        Field(ge=0),
        About("rows held out for the eval loss: a share below 1, or a whole number of rows", ("train",), "data"),
    ] = 0.05
    output_dir: Annotated[str, About("where the adapter, metrics, plan and checkpoints go", ("train",), "data")] = (
        "runs/lorafit"
    )
    # schedule
    learning_rate: Annotated[
        float, Field(gt=0, le=10), About("peak learning rate", ("train",), "schedule", flags=("--lr",))
    ] = 0.0002
    lr_scheduler: Annotated[Scheduler, About("learning-rate schedule", ("train",), "schedule")] = "cosine"
    warmup_ratio: Annotated[
        float, Field(ge=0, lt=1), About("share of the steps spent warming up", ("train",), "schedule")
    ] = 0.03
    weight_decay: Annotated[float, Field(ge=0), About("AdamW weight decay", ("train",), "schedule")] = 0.0
    max_grad_norm: Annotated[float, Field(ge=0), About("gradient clipping norm (0: off)", ("train",), "schedule")] = 1.0
    seed: Annotated[
        int, Field(ge=0, lt=2**32), About("seed for data order, adapters and dropout", ("train",), "schedule")
    ] = 42
    # loss and batching
    train_on_prompt: Annotated[
        bool, About("loss on every token, or on the answers only", ("train",), "loss", off_flag="--answer-only")
    ] = False
    batching: Annotated[
        Batching,
        About(
            "how rows are batched (auto: padding_free with flash attention, else length_grouped)", ("train",), "loss"
        ),
    ] = "auto"
    # logging, evaluation, checkpoints
    logging_steps: Annotated[
        int, Field(gt=0), About("steps between metrics.jsonl lines", ("train",), "checkpoints")
    ] = 1
    eval_steps: Annotated[
        int | None,
        Field(gt=0),
        About("steps between eval-loss measurements", ("train",), "checkpoints", auto="at every checkpoint"),
    ] = None
    save_steps: Annotated[
        int,
        Field(gt=0),
        About("steps between checkpoints (atomic; rerun the command to resume)", ("train",), "checkpoints"),
    ] = 50
    save_total_limit: Annotated[int, Field(gt=0), About("newest checkpoints kept", ("train",), "checkpoints")] = 2
    # safety
    allow_pickle: Annotated[
        bool, About("load .bin (pickle) weights, which can run code", ("train", "chat"), "safety")
    ] = False
    trust_remote_code: Annotated[bool, About("run a model's own Python code", ("train", "chat"), "safety")] = False
    # chat
    prompt: Annotated[str | None, About("the user message", ("chat",), "chat", flags=("-p",))] = None
    max_new_tokens: Annotated[int, Field(gt=0, le=32768), About("longest answer", ("chat",), "chat", unit="tokens")] = (
        64
    )
    temperature: Annotated[
        float,
        Field(ge=0, le=100),
        About("sampling temperature; 0 is greedy (the same answer every time)", ("chat",), "chat"),
    ] = 0.0
    # export
    to: Annotated[
        ExportTarget | None,
        About(
            "what to write: a merged transformers model folder, or GGUF files for llama.cpp / Ollama / LM Studio",
            ("export",),
            "export",
        ),
    ] = None
    gguf_types: Annotated[
        list[GgufType] | None,
        About(
            "GGUF type to write; repeat for several (K-quants come from llama.cpp's quantizer)",
            ("export",),
            "export",
            auto="f16",
            flag_name="--quant",
        ),
    ] = None
    output: Annotated[str | None, About("the folder to write", ("export",), "export", flags=("-o",))] = None
    ollama: Annotated[
        bool, About("also write an Ollama Modelfile beside the GGUF", ("export",), "switch", config=False)
    ] = False
    no_verify: Annotated[
        bool,
        About(
            "skip loading each GGUF in llama.cpp and comparing it with the merged model",
            ("export",),
            "switch",
            config=False,
        ),
    ] = False
    # serve
    host: Annotated[
        str,
        About(
            "address to listen on; the default answers this machine only (0.0.0.0: every network)", ("serve",), "serve"
        ),
    ] = "127.0.0.1"
    port: Annotated[int, Field(ge=1, le=65535), About("port to listen on", ("serve",), "serve")] = 8765
    open: Annotated[bool, About("open the page in the default browser", ("serve",), "switch", config=False)] = False
    # command switches: what to do, not what to train
    exact: Annotated[
        bool, About("trace the real training step on fake tensors", ("estimate",), "switch", config=False)
    ] = False
    compare: Annotated[bool, About("rank the catalog GPUs for this job", ("plan",), "switch", config=False)] = False
    from_config: Annotated[
        str | None,
        About(
            "answer for the run this training config describes: an axolotl or LLaMA-Factory YAML, TRL/transformers "
            "training arguments (JSON or YAML), a torchtune or litgpt config, or a lorafit YAML; flags override it",
            ("estimate", "plan"),
            "switch",
            config=False,
            flag_name="--from",
        ),
    ] = None
    dry_run: Annotated[
        bool,
        About(
            "check everything, resolve every automatic choice, print the plan and the resolved config, write nothing",
            ("train",),
            "switch",
            config=False,
        ),
    ] = False
    demo: Annotated[
        bool, About("build a tiny model and fine-tune it on bundled data (CPU)", ("train",), "switch", config=False)
    ] = False
    resume: Annotated[
        bool, About("continue the run in output_dir from its checkpoint", ("train",), "switch", config=False)
    ] = False
    overwrite: Annotated[
        bool,
        About(
            "train: delete the run in output_dir and start over; export: replace the output",
            ("train", "export"),
            "switch",
            config=False,
        ),
    ] = False
    json: Annotated[
        bool,
        About(
            "print one JSON object for programs",
            ("estimate", "plan", "export", "gpus", "models", "stacks", "detect"),
            "switch",
            config=False,
        ),
    ] = False
