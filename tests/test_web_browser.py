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

import pytest

from conftest import run_cli
from lorafit import memory, models, serving
from lorafit import plan as planner

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
    page.select_option("#whatif-micro_batch", "16")
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
    assert code == 2 and error.inner_text() == err.strip().removeprefix("lorafit: error: ")
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
    assert page.input_value("#f-model").startswith("upload:")


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
    for memo in (models._memoised, memory.activation_bytes_per_layer, planner._estimate_anywhere, planner._settings):
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
