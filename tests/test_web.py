"""`lorafit serve`'s API: the same JSON as the CLI for the same options, one-line 400s for every bad input, the
page in the browser's language, and one dictionary per language with the same keys."""

from __future__ import annotations

import json
import re
import string
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from conftest import run_cli
from lorafit import messages, options, web

SERVED_AT = "http://127.0.0.1:8765"  # as `lorafit serve` listens by default: requests must name that address


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> TestClient:
    return TestClient(web.create_app(tmp_path_factory.mktemp("uploads")), base_url=SERVED_AT)


def files_under(folder: Path) -> list[Path]:
    return [path for path in folder.rglob("*") if path.is_file()]


def cli_json(args: list[str], capsys: pytest.CaptureFixture[str]) -> object:
    code, out, err = run_cli([*args, "--json"], capsys)
    assert code == 0, err
    return json.loads(out)


def as_flags(query: dict[str, str]) -> list[str]:
    flags = []
    for key, value in query.items():
        option = options.BY_NAME[key]
        if option.is_bool:
            flags.append(option.flag if value == "true" else "--no-" + option.flag.removeprefix("--"))
        else:
            flags += [option.flag, value]
    return flags


PLAN_QUERIES = {
    "7b qlora on a 4090": {"model": "llama-2-7b", "gpu": "rtx-4090", "seq_len": "2048"},
    "7b qlora on a 4060 ti": {"model": "llama-2-7b", "gpu": "RTX 4060 Ti 16GB"},
    "8b on 8 GB with savers": {"model": "llama-3.1-8b", "vram": "8", "method": "qlora"},
    "full fine-tuning does not fit": {"model": "llama-2-7b", "gpu": "rtx-4090", "method": "full"},
    "every kind of value": {
        "model": "qwen2.5-7b",
        "gpu": "a40",
        "lora_r": "64",
        "lora_targets": "attn",
        "grad_ckpt": "false",
        "optimizer": "paged_adamw_8bit",
        "epochs": "1.5",
        "batch_size": "32",
        "tokens_per_epoch": "2000000",
        "kwh_price": "0.12",
        "rent_price": "0.5",
        "loss": "chunked",
    },
}


@pytest.mark.parametrize("case", list(PLAN_QUERIES))
def test_the_plan_api_answers_what_lorafit_plan_json_prints(
    case: str, client: TestClient, capsys: pytest.CaptureFixture[str]
) -> None:
    query = PLAN_QUERIES[case]
    response = client.get("/api/plan", params=query)
    assert response.status_code == 200, response.text
    assert response.json() == cli_json(["plan", *as_flags(query)], capsys)


def test_the_estimate_api_answers_what_lorafit_estimate_json_prints(
    client: TestClient, capsys: pytest.CaptureFixture[str]
) -> None:
    query = {"model": "mistral-7b-v0.3", "gpu": "rtx-4090", "micro_batch": "4", "grad_ckpt": "true", "seq_len": "1024"}
    response = client.get("/api/estimate", params=query)
    assert response.status_code == 200
    assert response.json() == cli_json(["estimate", *as_flags(query)], capsys)
    assert "answer;dur=" in response.headers["server-timing"]


def streamed(client: TestClient, query: dict[str, str]) -> list[dict]:
    response = client.get("/api/compare", params=query)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(line) for line in response.text.splitlines()]


def test_the_gpu_comparison_is_plan_compare(client: TestClient, capsys: pytest.CaptureFixture[str]) -> None:
    query = {"model": "llama-2-7b", "max_price_hour": "1"}
    response = client.get("/api/plan", params=query | {"compare": "true"})
    expected = cli_json(["plan", *as_flags(query), "--compare"], capsys)
    assert response.json() == expected
    assert len(expected["plans"]) > 20 and expected["cheapest_under_price"]
    # the page's table reads the same plans a line at a time, then the cheapest
    *rows, last = streamed(client, query)
    assert sorted((row["plan"] for row in rows), key=lambda p: p["gpu"]["name"]) == sorted(
        expected["plans"], key=lambda p: p["gpu"]["name"]
    )
    assert last == {"done": True} | {
        key: expected[key] for key in ("cheapest", "cheapest_under_price", "max_price_hour")
    }


def test_a_comparison_is_planned_once_per_request(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """The page asks again when only the price cap or the language changes: the same rows, not planned again."""
    planned = []
    rows = web.planner.compare_rows
    monkeypatch.setattr(web.planner, "compare_rows", lambda request: planned.append(request) or rows(request))
    query = {"model": "llama-2-7b", "method": "lora", "epochs": "2"}
    first = streamed(client, query)
    capped = streamed(client, query | {"max_price_hour": "0.3", "lang": "es"})
    assert len(planned) == 1

    def unworded(lines: list[dict]) -> list[dict]:  # a row without its sentences, which are in the page's language
        return [line["plan"] | {"reasons": None, "suggestions": None} for line in lines]

    assert unworded(first[:-1]) == unworded(capped[:-1])
    under = {row["plan"]["gpu"]["name"]: row["plan"]["gpu"]["rent_usd_per_hour"] for row in capped[:-1]}
    assert capped[-1]["max_price_hour"] == 0.3 and under[capped[-1]["cheapest_under_price"]] <= 0.3
    assert under[first[-1]["cheapest_under_price"]] > 0.3  # without the cap, a dearer card is the cheapest run
    client.get("/api/plan", params=query | {"compare": "true"})  # the JSON answer reads the same comparison
    assert len(planned) == 1
    streamed(client, query | {"epochs": "3"})  # a setting the plans depend on
    assert len(planned) == 2


def test_a_bad_comparison_request_is_one_line_next_to_its_field(client: TestClient) -> None:
    response = client.get("/api/compare", params={"model": "llama-2-7b", "seq_len": "-5"})
    assert response.status_code == 400
    assert response.json()["field"] == "seq_len" and "\n" not in response.json()["error"]
    response = client.get("/api/compare", params={"model": "llama-2-7b", "rent_price": "1"})
    assert response.status_code == 200  # the price of one card: the comparison prices each from the catalog
    assert streamed(client, {"model": "llama-2-7b", "rent_price": "1"})[-1]["error"].startswith("--rent-price")


def test_the_run_of_a_plan_is_a_train_command_and_config_that_pin_its_settings(client: TestClient) -> None:
    import yaml

    query = {"model": "llama-2-7b", "gpu": "RTX 4060 Ti 16GB"}
    plan = client.get("/api/plan", params=query).json()
    run = client.get("/api/run", params=query).json()
    config = yaml.safe_load(run["yaml"])
    for key in ("micro_batch", "grad_accum", "grad_ckpt", "optimizer", "seq_len"):
        assert config[key] == plan["settings"][key]
        assert options.BY_NAME[key].flag in run["command"]
    assert config["batch_size"] == plan["batch_size"]
    assert run["command"].startswith("lorafit train --model MODEL_DIR --data DATA.jsonl")
    checked = options.validate("train", {k: v for k, v in config.items() if k not in ("model", "data")})
    assert checked.micro_batch == plan["settings"]["micro_batch"]


def test_a_train_command_from_the_page_runs_the_plan(
    client: TestClient, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command the page shows for an uploaded config.json, with that model's folder and data filled in,
    passes every check of `lorafit train`."""
    from lorafit.train.demo import build_model, build_tokenizer, corpus, tiny_spec

    tokenizer = build_tokenizer(corpus(), vocab_size=512)
    build_model(tmp_path / "model", tokenizer, tiny_spec(len(tokenizer), hidden_size=64), seed=0)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"q {i}", "output": f"a {i}"}) + "\n" for i in range(64)))
    config = (tmp_path / "model" / "config.json").read_bytes()
    model = client.post("/api/upload?kind=model&name=config.json", content=config).json()["value"]
    command = client.get("/api/run", params={"model": model, "gpu": "rtx-4090"}).json()["command"]
    args = command.replace("MODEL_DIR", str(tmp_path / "model")).replace("DATA.jsonl", str(data)).split()[1:]
    code, out, err = run_cli([*args, "--output-dir", str(tmp_path / "run"), "--dry-run"], capsys)
    assert code == 0, err
    assert not (tmp_path / "run").exists()


BAD_QUERIES = {
    "unknown model": ("/api/plan", {"model": "no-such-model", "gpu": "rtx-4090"}, "model", "no model"),
    "unknown gpu": ("/api/plan", {"model": "llama-2-7b", "gpu": "zzz"}, "gpu", "no GPU 'zzz'"),
    "not a number": ("/api/plan", {"model": "llama-2-7b", "seq_len": "long"}, "seq_len", "whole number"),
    "out of range": ("/api/estimate", {"model": "llama-2-7b", "vram": "-3"}, "vram", "greater than 0"),
    "bad choice": ("/api/plan", {"method": "qlorra"}, "method", "must be one of"),
    "bad bool": ("/api/plan", {"grad_ckpt": "maybe"}, "grad_ckpt", "true or false"),
    "unknown key": ("/api/plan", {"sequence": "2048"}, None, "unknown key 'sequence'"),
    "given twice": ("/api/plan", [("seq_len", "512"), ("seq_len", "1024")], "seq_len", "given twice"),
    "a switch of the other command": ("/api/estimate", {"compare": "true"}, None, "unknown key 'compare'"),
    "json switch": ("/api/plan", {"json": "true"}, "json", "not a setting"),
    "a broken rule": ("/api/plan", {"method": "lora", "quant": "nf4"}, None, "quant"),
    "gpu and vram": ("/api/plan", {"gpu": "rtx-4090", "vram": "8"}, None, "not both"),
    "a local model path": ("/api/plan", {"model": "/etc", "gpu": "rtx-4090"}, "model", "upload"),
    "a local data path": ("/api/plan", {"data": "/etc/passwd", "gpu": "rtx-4090"}, "data", "upload"),
    "a forged upload": ("/api/plan", {"model": "upload:../../etc/x", "gpu": "rtx-4090"}, "model", "not an upload"),
    "a vanished upload": ("/api/plan", {"data": "upload:0123456789abcdef/x.jsonl"}, "data", "upload the file again"),
    "a tokenizer path": ("/api/plan", {"tokenizer": "/tmp"}, "tokenizer", "without a local tokenizer"),
    "run for several plans": ("/api/run", {"compare": "true"}, None, "one plan"),
    "a config file on the server": ("/api/plan", {"from_config": "/etc/passwd"}, "from_config", "not a setting"),
    "a stack not offered": ("/api/estimate", {"stack": "torchtune"}, None, "stack torchtune: not offered"),
    "seq_len past the model": ("/api/plan", {"model": "llama-2-7b", "seq_len": "999999"}, "seq_len", "999999"),
    "a method the stack does not model": (
        "/api/plan",
        {"model": "llama-2-7b", "stack": "unsloth", "method": "full"},
        "method",
        "modelled for",
    ),
    "experts of a dense model": (
        "/api/plan",
        {"model": "llama-2-7b", "lora_targets": "experts"},
        "lora_targets",
        "no experts",
    ),
    "bf16 on a card without it": (
        "/api/plan",
        {"model": "llama-2-7b", "gpu": "t4", "precision": "bf16"},
        "precision",
        "no bf16",
    ),
}


@pytest.mark.parametrize("case", list(BAD_QUERIES))
def test_bad_input_is_a_400_with_one_line_next_to_its_field(case: str, client: TestClient) -> None:
    path, query, field, expected = BAD_QUERIES[case]
    response = client.get(path, params=query)
    assert response.status_code == 400, response.text
    body = response.json()
    assert expected in body["error"] and "\n" not in body["error"] and "Traceback" not in body["error"]
    if field is not None:
        assert body["field"] == field


def test_bad_input_gets_the_clis_own_words(client: TestClient, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(["plan", "--model", "llama-2-7b", "--seq-len", "long"], capsys)
    assert code == 2
    body = client.get("/api/plan", params={"model": "llama-2-7b", "seq_len": "long"}).json()
    assert err.strip() == f"lorafit: error: {body['error']}"
    # the page asks in its language, and gets the field named as the form names it, not the flag
    page = client.get("/api/plan", params={"model": "llama-2-7b", "seq_len": "long", "lang": "en"}).json()
    label = web.strings("en")["label.seq_len"]
    assert page["error"] == body["error"].replace("--seq-len", label) and page["field"] == body["field"] == "seq_len"


def english_in(text: str) -> list[str]:
    """The pieces of the CLI's English sentences (three words or more of their fixed text) found in `text`."""
    pieces = {
        literal.strip()
        for template in messages.EN.values()
        for literal, *_ in string.Formatter().parse(template)
        if len(literal.split()) >= 3
    }
    return [piece for piece in pieces if piece in text]


def labelled_in_english(text: str, language: str) -> str:
    """`text` with the fields' labels of `language` put back in English."""
    english = web.strings("en")
    labels = [(key, label) for key, label in web.strings(language).items() if key.startswith("label.")]
    for key, label in sorted(labels, key=lambda pair: -len(pair[1])):
        text = text.replace(label, english[key])
    return text


@pytest.mark.parametrize("language", ["es", "pt"])
@pytest.mark.parametrize("case", list(BAD_QUERIES))
def test_bad_input_is_refused_in_the_pages_language(case: str, language: str, client: TestClient) -> None:
    """The same 400 and field as in English, its line in the page's language and terms: no English sentence of
    the CLI, no flag."""
    path, query, field, _ = BAD_QUERIES[case]
    items = list(query.items()) if isinstance(query, dict) else list(query)
    english = client.get(path, params=items + [("lang", "en")])
    response = client.get(path, params=items + [("lang", language)])
    assert response.status_code == english.status_code == 400, response.text
    body = response.json()
    assert body["field"] == english.json()["field"]
    assert "\n" not in body["error"] and not re.search(r"--[a-z]", body["error"])
    assert english_in(body["error"]) == [], body["error"]
    assert labelled_in_english(body["error"], language) != english.json()["error"]  # more than the labels changed


# --- uploads --------------------------------------------------------------------------------------------------
CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


@pytest.mark.parametrize("language", ["es", "pt"])
def test_a_mixture_of_experts_line_and_a_pre_quantised_refusal_are_said_in_the_pages_language(
    language: str, client: TestClient
) -> None:
    """The MoE line of a plan, and the refusal of a checkpoint stored in bitsandbytes fp4, in the page's language:
    no English sentence of the CLI left in them."""
    query = {"model": "qwen3-30b-a3b", "gpu": "h100-sxm", "method": "qlora"}
    english = client.get("/api/plan", params=query | {"lang": "en"}).json()["reasons"]
    shown = client.get("/api/plan", params=query | {"lang": language}).json()["reasons"]
    experts = [line for line, said in zip(shown, english, strict=True) if said.startswith("mixture of experts")]
    assert len(experts) == 1 and "128" in experts[0] and english_in(experts[0]) == [], experts
    fp4 = CONFIG | {"quantization_config": {"load_in_4bit": True, "bnb_4bit_quant_type": "fp4"}}
    model = client.post("/api/upload?kind=model&name=config.json", content=json.dumps(fp4).encode()).json()["value"]
    refused = client.get("/api/plan", params={"model": model, "gpu": "rtx-4090", "lang": language})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert "fp4" in error and "NF4" in error and english_in(error) == [], error


def test_an_uploaded_config_is_planned_as_the_cli_plans_that_file(
    client: TestClient, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    uploaded = client.post("/api/upload?kind=model&name=config.json", content=json.dumps(CONFIG).encode())
    assert uploaded.status_code == 200, uploaded.text
    value = uploaded.json()["value"]
    assert re.fullmatch(r"upload:[0-9a-f]{16}/config\.json", value)
    assert uploaded.json()["model"]["num_hidden_layers"] == 22
    served = client.get("/api/plan", params={"model": value, "gpu": "rtx-4090"}).json()
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    local = cli_json(["plan", "--model", str(tmp_path / "config.json"), "--gpu", "rtx-4090"], capsys)
    assert served["estimate"] == local["estimate"] and served["settings"] == local["settings"]
    assert served["model"] | {"name": "-"} == local["model"] | {"name": "-"}  # named after their folders


def test_an_uploaded_dataset_gives_the_plan_of_lorafit_plan_data(
    client: TestClient, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = "".join(json.dumps({"instruction": "word " * i, "output": "answer " * (3 * i)}) + "\n" for i in range(1, 60))
    uploaded = client.post("/api/upload?kind=data&name=my data.jsonl", content=rows.encode())
    assert uploaded.status_code == 200, uploaded.text
    assert uploaded.json()["tokens"]["rows"] == 59
    value = uploaded.json()["value"]
    served = client.get("/api/plan", params={"model": "llama-2-7b", "gpu": "rtx-4090", "data": value}).json()
    (tmp_path / "data.jsonl").write_text(rows)
    local = cli_json(
        ["plan", "--model", "llama-2-7b", "--gpu", "rtx-4090", "--data", str(tmp_path / "data.jsonl")], capsys
    )
    drop_source = {"source": "-"}
    assert served["tokens"] | drop_source == local["tokens"] | drop_source
    assert served["hours"] == local["hours"] and served["settings"] == local["settings"]


def test_a_dataset_with_some_bad_rows_is_planned_without_them_and_says_why(
    client: TestClient, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = [json.dumps({"instruction": "word " * i, "output": "answer " * (3 * i)}) for i in range(1, 48)]
    bad = {5: '{"instruction": ', 20: json.dumps({"instruction": "no answer"}), 30: "not json"}
    rows = list(good)
    for index, row in sorted(bad.items()):
        rows.insert(index, row)
    uploaded = client.post("/api/upload?kind=data&name=mine.jsonl", content=("\n".join(rows) + "\n").encode())
    assert uploaded.status_code == 200, uploaded.text
    skipped = uploaded.json()["skipped"]
    assert (skipped["rows"], skipped["of"]) == (3, 50)
    assert [problem["row"] for problem in skipped["problems"]] == sorted(bad)
    assert skipped["problems"][0]["message"].startswith("mine.jsonl:6 (row 5): invalid JSON")
    assert "missing column 'output'" in skipped["problems"][1]["message"]
    served = client.get(
        "/api/plan", params={"model": "llama-2-7b", "gpu": "rtx-4090", "data": uploaded.json()["value"]}
    )
    assert served.status_code == 200, served.text
    (tmp_path / "good.jsonl").write_text("\n".join(good) + "\n")  # the same file without its bad rows
    local = cli_json(
        ["plan", "--model", "llama-2-7b", "--gpu", "rtx-4090", "--data", str(tmp_path / "good.jsonl")], capsys
    )
    assert served.json()["tokens"]["rows"] == 47 and served.json()["hours"] == local["hours"]


def english_of_rows(text: str) -> list[str]:
    """The fixed words of the sentences about a dataset's rows (lorafit.messages, as the CLI says them) in `text`."""
    keys = [key for key in messages.EN if key.split(".")[0] in ("row", "json", "type", "data")]
    literals = (literal.strip(" ;:(),") for key in keys for literal, *_ in string.Formatter().parse(messages.EN[key]))
    words = {literal for literal in literals if len(literal) >= 5 and any(c.isalpha() for c in literal)}
    return [word for word in words if re.search(rf"(?<!\w){re.escape(word)}(?!\w)", text)]


def test_the_skipped_rows_of_an_upload_are_said_in_the_pages_language(client: TestClient) -> None:
    """An upload with bad rows on the Spanish or Portuguese page says why each row is skipped in that language,
    not in the CLI's English; so does the error of an upload whose every row is bad."""
    good = [json.dumps({"instruction": "word " * i, "output": "answer " * i}) for i in range(1, 20)]
    bad = ['{"instruction": ', json.dumps({"instruction": "no answer"}), json.dumps({"instruction": 3, "output": "x"})]
    body = ("\n".join(bad + good) + "\n").encode()
    english = client.post("/api/upload?kind=data&name=mine.jsonl", content=body).json()["skipped"]["problems"]
    assert "missing column 'output'" in english[1]["message"]  # the English the CLI prints, as it was
    for language in ("es", "pt"):
        uploaded = client.post(f"/api/upload?kind=data&name=mine.jsonl&lang={language}", content=body)
        assert uploaded.status_code == 200, uploaded.text
        shown = [problem["message"] for problem in uploaded.json()["skipped"]["problems"]]
        assert len(shown) == 3 and all(line.startswith("mine.jsonl:") for line in shown), shown
        assert "'output'" in shown[1] and "'instruction'" in shown[2]  # a column keeps its name
        for line in shown:
            assert not english_of_rows(line), (language, line)
        refused = client.post(f"/api/upload?kind=data&name=bad.jsonl&lang={language}", content=b"not json\n")
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error.startswith("bad.jsonl:1 (") and not english_of_rows(error), error


def test_an_uploaded_dataset_is_counted_with_the_chosen_models_chat_template(
    client: TestClient, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The upload's token count is the plan's: the chat template of the model chosen on the page (Qwen2.5's
    default system turn and markers), as `lorafit plan --model ... --data` counts it."""
    rows = "".join(json.dumps({"instruction": "word " * i, "output": "answer " * i}) + "\n" for i in range(1, 30))
    (tmp_path / "data.jsonl").write_text(rows)
    local = cli_json(
        ["plan", "--model", "qwen2.5-7b", "--gpu", "rtx-4090", "--data", str(tmp_path / "data.jsonl")], capsys
    )
    uploaded = client.post("/api/upload?kind=data&name=d.jsonl&model=qwen2.5-7b", content=rows.encode()).json()
    plain = client.post("/api/upload?kind=data&name=d.jsonl", content=rows.encode()).json()
    assert uploaded["tokens"]["total_tokens"] == local["tokens"]["total_tokens"] > plain["tokens"]["total_tokens"]
    assert "chat template of Qwen/Qwen2.5-7B-Instruct" in uploaded["tokens"]["basis"]


BAD_UPLOADS = {
    "malformed config": ("model", "config.json", b"{not json", 400, "config.json is not valid JSON"),
    "config of an unknown family": ("model", "config.json", b'{"model_type": "zz"}', 400, "config.json"),
    "empty": ("data", "d.jsonl", b"", 400, "empty"),
    "not a dataset": ("data", "notes.exe", b"MZ", 400, "a dataset upload is"),
    "no sound row": ("data", "d.jsonl", b'{"instruction": "a"}\n{"instruction": \n', 400, "d.jsonl"),
    "unknown kind": ("weights", "w.bin", b"x", 400, "must be model"),
    "oversized config": ("model", "config.json", b" " * ((1 << 20) + 1), 413, "larger than the 1 MiB"),
}


@pytest.mark.parametrize("case", list(BAD_UPLOADS))
def test_bad_uploads_are_refused_in_one_line(case: str, client: TestClient) -> None:
    kind, name, body, status, expected = BAD_UPLOADS[case]
    response = client.post(f"/api/upload?kind={kind}&name={name}", content=body)
    assert response.status_code == status, response.text
    message = response.json()["error"]
    assert expected in message and "\n" not in message
    assert "lorafit-serve" not in message and str(Path.cwd()) not in message  # no server-side paths


@pytest.mark.parametrize("language", ["es", "pt"])
@pytest.mark.parametrize("case", list(BAD_UPLOADS))
def test_bad_uploads_are_refused_in_the_pages_language(case: str, language: str, client: TestClient) -> None:
    kind, name, body, status, _ = BAD_UPLOADS[case]
    english = client.post(f"/api/upload?kind={kind}&name={name}&lang=en", content=body)
    response = client.post(f"/api/upload?kind={kind}&name={name}&lang={language}", content=body)
    assert response.status_code == english.status_code == status, response.text
    message = response.json()["error"]
    assert "\n" not in message and message != english.json()["error"] and english_in(message) == [], message


DEEP_JSON = b"[" * 100_000 + b"]" * 100_000
LONG_INTEGER = b'{"model_type": "llama", "hidden_size": ' + b"9" * 5000 + b"}"
REJECTED_UPLOADS = {
    "a billion layers": ("model", json.dumps(CONFIG | {"num_hidden_layers": 10**9}).encode(), "num_hidden_layers"),
    "hidden_size 10^30": ("model", json.dumps(CONFIG | {"hidden_size": 10**30}).encode(), "hidden_size"),
    "vocab_size 10^18": ("model", json.dumps(CONFIG | {"vocab_size": 10**18}).encode(), "vocab_size"),
    "hidden_size as text": ("model", json.dumps(CONFIG | {"hidden_size": "2048"}).encode(), "hidden_size"),
    "100,000-deep JSON": ("model", DEEP_JSON, "nested too deeply"),
    "a 5,000-digit integer": ("model", LONG_INTEGER, "digits"),
    "a dataset with no sound row": ("data", b'{"instruction": "a"}\n{"instruction": \n', "d.jsonl"),
}


@pytest.mark.parametrize("case", list(REJECTED_UPLOADS))
def test_a_rejected_upload_is_a_400_and_leaves_nothing_in_the_cache(case: str, tmp_path: Path) -> None:
    kind, body, expected = REJECTED_UPLOADS[case]
    client = TestClient(web.create_app(tmp_path), base_url=SERVED_AT)
    name = "config.json" if kind == "model" else "d.jsonl"
    response = client.post(f"/api/upload?kind={kind}&name={name}", content=body)
    assert response.status_code == 400, response.text
    message = response.json()["error"]
    assert expected in message and "\n" not in message and str(tmp_path) not in message
    assert files_under(tmp_path) == []


def test_an_upload_and_its_plan_name_the_upload_not_where_the_server_keeps_it(tmp_path: Path) -> None:
    client = TestClient(web.create_app(tmp_path), base_url=SERVED_AT)
    rows = "".join(json.dumps({"instruction": "word " * i, "output": "answer " * i}) + "\n" for i in range(1, 20))
    data = client.post("/api/upload?kind=data&name=rows.jsonl", content=rows.encode())
    model = client.post("/api/upload?kind=model&name=config.json", content=json.dumps(CONFIG).encode())
    assert data.status_code == model.status_code == 200
    query = {"model": model.json()["value"], "data": data.json()["value"], "gpu": "rtx-4090"}
    answers = [data, model, client.get("/api/plan", params=query), client.get("/api/run", params=query)]
    for response in answers:
        assert response.status_code == 200, response.text
        assert str(tmp_path) not in response.text
    assert data.json()["tokens"]["source"] == data.json()["value"]


# --- who may ask -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "headers",
    [
        {"origin": "https://evil.example"},
        {"origin": "http://evil.example:8765"},
        {"origin": "http://127.0.0.1:9999"},
        {"origin": "null"},
        {"sec-fetch-site": "cross-site"},
        {"sec-fetch-site": "same-site"},
    ],
    ids=["another site", "another site, same port", "another port", "a sandboxed page", "cross-site", "same-site"],
)
def test_another_page_cannot_upload(headers: dict[str, str], tmp_path: Path) -> None:
    """A page the user has open elsewhere may POST `text/plain` without a CORS preflight: the server refuses it."""
    client = TestClient(web.create_app(tmp_path), base_url=SERVED_AT)
    body = json.dumps(CONFIG).encode()
    response = client.post(
        "/api/upload?kind=model&name=config.json", content=body, headers={"content-type": "text/plain", **headers}
    )
    assert response.status_code == 403, response.text
    assert "may not change this server" in response.json()["error"] and "\n" not in response.json()["error"]
    assert files_under(tmp_path) == []
    own_page = {"origin": SERVED_AT, "sec-fetch-site": "same-origin"}
    assert client.post("/api/upload?kind=model&name=config.json", content=body, headers=own_page).status_code == 200


@pytest.mark.parametrize(
    ("listening", "host", "answered"),
    [
        (("127.0.0.1", 8765), "127.0.0.1:8765", True),
        (("127.0.0.1", 8765), "localhost:8765", True),
        (("127.0.0.1", 8765), "[::1]:8765", True),
        (("127.0.0.1", 8765), "evil.example:8765", False),  # a name made to point at 127.0.0.1
        (("127.0.0.1", 8765), "127.0.0.1:9999", False),
        (("127.0.0.1", 8765), "", False),
        (("192.0.2.7", 8765), "192.0.2.7:8765", True),
        (("192.0.2.7", 8765), "localhost:8765", False),
        (("0.0.0.0", 8765), "my-box.lan:8765", True),
    ],
)
def test_a_request_addressed_to_another_name_is_refused(
    listening: tuple[str, int], host: str, answered: bool, tmp_path: Path
) -> None:
    client = TestClient(web.create_app(tmp_path, *listening), base_url=SERVED_AT)
    response = client.get("/api/options", headers={"host": host})
    assert response.status_code == (200 if answered else 403), response.text
    if not answered:
        assert "not this server's address" in response.json()["error"] and "\n" not in response.json()["error"]


def test_on_every_network_an_upload_must_come_from_the_page_of_the_name_it_was_sent_to(tmp_path: Path) -> None:
    client = TestClient(web.create_app(tmp_path, "0.0.0.0", 8765), base_url="http://my-box.lan:8765")
    body = json.dumps(CONFIG).encode()
    sent = {"origin": "http://my-box.lan:8765"}
    assert client.post("/api/upload?kind=model&name=config.json", content=body, headers=sent).status_code == 200
    other = {"origin": "http://evil.example"}
    assert client.post("/api/upload?kind=model&name=config.json", content=body, headers=other).status_code == 403


@pytest.mark.parametrize("case", ["busy port", "address not on this machine"])
def test_serve_where_it_cannot_listen_is_one_line(
    case: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import socket

    import uvicorn

    started: list = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: started.append(kwargs))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["--port", str(port)] if case == "busy port" else ["--host", "192.0.2.7"]  # TEST-NET-1: never local
        code, out, err = run_cli(["serve", *args], capsys)
    assert code == 2 and err.startswith("lorafit: error: ") and err.count("\n") == 1, err
    assert ("--port" if case == "busy port" else "--host 192.0.2.7") in err
    assert started == [] and out == ""


# --- the page and its languages --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("header", "query", "language"),
    [
        ("es-MX,es;q=0.9,en;q=0.8", "", "es"),
        ("pt-BR", "", "pt"),
        ("de-DE,de;q=0.9,pt;q=0.5", "", "pt"),
        ("en-US,es;q=0.5", "", "en"),
        ("fr", "", "en"),
        ("", "", "en"),
        ("es-MX", "?lang=pt", "pt"),
        ("pt-BR", "?lang=xx", "pt"),
        ("es;q=0.2,pt;q=0.8", "", "pt"),
    ],
)
def test_the_page_comes_in_the_browsers_language_unless_lang_says_otherwise(
    header: str, query: str, language: str, client: TestClient
) -> None:
    response = client.get("/" + query, headers={"accept-language": header})
    assert response.status_code == 200
    assert f'<html lang="{language}"' in response.text
    assert response.headers["content-language"] == language


def test_every_key_exists_in_all_three_languages() -> None:
    tables = {language: web.strings(language) for language in web.LANGUAGES}
    english = set(tables["en"])
    for language, table in tables.items():
        assert set(table) == english, (language, set(table) ^ english)
        for key, text in table.items():
            assert text.strip(), (language, key)
            assert set(re.findall(r"\{[a-z_]+\}", text)) == set(re.findall(r"\{[a-z_]+\}", tables["en"][key])), key
    fields = {o.name for o in web.form_options()}
    assert {f"label.{name}" for name in fields} | {f"help.{name}" for name in fields} <= english
    assert tables["es"]["label.seq_len"] != tables["en"]["label.seq_len"] != tables["pt"]["label.seq_len"]


CLI_WORDS = re.compile(r"--[a-z]|`|lorafit (models|gpus|stacks|train|plan)|\\bplan and train\\b|the detected GPU")


@pytest.mark.parametrize("language", web.LANGUAGES)
def test_the_forms_help_is_the_pages_not_the_clis(language: str, client: TestClient) -> None:
    """Every field has a help (and a default where the declaration has one) in the page's terms: no flag, no CLI
    command, no "plan and train:"."""
    table = client.get(f"/api/strings/{language}").json()
    for option in web.form_options():
        assert table[f"help.{option.name}"].strip(), option.name
        assert not CLI_WORDS.search(table[f"help.{option.name}"]), (option.name, table[f"help.{option.name}"])
        if option.auto:
            assert not CLI_WORDS.search(table[f"default.{option.name}"]), (option.name, table[f"default.{option.name}"])
    assert client.get("/api/strings/xx").status_code == 400


def test_every_sentence_of_the_planner_is_translated() -> None:
    """Each sentence the CLI says (lorafit.messages) has its es and pt version with the same parameters: a sentence
    added without them fails here, and would show in English on those pages."""
    for language in ("es", "pt"):
        catalog = web.message_catalog(language)
        assert set(catalog) == set(messages.EN), (language, set(catalog) ^ set(messages.EN))
        for key, text in catalog.items():
            english_params = {name for _, name, _, _ in string.Formatter().parse(messages.EN[key]) if name}
            assert {name for _, name, _, _ in string.Formatter().parse(text) if name} == english_params, key
            assert text != messages.EN[key] or key == "error.setting", (language, key)


def test_a_sentence_is_read_back_into_its_key_and_rendered_in_another_language() -> None:
    english = messages.say(
        "plan.batch_larger",
        accum=messages.say("plan.accum", micro_batch=4, grad_accum=4),
        batch=16,
        larger=messages.say("plan.larger_needs", micro_batch=8, peak=18.24),
    )
    assert english == "micro-batch 4 x gradient accumulation 4 = effective batch 16: micro-batch 8 would need 18.2 GiB"
    assert web.in_language(english, "es") == (
        "micro-batch 4 × acumulación de gradientes 4 = batch efectivo 16: el micro-batch 8 necesitaría 18,2 GiB"
    )
    assert web.in_language("RTX 4090", "pt") == "RTX 4090"  # a name is no sentence: as it is
    assert web.in_language(messages.say("gpu.by_memory", gb=8), "pt") == "GPU de 8 GB"


def test_the_form_is_the_declaration_of_lorafit_plan(client: TestClient) -> None:
    declared = client.get("/api/options").json()
    rows = {row["name"]: row for row in declared["options"]}
    assert set(rows) == {o.name for o in options.for_command("plan") if o.config}
    assert rows["method"]["choices"] == list(options.BY_NAME["method"].choices)
    assert rows["seq_len"]["default"] == options.DEFAULT_SEQ_LEN
    assert "llama-3.1-8b" in declared["models"] and any(g["name"] == "RTX 4090" for g in declared["gpus"])


def test_the_page_and_its_files_ship_in_the_package(client: TestClient) -> None:
    html = client.get("/").text
    for asset in re.findall(r'(?:src|href)="(/static/[^"]+)"', html):
        assert client.get(asset).status_code == 200, asset
    assert "http://" not in html and "https://" not in html  # nothing from the internet
    script = client.get("/static/app.js").text
    assert "https://" not in script and "http://" not in script


def test_serve_binds_to_loopback_by_default(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import uvicorn

    seen: dict = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: seen.update(kwargs))
    monkeypatch.setattr(web, "check_can_listen", lambda host, port: None)  # 8765 may be taken on this machine
    code, out, _ = run_cli(["serve"], capsys)
    assert code == 0 and seen["host"] == "127.0.0.1" and seen["port"] == 8765
    assert "http://127.0.0.1:8765/" in out
    code, out, _ = run_cli(["serve", "--host", "0.0.0.0", "--port", "9000"], capsys)
    assert seen["host"] == "0.0.0.0" and "reachable from other machines" in out
    code, _, err = run_cli(["serve", "--port", "70000"], capsys)
    assert code == 2 and err.count("\n") == 1 and "--port" in err


def test_every_part_of_the_breakdown_has_a_name_in_every_language() -> None:
    from lorafit import hardware, memory, models
    from lorafit.schema import Settings

    script = (web.STATIC / "app.js").read_text()
    stacked = set(
        re.findall(
            r'"([a-z_]+)"', script[script.index("const PARTS") : script.index("];", script.index("const PARTS"))]
        )
    )
    spec = models.resolve("llama-3.1-8b")
    for settings in (
        Settings(),
        Settings(optimizer="paged_adamw_8bit"),
        Settings(n_gpus=2, shard="fsdp", micro_batch=1),
    ):
        parts = set(memory.estimate(spec, settings, hardware.resolve("rtx-4090")).breakdown_gib)
        assert parts <= stacked, parts - stacked
    for language in web.LANGUAGES:
        assert {f"ui.part.{part}" for part in stacked} <= set(web.strings(language)), language
