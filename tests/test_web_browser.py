"""`lorafit serve`'s page in a real browser (the system's Chromium, driven by Playwright; nothing is downloaded):
the two headline cases filled in the form equal the CLI's JSON, the what-if controls move the chart, a shared URL
reopens the same state, the languages switch, and bad input shows next to its field.

Set LORAFIT_SCREENSHOTS=DIR to keep the screenshots there (`make screenshots` writes docs/)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qsl, urlparse

import pytest

from conftest import run_cli
from lorafit import memory, model_spec, models, search, serving

CHROMIUM = next((path for name in ("chromium", "chromium-browser") if (path := shutil.which(name))), None)
if CHROMIUM is None and os.environ.get("LORAFIT_BROWSER_REQUIRED") != "1":
    pytest.skip("no chromium on this machine (.ci/run installs it)", allow_module_level=True)

pytest.importorskip("playwright.sync_api")
from playwright.sync_api import Browser, Page, expect, sync_playwright  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    import uvicorn

    from lorafit.web import create_app

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    app = create_app(tmp_path_factory.mktemp("uploads"))
    running = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=running.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not running.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    running.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    assert CHROMIUM, "LORAFIT_BROWSER_REQUIRED is set and there is no chromium"
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield launched
        launched.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(locale="en-US", viewport={"width": 1280, "height": 1000})
    opened = context.new_page()
    errors: list[str] = []
    opened.on("pageerror", lambda error: errors.append(str(error)))
    yield opened
    context.close()
    assert not errors, errors  # no script error on the page


def cli_plan(capsys: pytest.CaptureFixture[str], *flags: str) -> dict:
    code, out, err = run_cli(["plan", *flags, "--json"], capsys)
    assert code == 0, err
    return json.loads(out)


def wait_for_plan(page: Page, gpu: str) -> None:
    expect(page.locator("#verdict")).to_contain_text(gpu, timeout=20_000)
    page.wait_for_function("document.querySelectorAll('#chart .segment').length > 0")


def chart(page: Page) -> dict[str, float]:
    return {
        segment.get_attribute("data-part"): float(segment.get_attribute("data-gib"))
        for segment in page.locator("#chart .segment").all()
    }


def shoot(page: Page, name: str, tmp_path: Path) -> None:
    folder = Path(os.environ.get("LORAFIT_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.png"
    page.screenshot(path=str(path), full_page=False)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("gpu", "fits"), [("RTX 4090", True), ("RTX 4060 Ti 16GB", True)])
def test_the_headline_cases_filled_in_the_form_are_the_clis_plans(
    gpu: str, fits: bool, server: str, page: Page, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    page.goto(server + "/?model=tinyllama-1.1b&gpu=A40")  # start elsewhere: the form must change the plan
    wait_for_plan(page, "A40")
    page.fill("#f-model", "llama-2-7b")
    page.locator("#f-model").dispatch_event("change")
    page.select_option("#f-method", "qlora")
    page.select_option("#f-gpu", gpu)
    wait_for_plan(page, gpu)
    expected = cli_plan(capsys, "--model", "llama-2-7b", "--method", "qlora", "--gpu", gpu)
    expect(page.locator("#verdict")).to_have_attribute("data-fits", "true" if fits else "false")
    assert expected["fits"] is fits
    shown = {part: gib for part, gib in expected["estimate"]["breakdown_gib"].items() if gib > 0}
    assert chart(page) == pytest.approx(shown, abs=1e-9)
    device = float(page.get_attribute("#total-device", "data-gib"))
    assert device == expected["estimate"]["peak_device_gib"]
    verdict = page.inner_text("#verdict")
    assert f"micro-batch {expected['micro_batch']} × accumulation {expected['grad_accum']}" in verdict
    assert f"{expected['estimate']['peak_device_gib']:.2f} GiB" in verdict
    reasons = [item.text_content() for item in page.locator("#reasons li").all()]  # in a closed <details>
    assert reasons == expected["reasons"]
    expect(page.locator("#train-command")).to_contain_text(f"--micro-batch {expected['micro_batch']}")
    shoot(page, f"serve-{gpu.lower().replace(' ', '-')}", tmp_path)


def test_a_what_if_control_changes_the_chart_at_once(server: str, page: Page) -> None:
    page.goto(server + "/?model=llama-2-7b&gpu=RTX+4060+Ti+16GB")
    wait_for_plan(page, "RTX 4060 Ti 16GB")
    before = float(page.get_attribute("#total-device", "data-gib"))
    expect(page.locator("#whatif-badge")).to_be_hidden()
    page.fill("#whatif-micro_batch", "16")
    page.wait_for_function(f"Number(document.querySelector('#total-device').dataset.gib) > {before}")
    expect(page.locator("#whatif-badge")).to_be_visible()
    settings = page.evaluate("page.plan.settings")
    # as the page sends them: a setting left to the stack (null) is not sent
    query = {k: v for k, v in settings.items() if v is not None}
    query |= {"micro_batch": 16, "model": "llama-2-7b", "gpu": "RTX 4060 Ti 16GB"}
    answer = page.evaluate("q => fetch('/api/estimate?' + new URLSearchParams(q)).then(r => r.json())", query)
    assert float(page.get_attribute("#total-device", "data-gib")) == answer["peak_device_gib"]
    assert page.get_attribute("#chart", "data-fits") == str(answer["fits"]).lower()
    page.click("#whatif-reset")
    expect(page.locator("#total-device")).to_have_attribute("data-gib", str(before))


def test_the_what_if_length_takes_the_forms_values(server: str, page: Page) -> None:
    # a 3000-token plan: touching checkpointing alone keeps 3000 tokens, not the next power of two
    page.goto(server + "/?model=llama-2-7b&gpu=A40&seq_len=3000")
    wait_for_plan(page, "A40")
    assert page.input_value("#whatif-seq_len") == "3000"
    with page.expect_request(lambda request: "/api/estimate?" in request.url) as sent:
        page.click("#whatif-grad_ckpt")
    asked = dict(parse_qsl(urlparse(sent.value.url).query))
    assert asked["seq_len"] == "3000" and asked["grad_ckpt"] == "true"
    settings = {k: v for k, v in page.evaluate("page.plan.settings").items() if v is not None}
    answer = page.evaluate(
        "q => fetch('/api/estimate?' + new URLSearchParams(q)).then(r => r.json())",
        settings | {"grad_ckpt": True, "model": "llama-2-7b", "gpu": "A40"},
    )
    expect(page.locator("#total-device")).to_have_attribute("data-gib", str(answer["peak_device_gib"]))
    assert answer["settings"]["seq_len"] == 3000
    page.fill("#whatif-seq_len", "2500")  # any length the form takes
    with page.expect_request(lambda request: "/api/estimate?" in request.url and "seq_len=2500" in request.url):
        pass


def test_a_shared_url_reopens_the_same_plan(server: str, browser: Browser, page: Page) -> None:
    page.goto(server + "/")
    wait_for_plan(page, "RTX 4090")
    page.select_option("#f-gpu", "A40")
    page.click("#advanced summary")
    page.select_option("#f-optimizer", "paged_adamw_8bit")
    page.fill("#f-seq_len", "1024")
    page.locator("#f-seq_len").dispatch_event("change")
    expect(page.locator("#verdict")).to_contain_text("sequence 1,024", timeout=20_000)
    link = page.url
    assert "seq_len=1024" in link and "optimizer=paged_adamw_8bit" in link and "gpu=A40" in link
    verdict = page.inner_text("#verdict")
    other = browser.new_context(locale="en-US").new_page()
    other.goto(link)
    expect(other.locator("#verdict")).to_have_text(verdict, timeout=20_000)
    assert other.input_value("#f-seq_len") == "1024" and other.input_value("#f-optimizer") == "paged_adamw_8bit"
    other.context.close()


def test_the_languages_switch_and_numbers_follow_the_locale(server: str, page: Page, tmp_path: Path) -> None:
    from lorafit.web import strings

    page.goto(server + "/?model=llama-2-7b&gpu=RTX+4090")
    wait_for_plan(page, "RTX 4090")
    peak = float(page.get_attribute("#total-device", "data-gib"))
    for language, decimal in (("es", ","), ("pt", ",")):
        page.select_option("#lang-select", language)
        expect(page.locator("html")).to_have_attribute("lang", language)
        words = strings(language)
        expect(page.locator("#verdict")).to_contain_text(words["ui.fits"].replace("{gpu}", "RTX 4090"))
        expect(page.locator("label[for=f-seq_len]")).to_have_text(words["label.seq_len"])
        expect(page.locator("#help-seq_len")).to_contain_text(words["default.seq_len"])
        assert f"{peak:.2f}".replace(".", decimal) in page.inner_text("#verdict")
        assert f"lang={language}" in page.url
    shoot(page, "serve-pt", tmp_path)


def test_the_page_opens_in_the_browsers_language(server: str, browser: Browser) -> None:
    from lorafit.web import strings

    context = browser.new_context(locale="es-MX")
    opened = context.new_page()
    opened.goto(server + "/?model=llama-2-7b&gpu=RTX+4090")
    expect(opened.locator("html")).to_have_attribute("lang", "es")
    expect(opened.locator("h1")).to_have_text(strings("es")["ui.title"])
    context.close()


def test_bad_input_shows_the_clis_message_next_to_its_field(
    server: str, page: Page, capsys: pytest.CaptureFixture[str]
) -> None:
    page.goto(server + "/")
    wait_for_plan(page, "RTX 4090")
    page.fill("#f-seq_len", "999999")
    page.locator("#f-seq_len").dispatch_event("change")
    error = page.locator("#error-seq_len")
    expect(error).to_be_visible(timeout=20_000)
    code, _, err = run_cli(["plan", "--model", "llama-2-7b", "--gpu", "RTX 4090", "--seq-len", "999999"], capsys)
    # the CLI's sentence, each setting named as the form labels its field
    said = err.strip().removeprefix("lorafit: error: ").replace("--seq-len", page.inner_text("label[for=f-seq_len]"))
    said = said.replace("stack lorafit", page.text_content("label[for=f-stack]") + " lorafit")
    assert code == 2 and error.inner_text() == said
    expect(page.locator("#f-seq_len")).to_have_attribute("aria-invalid", "true")
    page.fill("#f-seq_len", "512")
    page.locator("#f-seq_len").dispatch_event("change")
    expect(error).to_be_hidden(timeout=20_000)


def test_the_gpu_table_sorts_and_every_control_has_a_label(server: str, page: Page) -> None:
    page.goto(server + "/?model=llama-2-7b&gpu=RTX+4090")
    wait_for_plan(page, "RTX 4090")
    page.wait_for_function("page.compared !== null", timeout=60_000)  # every row in
    header = page.locator("#gpus th[data-sort=tokens_per_s] button")
    header.focus()
    page.keyboard.press("Enter")  # by keyboard
    expect(page.locator("#gpus th[data-sort=tokens_per_s]")).to_have_attribute("aria-sort", "descending")
    order = page.evaluate("[...document.querySelectorAll('#gpus tbody tr')].map(r => r.dataset.gpu)")
    plans = {p["gpu"]["name"]: p["tokens_per_s"] for p in page.evaluate("page.gpuRows")}
    assert [plans[name] for name in order] == sorted(plans.values(), reverse=True)
    unlabelled = page.evaluate(
        """[...document.querySelectorAll('input, select')].filter(c =>
             !document.querySelector(`label[for="${c.id}"]`) && !c.closest('label')).map(c => c.id)"""
    )
    assert unlabelled == []


def test_a_dropped_dataset_and_an_uploaded_config_are_planned(
    server: str, page: Page, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "mine.jsonl"
    data.write_text(
        "".join(json.dumps({"instruction": "q " * i, "output": "a " * (5 * i)}) + "\n" for i in range(1, 40))
    )
    page.goto(server + "/?model=llama-2-7b&gpu=RTX+4090")
    wait_for_plan(page, "RTX 4090")
    page.set_input_files("#f-data", str(data))
    expect(page.locator("#uploaded-data")).to_contain_text("39", timeout=20_000)
    page.wait_for_function("page.plan && page.plan.tokens && page.plan.tokens.rows === 39")
    expected = cli_plan(capsys, "--model", "llama-2-7b", "--gpu", "RTX 4090", "--data", str(data))
    assert page.evaluate("page.plan.hours") == expected["hours"]
    assert "data=upload" in page.url

    from test_web import CONFIG

    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIG))
    page.set_input_files("#upload-model", str(config))
    expect(page.locator("#uploaded-model")).to_be_visible(timeout=20_000)
    page.wait_for_function("page.plan && page.plan.model.num_hidden_layers === 22")
    expected = cli_plan(capsys, "--model", str(config), "--gpu", "RTX 4090", "--data", str(data))
    assert page.evaluate("page.plan.estimate") == expected["estimate"]
    # named by what the config describes, never by the digest the server stores it under
    spec = models.from_config_json(config)
    expect(page.locator("#uploaded-model")).to_contain_text(f"{spec.architecture}, {spec.num_params / 1e9:.1f}B")
    expect(page.locator("#verdict")).to_contain_text(f"{spec.architecture}, {spec.num_params / 1e9:.1f}B")
    digest = page.evaluate("page.values.model").removeprefix("upload:").split("/")[0]
    assert page.input_value("#f-model") == "" and digest not in page.inner_text("main")


def test_on_a_phone_in_dark_mode_nothing_runs_off_the_screen(server: str, browser: Browser, tmp_path: Path) -> None:
    context = browser.new_context(locale="es-MX", viewport={"width": 390, "height": 844}, color_scheme="dark")
    phone = context.new_page()
    phone.goto(server + "/?model=llama-3.1-8b&vram=8")
    expect(phone.locator("#verdict")).to_have_attribute("data-fits", "true", timeout=20_000)
    expect(phone.locator("html")).to_have_attribute("data-theme", "dark")
    assert phone.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    phone.locator("#chart-box").scroll_into_view_if_needed()
    shoot(phone, "serve-phone-dark-es", tmp_path)
    phone.click("#theme-toggle")  # the switch, remembered for the next visit
    expect(phone.locator("html")).to_have_attribute("data-theme", "light")
    phone.reload()
    expect(phone.locator("html")).to_have_attribute("data-theme", "light")
    context.close()


@pytest.mark.parametrize(
    ("query", "language"),
    [
        ("model=llama-2-7b&gpu=RTX+4090", "en"),
        ("model=llama-3.1-8b&vram=8", "es"),
        ("model=tinyllama-1.1b&vram=4&method=full", "pt"),
    ],
)
def test_the_headline_is_yes_tight_or_no_in_the_pages_language(
    query: str, language: str, server: str, page: Page, capsys: pytest.CaptureFixture[str]
) -> None:
    from lorafit.web import strings

    flags = [part for pair in parse_qsl(query) for part in (f"--{pair[0].replace('_', '-')}", pair[1])]
    expected = cli_plan(capsys, *flags)
    page.goto(f"{server}/?{query}&lang={language}")
    word = page.locator("#verdict-word")
    expect(word).to_have_attribute("data-verdict", expected["verdict"], timeout=20_000)
    words = strings(language)
    expect(word).to_have_text(words[f"ui.verdict_{expected['verdict']}"])
    assert len({words["ui.verdict_fits"], words["ui.verdict_tight"], words["ui.verdict_no"]}) == 3
    time = page.locator("#time-line")
    if expected["fits"]:  # the time, what it is for (tokens and where they came from), the speed and the cost
        expect(time).to_contain_text(words["ui.tokens_default"])
        for figure in (expected["tokens_per_s"], expected["tokens_per_epoch"]):  # as the page's locale writes them
            assert page.evaluate(f"number({figure}, 0)") in time.inner_text()
        assert page.evaluate(f"money({expected['cost_local_usd']})") in time.inner_text()
        if expected["break_even_runs"]:  # buy or rent
            shown = page.evaluate(f"number({expected['break_even_runs']}, 0)")
            assert words["ui.break_even_line"].replace("{n}", shown) in time.inner_text()
    else:
        expect(time).to_be_hidden()
    if expected["verdict"] == "tight":
        expect(page.locator("#tight-line")).to_be_visible()
    changes_verdict = any(bool(t["fits"]) != expected["fits"] for t in expected["trainers"])
    trainers = page.locator("#trainers-line")
    if changes_verdict:  # which trainers it fits with
        fitting = [t["stack"] for t in expected["trainers"] if t["fits"]]
        expect(trainers).to_contain_text(
            ", ".join(([expected["settings"]["stack"]] if expected["fits"] else []) + fitting)
        )
    else:
        expect(trainers).to_be_hidden()


def test_the_time_says_where_its_tokens_came_from(server: str, page: Page) -> None:
    page.goto(server + "/?model=llama-2-7b&gpu=RTX+4090&tokens_per_epoch=2000000")
    expect(page.locator("#time-line")).to_contain_text(
        "2,000,000 tokens (the dataset size you entered)", timeout=20_000
    )


def test_no_train_command_for_a_plan_that_does_not_fit(server: str, page: Page) -> None:
    page.goto(server + "/?model=tinyllama-1.1b&vram=4&method=full")
    expect(page.locator("#verdict")).to_have_attribute("data-fits", "false", timeout=20_000)
    plan = page.evaluate("page.plan")
    first = plan["suggestions"][0]
    expect(page.locator("#run-instead")).to_contain_text(first["change"])
    command = page.locator("#train-command")
    expect(command).not_to_be_empty(timeout=20_000)
    nearest = page.evaluate("nearestFitting(page.plan).values")
    fitting = page.evaluate("q => fetch('/api/plan?' + new URLSearchParams(q)).then(r => r.json())", nearest)
    ran = page.evaluate("q => fetch('/api/run?' + new URLSearchParams(q)).then(r => r.json())", nearest)
    assert fitting["fits"] and fitting["gpu"]["name"] == (first["gpu"] or plan["gpu"]["name"])
    assert command.inner_text() == ran["command"]
    page.select_option("#lang-select", "es")  # in another language: the same command, the words translated
    expect(page.locator("#run-instead")).to_contain_text(first["change"])
    expect(page.locator("#run-instead")).not_to_contain_text("This plan does not fit")
    expect(command).to_have_text(ran["command"])
    page.select_option("#lang-select", "en")
    # the plan that fits on the card shows its own command and no "instead"
    page.select_option("#f-gpu", "RTX 5090")
    expect(page.locator("#verdict")).to_have_attribute("data-fits", "true", timeout=20_000)
    expect(page.locator("#run-instead")).to_be_hidden()


def test_the_70b_table_names_every_card_a_row_needs(server: str, page: Page) -> None:
    page.goto(server + "/?model=llama-2-70b&gpu=RTX+4090&max_price_hour=1")
    wait_for_plan(page, "RTX 4090")
    page.wait_for_function("page.compared !== null", timeout=300_000)  # the comparison of every card, complete
    rows = {plan["gpu"]["name"]: plan for plan in page.evaluate("page.gpuRows")}
    several = [name for name, plan in rows.items() if plan["settings"]["n_gpus"] > 1]
    assert several, "a 70B job needs several of the small cards"
    for name, plan in rows.items():
        cell = page.locator(f'#gpus tbody tr[data-gpu="{name}"] td').first.inner_text()
        settings = plan["settings"]
        if settings["n_gpus"] > 1:
            assert cell.startswith(f"{settings['n_gpus']}x {name}, {settings['shard'].upper()}"), cell
            assert ("offload" in cell) == (settings["offload"] != "none"), cell
        else:
            assert cell.startswith(name) and "x " not in cell.removeprefix(name)[:3], cell
    mine = page.locator("#gpus tbody tr.mine")
    expect(mine).to_have_count(1)
    expect(mine).to_have_attribute("data-gpu", "RTX 4090")
    under = page.evaluate("page.cheapestUnderPrice")
    if under:
        expect(page.locator("#price-cap")).to_contain_text(under)
        assert rows[under]["settings"]["n_gpus"] == 1 or f"{rows[under]['settings']['n_gpus']}x" in page.inner_text(
            "#price-cap"
        )
    cheapest = page.evaluate("page.cheapest")
    n = rows[cheapest]["settings"]["n_gpus"]
    expect(page.locator("#cheapest")).to_contain_text(f"{n}x {cheapest}" if n > 1 else cheapest)


def test_my_card_waits_for_its_memory_and_a_typed_memory_switches_to_it(server: str, page: Page) -> None:
    from lorafit.web import strings

    page.goto(server + "/?model=llama-2-7b&gpu=RTX+4090")
    wait_for_plan(page, "RTX 4090")
    page.wait_for_function("page.compared !== null", timeout=60_000)  # the comparison of this plan is in
    asked: list[str] = []
    page.on("request", lambda request: asked.append(request.url) if "/api/plan?" in request.url else None)
    page.select_option("#f-gpu", "")
    expect(page.locator("#error-vram")).to_have_text(strings("en")["ui.type_vram"])
    page.wait_for_timeout(1000)
    assert asked == []  # no plan for some other card while the number is missing
    page.fill("#f-vram", "12")
    wait_for_plan(page, "12 GB GPU")
    expect(page.locator("#error-vram")).to_be_hidden()
    page.select_option("#f-gpu", "A40")  # a catalog card drops the typed memory
    wait_for_plan(page, "A40")
    assert page.input_value("#f-vram") == ""
    page.fill("#f-vram", "16")  # and typed memory drops the catalog card
    wait_for_plan(page, "16 GB GPU")
    assert page.input_value("#f-gpu") == "" and "gpu=" not in page.url
    expect(page.locator("#form-error")).to_be_hidden()


def test_serving_context_changes_what_the_card_runs_afterwards(server: str, page: Page) -> None:
    page.goto(server + "/?model=llama-2-7b&gpu=RTX+4060+Ti+16GB")
    wait_for_plan(page, "RTX 4060 Ti 16GB")
    row = page.locator('#serving tbody tr[data-format="gguf q4_k_m"] td').nth(2)
    before = row.inner_text()
    expect(page.locator("#serving-caption")).to_contain_text("4,096")
    page.goto(server + "/?model=llama-2-7b&gpu=RTX+4060+Ti+16GB&serve_context=1024")
    expect(page.locator("#serving-caption")).to_contain_text("1,024", timeout=20_000)
    assert row.inner_text() != before


def test_a_dataset_with_some_bad_rows_is_used_with_a_line_that_says_why(
    server: str, page: Page, tmp_path: Path
) -> None:
    good = [json.dumps({"instruction": "q " * i, "output": "a " * (5 * i)}) for i in range(1, 48)]
    rows = (
        good[:5]
        + ['{"instruction": ']
        + good[5:19]
        + [json.dumps({"instruction": "x"})]
        + good[19:28]
        + ["oops"]
        + good[28:]
    )
    data = tmp_path / "some-bad.jsonl"
    data.write_text("\n".join(rows) + "\n")
    page.goto(server + "/?model=llama-2-7b&gpu=RTX+4090")
    wait_for_plan(page, "RTX 4090")
    page.set_input_files("#f-data", str(data))
    line = page.locator("#skipped-rows")
    expect(line).to_contain_text("3 of 50 rows skipped", timeout=20_000)
    expect(line).to_contain_text("some-bad.jsonl:6 (row 5): invalid JSON")
    expect(line).to_contain_text("missing column 'output'")
    page.wait_for_function("page.plan && page.plan.tokens && page.plan.tokens.rows === 47")
    expect(page.locator("#form-error")).to_be_hidden()


PLAN_TIMED = """async (gpus) => {
  const took = [];
  for (const gpu of gpus) {
    const started = performance.now();
    const response = await fetch(`/api/plan?model=llama-2-7b&gpu=${encodeURIComponent(gpu)}`);
    await response.json();
    took.push(performance.now() - started);
  }
  return took;
}"""


def test_a_plan_answers_within_a_second_while_a_70b_comparison_runs(server: str, browser: Browser, page: Page) -> None:
    """The issue's acceptance line. The comparison plans in its own pool and a plan request in another, so the
    plan does not wait for it: each plan answers while the comparison is still filling the other user's table, in
    a small share of the comparison's time, and the median plan under 1 s (0.06 s alone on two idle cores)."""
    page.goto(server + "/?model=llama-2-7b&gpu=RTX+4090")
    wait_for_plan(page, "RTX 4090")
    page.wait_for_function("page.compared !== null", timeout=60_000)  # this page's own table is done
    alone = page.evaluate(PLAN_TIMED, ["RTX 3090"])
    for memo in (model_spec._memoised, memory.activation_bytes_per_layer, search._estimate_anywhere, search._settings):
        memo.cache_clear()  # the comparison starts cold, as on a fresh server, whatever other tests planned
    serving.gguf_weight_bytes.cache_clear()
    other = browser.new_context(locale="en-US").new_page()
    # epochs 2.5: a comparison no other test asks for, so it is planned now rather than read from the cache
    other.goto(server + "/?model=llama-2-70b&gpu=H100+SXM&epochs=2.5")
    other.wait_for_function("page.comparing !== null", timeout=20_000)
    started = time.monotonic()
    took = page.evaluate(PLAN_TIMED, ["RTX 3090", "RTX A5000", "L4"])
    still_running = other.evaluate("page.compared === null")
    other.wait_for_function("page.compared !== null", timeout=120_000)
    comparison_s = time.monotonic() - started
    rows = other.locator("#gpus tbody tr").count()
    other.context.close()
    seconds = sorted(round(ms / 1000, 3) for ms in took)
    report = f"plans {seconds} s while the 70B comparison ran {comparison_s:.1f} s; alone {alone[0] / 1000:.2f} s"
    print(report)
    assert still_running, report  # the plans did not wait for the comparison
    assert rows > 20, report
    assert max(seconds) < comparison_s / 4, report
    assert seconds[1] < 1.0, report


# --- the page's language and the phone ------------------------------------------------------------------------
JOURNEYS = {
    "7B QLoRA on a 4060 Ti 16 GB": "model=llama-2-7b&method=qlora&gpu=RTX+4060+Ti+16GB",
    "7B QLoRA on an 8 GB card": "model=llama-2-7b&method=qlora&vram=8",
    "70B": "model=llama-2-70b&gpu=RTX+4060+Ti+16GB",
    "a full fine-tune that does not fit": "model=llama-2-7b&method=full&gpu=RTX+4090",
}


@pytest.mark.parametrize("language", ["es", "pt"])
def test_the_plans_reasons_suggestions_and_errors_are_in_the_pages_language(
    language: str, server: str, page: Page, tmp_path: Path
) -> None:
    """For each journey of the issue, what the planner says (reasons, the smallest changes that fit) and what a
    bad field or upload gets holds no sentence of the CLI's English."""
    from lorafit.web import strings
    from test_web import english_in

    for journey, query in JOURNEYS.items():
        page.goto(f"{server}/?{query}&lang={language}")
        expect(page.locator("#verdict-word")).not_to_have_attribute("data-verdict", "", timeout=30_000)
        reasons = page.locator("#reasons li").all_text_contents()
        changes = page.locator("#suggestions tbody td:first-child").all_text_contents()
        assert reasons, journey
        said = "\n".join([page.inner_text("#verdict"), *reasons, *changes])
        assert english_in(said) == [] and "GB GPU" not in said, (journey, english_in(said), said)
        if journey in ("70B", "a full fine-tune that does not fit"):
            assert changes, journey  # the smallest changes that fit are there, in the page's language
    page.fill("#f-seq_len", "-5")
    page.locator("#f-seq_len").dispatch_event("change")
    error = page.locator("#error-seq_len")
    expect(error).to_be_visible(timeout=20_000)
    assert error.inner_text().startswith(strings(language)["label.seq_len"] + " -5: ")
    assert english_in(error.inner_text()) == [] and "--" not in error.inner_text()
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "zz"}')
    page.set_input_files("#upload-model", str(bad))
    error = page.locator("#error-model")
    expect(error).to_contain_text("model_type 'zz'", timeout=20_000)
    assert english_in(error.inner_text()) == [] and "not supported" not in error.inner_text()


def test_on_a_phone_the_verdict_is_on_the_first_screen(server: str, browser: Browser, tmp_path: Path) -> None:
    context = browser.new_context(locale="en-US", viewport={"width": 390, "height": 844})
    phone = context.new_page()
    phone.goto(server + "/?model=llama-2-7b&method=qlora&gpu=RTX+4060+Ti+16GB")
    expect(phone.locator("#verdict-word")).not_to_have_attribute("data-verdict", "", timeout=30_000)
    assert phone.evaluate("window.scrollY") == 0
    for shown in ("#verdict-word", "#verdict"):
        box = phone.locator(shown).bounding_box()
        assert box is not None and box["y"] >= 0 and box["y"] + box["height"] <= 844, (shown, box)
    form = phone.locator("#plan-form").bounding_box()
    assert form is not None and form["y"] > phone.locator("#verdict").bounding_box()["y"]  # the form after it
    shoot(phone, "serve-phone-verdict-first", tmp_path)
    context.close()


def luminance(css: str) -> float:
    """The relative luminance (WCAG 2) of a computed CSS colour, 'rgb(r, g, b)' or 'rgba(r, g, b, a)'."""
    channels = [float(part) / 255 for part in css[css.index("(") + 1 : css.index(")")].split(",")[:3]]
    linear = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_the_focus_ring_stands_out_3_to_1_from_what_is_behind_it(scheme: str, server: str, browser: Browser) -> None:
    """WCAG's non-text contrast: the outline against the first opaque background it is drawn on, both themes,
    from the computed styles."""
    context = browser.new_context(locale="en-US", color_scheme=scheme)
    opened = context.new_page()
    opened.goto(server + "/?model=llama-2-7b&gpu=RTX+4090")
    expect(opened.locator("html")).to_have_attribute("data-theme", scheme)
    for control in ("#f-seq_len", "#f-method", "#share"):
        opened.focus(control)
        opened.keyboard.press("Shift+Tab")  # the keyboard's focus, which :focus-visible rings
        opened.keyboard.press("Tab")
        ring, behind = opened.evaluate(
            """(selector) => {
                const element = document.querySelector(selector);
                const style = getComputedStyle(element);
                if (!element.matches(":focus-visible") || style.outlineStyle === "none") return [null, null];
                let parent = element.parentElement;
                while (parent && /rgba\\(.*, 0\\)|transparent/.test(getComputedStyle(parent).backgroundColor)) {
                    parent = parent.parentElement;
                }
                return [style.outlineColor, getComputedStyle(parent || document.body).backgroundColor];
            }""",
            control,
        )
        assert ring and behind, control
        lighter, darker = sorted((luminance(ring), luminance(behind)), reverse=True)
        assert (lighter + 0.05) / (darker + 0.05) >= 3, (control, scheme, ring, behind)
    context.close()
