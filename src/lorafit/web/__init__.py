"""`lorafit serve`: the planner as a local web page and a JSON API.

The API answers with `lorafit.answers`, the code behind `lorafit plan --json` and `lorafit estimate --json`, so
`/api/plan?model=llama-2-7b&gpu=rtx-4090` is exactly `lorafit plan --model llama-2-7b --gpu rtx-4090 --json`.
The page builds its form from the option declaration (`/api/options`) and its words from one dictionary per
language (`strings/*.json`). Nothing is fetched from the internet: the page, its script and its styles ship in
the package. Starlette is imported only here, so `lorafit plan` stays free of it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import tempfile
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from lorafit import answers, files, hardware, messages, models, options
from lorafit import plan as planner
from lorafit.data import counter_for, length_profile
from lorafit.data.problems import Problem
from lorafit.data.tokens import TokenCounter
from lorafit.errors import LorafitError
from lorafit.messages import say
from lorafit.web.access import AccessGuard, Listening, check_can_listen, shown
from lorafit.web.jobs import Comparison, Comparisons, workers

STATIC = Path(__file__).resolve().parent / "static"
STRINGS = Path(__file__).resolve().parent / "strings"
LANGUAGES = ("en", "es", "pt")
UPLOAD_PREFIX = "upload:"
# A config.json is a few kB; a dataset for a plan is read only for its token lengths.
UPLOAD_LIMITS = {"model": 1 << 20, "data": 64 << 20}
DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet", ".txt")
SKIPPED_SHOWN = 3  # errors of skipped rows named on the page; `lorafit data check` lists them all
FALSE, TRUE = ("false", "0", "no", "off"), ("true", "1", "yes", "on")
POLL_S = 0.05  # how often a request waiting on a comparison looks for its new rows


class BadRequest(LorafitError):
    """A request the user can fix: HTTP 400 with one line, and the field it is about where there is one."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


# --- languages -----------------------------------------------------------------------------------------------
def language_of(accept_language: str | None, asked: str | None = None) -> str:
    """?lang= if it names a language the page has, else the first of Accept-Language's (by weight) that it has
    (es-MX -> es, pt-BR -> pt), else English."""
    if asked and asked.lower() in LANGUAGES:
        return asked.lower()
    weighted = []
    for position, part in enumerate((accept_language or "").split(",")):
        tag, _, params = part.strip().partition(";")
        weight = 1.0
        match = re.search(r"q=([0-9.]+)", params)
        if match:
            try:
                weight = float(match.group(1))
            except ValueError:
                weight = 0.0
        weighted.append((-weight, position, tag.strip().lower().split("-")[0]))
    for _, _, language in sorted(weighted):
        if language in LANGUAGES:
            return language
    return "en"


@cache
def strings(language: str) -> dict[str, str]:
    """The page's words in `language`. English takes each field's unit from the option declaration; a field's help
    and its default are the page's own (they name fields and the page, not flags and commands), in every
    language."""
    table = json.loads((STRINGS / f"{language}.json").read_text(encoding="utf-8"))
    if language == "en":
        table |= {f"unit.{o.name}": o.unit for o in form_options() if o.unit}
    return table


DECIMAL_COMMA = str.maketrans(",.", ".,")
FLAG_NAMES = {o.flag: o.name for o in options.OPTIONS}  # --seq-len -> seq_len


@cache
def message_catalog(language: str) -> dict[str, str]:
    """The planner's sentences (lorafit.messages, keyed as there) in `language`. English is the declaration itself,
    but for the few sentences whose CLI words point to a command or a flag: the page says them in its terms."""
    return json.loads((STRINGS / "messages" / f"{language}.json").read_text(encoding="utf-8"))


def in_language(text: str, language: str | None) -> str:
    """A sentence of the planner or of an error, as the CLI says it, in the page's language and terms: a setting
    is named by its field's label, not by its flag. No language: the CLI's words, as they are."""
    if language is None:
        return text
    words = strings(language)

    def label(spelled: str) -> str:  # a setting, or a list of them ("loss, offload_activations")
        return ", ".join(words.get(f"label.{FLAG_NAMES.get(one, one)}", one) for one in spelled.split(", "))

    def number(printed: str) -> str:  # 1,234.5 as Spanish and Portuguese write it: 1.234,5
        return printed if language == "en" else printed.translate(DECIMAL_COMMA)

    # a sentence not translated yet shows as the English page says it
    return messages.render(text, message_catalog("en") | message_catalog(language), label, number)


def plan_in_language(plan: dict[str, Any], language: str | None) -> dict[str, Any]:
    """A plan's JSON with its reasons, its suggestions' changes and a card known by its memory ("8 GB GPU") in
    `language`; without one, as `lorafit plan --json` prints it."""
    if language is None:
        return plan
    gpu = plan.get("gpu")
    return plan | {
        "reasons": [in_language(reason, language) for reason in plan.get("reasons", [])],
        "suggestions": [
            row
            | {"change": in_language(row["change"], language), "gpu": row["gpu"] and in_language(row["gpu"], language)}
            for row in plan.get("suggestions", [])
        ],
        "gpu": gpu and gpu | {"name": in_language(gpu["name"], language)},
    }


def asked_language(items: list[tuple[str, str]]) -> str | None:
    """The language a request's ?lang= names (the page sends its own; an unknown one is English); None without
    ?lang=: the API then answers in the CLI's own words, as `lorafit plan --json` does."""
    asked = next((value for key, value in items if key == "lang"), None)
    if asked is None:
        return None
    return asked if asked in LANGUAGES else "en"


# --- the form's declaration --------------------------------------------------------------------------------
def form_options() -> list[options.Option]:
    """The settings of `lorafit plan` a file or a form can hold (not --json and the other switches)."""
    return [o for o in options.for_command("plan") if o.config]


def options_json() -> dict[str, Any]:
    names = {o.name for o in form_options()}
    return {
        "options": [row for row in options.as_dicts() if row["name"] in names],
        "groups": options.GROUP_TITLES,
        "models": sorted(models.catalog()),
        "gpus": [
            {"name": gpu.name, "memory_gb": gpu.memory_gb, "rent_usd_per_hour": gpu.rent_usd_per_hour}
            for gpu in hardware.gpus()
        ],
        "upload_limits": UPLOAD_LIMITS,
    }


# --- query strings into the CLI's settings -----------------------------------------------------------------
def given_from_query(items: list[tuple[str, str]], command: options.Command, switches: tuple[str, ...]) -> tuple:
    """(the settings that were set, as the CLI's flags hand them to `answers`, the switches that were on).
    Values stay text, checked by the same validation as a flag; a bool is true/false; an empty value is not
    set (a form's empty field)."""
    known = {o.name: o for o in options.for_command(command)}
    given: dict[str, Any] = {}
    on: dict[str, bool] = dict.fromkeys(switches, False)
    for key, value in items:
        if key == "lang":
            continue
        option = known.get(key)
        if option is None:
            raise BadRequest(options.unknown_key(key, [name for name in known if known[name].config] + list(switches)))
        if value == "":
            continue
        if not option.config and not option.is_bool:  # a file on the CLI's machine (--from): not for a page
            raise BadRequest(say("error.not_here", setting=key, api=f"/api/{command}"), key)
        parsed: str | bool = value
        if option.is_bool:
            text = value.strip().lower()
            if text not in TRUE + FALSE:
                raise BadRequest(say("error.bool", setting=key, value=value), key)
            parsed = text in TRUE
            if not option.config:
                if key not in switches:
                    raise BadRequest(say("error.not_here", setting=key, api=f"/api/{command}"), key)
                on[key] = text in TRUE
                continue
        if option.many:
            given.setdefault(key, []).append(parsed)
        elif key in given:
            raise BadRequest(say("error.twice", setting=key), key)
        else:
            given[key] = parsed
    return given, on


def field_of(message: str, given: Mapping[str, Any]) -> str | None:
    """The setting a one-line error is about, for the page to show it next to that field."""
    for name in given:
        option = options.BY_NAME.get(name)
        spellings = (option.flag, name) if option else (name,)
        if any(message.startswith(spelling + " ") or message.startswith(spelling + ":") for spelling in spellings):
            return name
    for name, value in given.items():
        if re.search(rf"\b{re.escape(name)}\b", message) or (isinstance(value, str) and f"'{value}'" in message):
            return name
    return None


# --- uploads ----------------------------------------------------------------------------------------------
def too_large(kind: str, name: str) -> str:
    limit = UPLOAD_LIMITS.get(kind, max(UPLOAD_LIMITS.values())) >> 20
    return say("error.too_large", name=name or say("upload.unnamed"), limit=limit, kind=kind or "a file")


class Uploads:
    """Files the page sent (a config.json, a dataset), kept under their digest so that a link names them. The
    server reads no other path: a model or dataset the URL names must be a catalog entry or an upload."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def save(self, kind: str, name: str, body: bytes) -> str:
        if kind not in UPLOAD_LIMITS:
            raise BadRequest(say("error.upload_kind", kind=kind))
        if len(body) > UPLOAD_LIMITS[kind]:
            raise BadRequest(too_large(kind, name), kind)
        if not body:
            raise BadRequest(say("error.empty", name=name or say("upload.unnamed")), kind)
        if kind == "model":
            name = "config.json"
        else:
            name = re.sub(r"[^A-Za-z0-9._-]", "_", Path(name or "data.jsonl").name)[-100:]
            if not name.lower().endswith(DATA_SUFFIXES):
                raise BadRequest(say("error.data_suffix", name=name, suffixes=", ".join(DATA_SUFFIXES)), "data")
        digest = hashlib.sha256(body).hexdigest()[:16]
        folder = self.root / digest
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(body)
        return f"{UPLOAD_PREFIX}{digest}/{name}"

    def path(self, value: str, field: str) -> Path:
        """The file an `upload:` value names, or a clear refusal of any other path."""
        if not value.startswith(UPLOAD_PREFIX):
            raise BadRequest(say("error.not_uploaded", setting=field, value=value), field)
        relative = value.removeprefix(UPLOAD_PREFIX)
        if not re.fullmatch(r"[0-9a-f]{16}/[A-Za-z0-9._-]+", relative):
            raise BadRequest(say("error.not_an_upload", setting=field, value=value), field)
        path = self.root / relative
        if not path.is_file():
            raise BadRequest(say("error.upload_gone", setting=field, value=value), field)
        return path

    def discard(self, value: str) -> None:
        """Delete a rejected upload (and its folder, once empty), so that refused files do not fill the cache."""
        path = self.root / value.removeprefix(UPLOAD_PREFIX)  # a value `save` made
        path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # another upload with the same bytes under another name is still there
            path.parent.rmdir()

    def hide(self, data: Any) -> Any:
        """`data` with every path of an upload written as its `upload:` value: where the server keeps files is no
        business of a page."""
        root = str(self.root)
        if isinstance(data, str):
            return re.sub(re.escape(root) + r"/([0-9a-f]{16}/[A-Za-z0-9._-]+)", UPLOAD_PREFIX + r"\1", data)
        if isinstance(data, dict):
            return {key: self.hide(value) for key, value in data.items()}
        if isinstance(data, list):
            return [self.hide(value) for value in data]
        return data

    def model(self, given: dict[str, Any]) -> dict[str, Any]:
        """`given` with an uploaded model's value turned into its file; a local path is refused."""
        if "tokenizer" in given:
            raise BadRequest(say("error.tokenizer", setting="tokenizer"), "tokenizer")
        value = given.get("model")
        if value is None:
            return given
        if value.startswith(UPLOAD_PREFIX):
            return given | {"model": str(self.path(value, "model"))}
        if Path(value).expanduser().exists() or Path(value).suffix == ".json":
            raise BadRequest(say("error.model_path", setting="model", value=value), "model")
        return given


def shown_as(problem: Problem, path: str, name: str) -> Problem:
    """`problem` with the uploaded file named as the user named it, not where the server keeps it."""
    file = problem.file and problem.file.replace(path, name)
    return replace(problem, file=file, message=problem.message.replace(path, name))


def data_described(path: Path, name: str, counter: TokenCounter, language: str | None = None) -> dict[str, Any]:
    """An uploaded dataset's token profile, and where some rows have errors, how many the plan skips and why (the
    first few errors as `lorafit data check` words them, in the page's language, the file named as the user named
    it)."""
    lengths = length_profile(path, tokenizer=counter, skip_bad_rows=True)
    described: dict[str, Any] = {"tokens": lengths.profile.model_dump(mode="json")}
    if lengths.skipped_rows:
        problems = [
            {"message": f"{in_language(p.where(), language)}: {in_language(p.message, language)}", "row": p.row}
            for p in (shown_as(problem, str(path), name) for problem in lengths.skipped_because[:SKIPPED_SHOWN])
        ]
        total = lengths.profile.rows + lengths.skipped_rows
        described["skipped"] = {"rows": lengths.skipped_rows, "of": total, "problems": problems}
    return described


def data_counter(uploads: Uploads, model: str | None) -> TokenCounter:
    """How an uploaded dataset's tokens are counted: as `lorafit plan --data` counts them for the model chosen
    (the chat template of its family), through the same function (data.counter_for)."""
    try:
        spec = models.resolve(uploads.model({"model": model})["model"]) if model else None
    except LorafitError:  # a model the page cannot plan for (the plan says why): the plain estimate
        spec = None
    if spec is None:
        return counter_for(None, None)
    return counter_for(None if model.startswith(UPLOAD_PREFIX) else model, None, spec)


@dataclass(frozen=True)
class Refused:
    """A request the user can fix, answered from a worker: the 400's {"error", "field"}."""

    body: dict[str, Any]


# --- the app ------------------------------------------------------------------------------------------------
def create_app(upload_dir: Path | None = None, host: str = "127.0.0.1", port: int | None = None) -> Any:
    """The page and its API, answering requests addressed to `host` (and `port`, where given) only."""
    import anyio
    import anyio.to_thread
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
    from starlette.routing import Mount, Route
    from starlette.staticfiles import StaticFiles

    uploads = Uploads(upload_dir or Path(tempfile.mkdtemp(prefix="lorafit-serve-")))
    comparisons = Comparisons()
    # plans, estimates and uploads run in threads, a few at a time, so that the loop always answers; the
    # comparisons have a pool of their own (jobs.Comparisons), so a plan never waits for one
    planning = anyio.CapacityLimiter(workers())

    def refusal(error: Exception, given: Mapping[str, Any], language: str | None) -> dict[str, Any]:
        """The page's {"error", "field"} for an error the user can fix (BadRequest, LorafitError, ValidationError),
        in `language`; anything else is re-raised."""
        if isinstance(error, BadRequest):
            message, field = str(error), error.field or field_of(str(error), given)
        elif isinstance(error, LorafitError):
            message = uploads.hide(str(error).splitlines()[0] if str(error) else type(error).__name__)
            field = field_of(message, given)
        elif isinstance(error, ValidationError):
            message = options.one_line(error)
            field = field_of(message, given)
        else:
            raise error
        return {"error": in_language(message, language), "field": field}

    def answer(items: list[tuple[str, str]], command: options.Command, switches: tuple[str, ...], run: bool) -> Any:
        """The JSON of `lorafit COMMAND --json` for the query's settings, or a Refused; `run`: the `lorafit
        train` command and config that carry that plan out."""
        given: dict[str, Any] = {}
        try:
            given, on = given_from_query(items, command, switches)
            given = uploads.model(given)
            result: answers.PlanAnswer | answers.EstimateAnswer
            if command == "plan":
                # stack=all: `plan --stack all` (a run, one stack: the value is refused as any other)
                every_stack = not run and given.get("stack") == "all"
                result = answers.plan(
                    {key: value for key, value in given.items() if not (every_stack and key == "stack")},
                    compare=on["compare"],
                    data_path=lambda v: uploads.path(v, "data"),
                    skip_bad_rows=True,
                    every_stack=every_stack,
                )
            else:
                result = answers.estimate(given, exact=on["exact"])
            if run and isinstance(result, answers.PlanAnswer):
                if result.kind != "one":
                    raise BadRequest(say("error.run_one_plan"))
                plan = result.plans[0]
                return uploads.hide({"command": answers.train_command(plan), "yaml": answers.train_yaml(plan)})
            body = result.to_json()
            if isinstance(result, answers.PlanAnswer):
                language = asked_language(items)
                if result.kind == "one":
                    body = plan_in_language(body, language)
                elif result.kind == "compare":
                    body["plans"] = [plan_in_language(plan, language) for plan in body["plans"]]
            return uploads.hide(body)
        except (LorafitError, ValidationError) as error:
            return Refused(refusal(error, given, asked_language(items)))

    def comparison(items: list[tuple[str, str]]) -> tuple[Comparison, float | None] | Refused:
        """The comparison the query asks for, started or found, with its price cap; or a Refused."""
        given: dict[str, Any] = {}
        try:
            given, _ = given_from_query(items, "plan", ("compare",))
            given = uploads.model(given)
            asked, flags, _, _ = answers.plan_request(
                given, compare=True, data_path=lambda v: uploads.path(v, "data"), skip_bad_rows=True
            )
        except (LorafitError, ValidationError) as error:
            return Refused(refusal(error, given, asked_language(items)))
        known, language = dict(given), asked_language(items)
        job = comparisons.start(
            asked, lambda: planner.compare_rows(asked), lambda error: refusal(error, known, language)
        )
        return job, flags.max_price_hour

    async def answered(
        request: Request, command: options.Command, switches: tuple[str, ...], run: bool = False
    ) -> Response:
        started = time.perf_counter()
        items = list(request.query_params.multi_items())
        body: Any
        if not run and command == "plan" and any(k == "compare" and v.strip().lower() in TRUE for k, v in items):
            started_job = await anyio.to_thread.run_sync(comparison, items, limiter=planning)
            if isinstance(started_job, Refused):
                return JSONResponse(started_job.body, 400)
            job, cap = started_job
            while not job.done:
                await anyio.sleep(POLL_S)
            if job.error:
                return JSONResponse(job.error, 400)
            plans = planner.in_compare_order(list(job.plans))
            body = uploads.hide(answers.PlanAnswer("compare", plans, max_price_hour=cap).to_json())
            body["plans"] = [plan_in_language(plan, asked_language(items)) for plan in body["plans"]]
        else:
            body = await anyio.to_thread.run_sync(answer, items, command, switches, run, limiter=planning)
            if isinstance(body, Refused):
                return JSONResponse(body.body, 400)
        elapsed = (time.perf_counter() - started) * 1000
        return JSONResponse(body, headers={"Server-Timing": f"answer;dur={elapsed:.2f}"})

    async def plan(request: Request) -> Response:
        return await answered(request, "plan", ("compare",))

    async def run(request: Request) -> Response:
        return await answered(request, "plan", ("compare",), run=True)

    async def estimate(request: Request) -> Response:
        return await answered(request, "estimate", ("exact",))

    async def compare(request: Request) -> Response:
        """The GPU comparison as NDJSON, one line per card as it is planned ({"plan": ...}, catalog order), then
        {"done": true, "cheapest", "cheapest_under_price", "max_price_hour"} or {"error", "field"}."""
        items = list(request.query_params.multi_items())
        started_job = await anyio.to_thread.run_sync(comparison, items, limiter=planning)
        if isinstance(started_job, Refused):
            return JSONResponse(started_job.body, 400)
        job, cap = started_job
        language = asked_language(items)

        async def lines() -> AsyncIterator[str]:
            sent = 0
            while True:
                done, plans = job.done, job.plans[sent:]  # done first: no row comes after it is set
                for plan in plans:
                    row = plan_in_language(plan.model_dump(mode="json"), language)
                    yield json.dumps({"plan": uploads.hide(row)}) + "\n"
                sent += len(plans)
                if done:
                    break
                await anyio.sleep(POLL_S)
            if job.error:
                yield json.dumps(job.error) + "\n"
                return
            summary = answers.PlanAnswer("compare", list(job.plans), max_price_hour=cap)
            cheapest, under = summary.cheapest, summary.cheapest_under_price
            yield (
                json.dumps(
                    {
                        "done": True,
                        "cheapest": cheapest.gpu.name if cheapest and cheapest.gpu else None,
                        "cheapest_under_price": under.gpu.name if under and under.gpu else None,
                        "max_price_hour": cap,
                    }
                )
                + "\n"
            )

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    async def options_route(request: Request) -> Response:
        return JSONResponse(options_json())

    async def strings_route(request: Request) -> Response:
        language = request.path_params["language"]
        if language not in LANGUAGES:
            return JSONResponse({"error": f"language {language!r}: one of {', '.join(LANGUAGES)}"}, 400)
        return JSONResponse(strings(language))

    async def upload(request: Request) -> Response:
        kind, name = request.query_params.get("kind", ""), request.query_params.get("name", "")
        language = asked_language(list(request.query_params.multi_items()))
        limit = UPLOAD_LIMITS.get(kind, max(UPLOAD_LIMITS.values()))
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            return JSONResponse({"error": in_language(too_large(kind, name), language), "field": kind}, 413)
        body = bytearray()
        async for chunk in request.stream():  # stop reading at the limit: an oversized body is never held
            body += chunk
            if len(body) > limit:
                return JSONResponse({"error": in_language(too_large(kind, name), language), "field": kind}, 413)
        try:
            value = uploads.save(kind, name, bytes(body))
        except BadRequest as error:
            return JSONResponse({"error": in_language(str(error), language), "field": error.field or kind}, 400)
        path = uploads.path(value, kind)
        described: dict[str, Any] = {"value": value}
        try:
            if kind == "model":
                spec = models.from_config_json(path)
                described["model"] = spec.model_dump(mode="json") | {"num_params": spec.num_params}
            else:  # counting a dataset's tokens takes seconds: in a worker, as a plan
                counter = data_counter(uploads, request.query_params.get("model"))
                name_shown = name or path.name
                described |= await anyio.to_thread.run_sync(
                    data_described, path, name_shown, counter, language, limiter=planning
                )
        except LorafitError as error:  # the file as the user named it, not where the server keeps it
            uploads.discard(value)
            message = str(error).splitlines()[0].replace(str(path), name or path.name)
            return JSONResponse({"error": in_language(message, language), "field": kind}, 400)
        except BaseException:
            uploads.discard(value)
            raise
        return JSONResponse(uploads.hide(described))

    async def page(request: Request) -> Response:
        language = language_of(request.headers.get("accept-language"), request.query_params.get("lang"))
        html = (STATIC / "index.html").read_text(encoding="utf-8").replace("{{lang}}", language)
        return HTMLResponse(html, headers={"Content-Language": language, "Vary": "Accept-Language"})

    async def server_error(request: Request, error: Exception) -> Response:
        line = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}".rstrip(": ")
        return JSONResponse({"error": f"internal error ({uploads.hide(line)}); please report it", "field": None}, 500)

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        yield
        comparisons.close()  # a comparison still running is dropped with the server

    app = Starlette(
        routes=[
            Route("/", page),
            Route("/api/plan", plan),
            Route("/api/compare", compare),
            Route("/api/estimate", estimate),
            Route("/api/run", run),
            Route("/api/options", options_route),
            Route("/api/strings/{language}", strings_route),
            Route("/api/upload", upload, methods=["POST"]),
            Mount("/static", StaticFiles(directory=STATIC), name="static"),
        ],
        exception_handlers={Exception: server_error},
        lifespan=lifespan,
    )
    return AccessGuard(app, Listening(host, port))


def serve(host: str = "127.0.0.1", port: int = 8765, open_browser: bool = False) -> None:
    import uvicorn

    check_can_listen(host, port)
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else shown(host)}:{port}/"
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(f"lorafit serve: listening on {host}, reachable from other machines")
    print(f"lorafit serve: {url}  (Ctrl-C stops it)")
    if open_browser:
        import threading
        import webbrowser

        threading.Timer(1.0, webbrowser.open, args=(url,)).start()
    uvicorn.run(create_app(upload_folder(), host, port), host=host, port=port, log_level="warning")


def upload_folder() -> Path:
    """Where `lorafit serve` keeps uploads: the user's cache, so that a link to a plan of an uploaded file still
    opens after a restart."""
    return files.cache_folder() / "uploads"
