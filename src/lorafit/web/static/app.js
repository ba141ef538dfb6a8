// lorafit serve: the page. The form comes from /api/options (the CLI's option declaration), the words from
// /api/strings/<lang>, every answer from /api/plan, /api/estimate and /api/run (the CLI's own JSON).
"use strict";

const BASIC = ["model", "method", "gpu", "vram", "seq_len", "batch_size", "tokens_per_epoch", "data", "epochs",
  "rent_price", "kwh_price", "max_price_hour"];
const HIDDEN = ["tokenizer"]; // the server counts a dataset's tokens without a local tokenizer
const DEFAULTS = { model: "llama-2-7b", gpu: "RTX 4090" }; // what `lorafit plan` answers with no model and GPU
// the estimator's parts (memory.breakdown and its device side), in the order they stack
const PARTS = ["weights", "lora_adapters", "gradients", "optimizer_states", "paged_optimizer_states", "activations",
  "logits_and_loss", "previous_micro_batch", "layer_backward", "dequant_buffer", "optimizer_step_temp",
  "sharded_gather", "allocator_reserve", "cuda_context"];
const DEFAULT_TOKENS_PER_EPOCH = 15000000; // plan.DEFAULT_TOKENS_PER_EPOCH: the Alpaca-sized run with no data

const page = {
  lang: document.documentElement.dataset.lang || "en",
  strings: {},
  declaration: null,
  values: {},        // the settings in the URL and the form (text, as a query string holds them)
  plan: null,        // the last /api/plan answer
  whatif: null,      // overrides of the plan's settings, or null
  shown: null,       // the estimate the chart shows
  gpuRows: [],
  compared: null,    // the query of the comparison the table holds, once complete
  comparing: null,   // the AbortController of the comparison being read
  sort: { key: "fits", descending: true },
  requests: 0,
  customCard: false, // "my card has N GB" picked: wait for the number before planning
  described: {},     // what /api/upload said of each uploaded file, by its value
};

// --- words and numbers --------------------------------------------------------------------------------------
function t(key, fill = {}) {
  const text = page.strings[key] ?? key;
  return text.replace(/\{([a-z_]+)\}/g, (_, name) => (name in fill ? fill[name] : `{${name}}`));
}

function locale() {
  const browser = navigator.language || "";
  return browser.split("-")[0] === page.lang ? browser : { en: "en-US", es: "es", pt: "pt-BR" }[page.lang];
}

function number(value, digits = 2) {
  return new Intl.NumberFormat(locale(), { maximumFractionDigits: digits }).format(value);
}

function gib(value) {
  return `${new Intl.NumberFormat(locale(), { minimumFractionDigits: 2, maximumFractionDigits: 2 }).format(value)} GiB`;
}

function money(value) {
  return value == null ? "–" : new Intl.NumberFormat(locale(), { style: "currency", currency: "USD" }).format(value);
}

function duration(hours) {
  return hours < 1 ? t("ui.minutes", { n: number(hours * 60, 0) }) : t("ui.hours", { n: number(hours, 1) });
}

function translateStatic() {
  document.documentElement.lang = page.lang;
  document.documentElement.dataset.lang = page.lang;
  document.title = t("ui.title");
  for (const element of document.querySelectorAll("[data-i18n]")) element.textContent = t(element.dataset.i18n);
  document.getElementById("lang-select").value = page.lang;
}

// --- the form, from the declaration ------------------------------------------------------------------------
function option(name) {
  return page.declaration.options.find((row) => row.name === name);
}

function defaultText(row) {
  // what "not set" means, in the page's language: the declaration's words, or the plain default value
  if (page.strings[`default.${row.name}`]) return page.strings[`default.${row.name}`];
  if (row.type === "bool") return row.default ? t("ui.on") : t("ui.off");
  return row.default_text && row.default_text !== "not set" ? row.default_text : "";
}

function fieldHelp(row) {
  const unit = page.strings[`unit.${row.name}`];
  const shown = defaultText(row) ? ` [${defaultText(row)}]` : "";
  return `${t(`help.${row.name}`)}${unit ? ` (${unit})` : ""}${shown}`;
}

function control(row) {
  const id = `f-${row.name}`;
  let element;
  if (row.name === "gpu") {
    element = document.createElement("select");
    element.append(new Option(t("ui.gpu_custom"), ""));
    for (const gpu of page.declaration.gpus) element.append(new Option(`${gpu.name} (${gpu.memory_gb} GB)`, gpu.name));
  } else if (row.type === "choice" || row.type === "bool") {
    element = document.createElement("select");
    element.append(new Option(`${t("ui.auto")} (${defaultText(row)})`, ""));
    const choices = row.type === "bool" ? [["true", t("ui.on")], ["false", t("ui.off")]] : row.choices.map((c) => [c, c]);
    for (const [value, label] of choices) element.append(new Option(label, value));
  } else if (row.name === "data") {
    element = document.createElement("input");
    element.type = "file";
    element.accept = ".jsonl,.json,.csv,.parquet,.txt";
  } else {
    element = document.createElement("input");
    if (row.type === "int" || row.type === "float") {
      element.type = "number";
      element.inputMode = row.type === "int" ? "numeric" : "decimal";
      element.step = row.type === "int" ? "1" : "any";
      const low = row.bounds.ge ?? row.bounds.gt;
      const high = row.bounds.le ?? row.bounds.lt;
      if (low != null) element.min = String(low);
      if (high != null) element.max = String(high);
    } else {
      element.type = "text";
      element.autocomplete = "off";
      element.spellcheck = false;
    }
    if (defaultText(row)) element.placeholder = defaultText(row);
  }
  element.id = id;
  element.name = row.name;
  element.setAttribute("aria-describedby", `help-${row.name} error-${row.name}`);
  return element;
}

function field(row) {
  const box = document.createElement("div");
  box.className = "field";
  box.dataset.field = row.name;
  const label = document.createElement("label");
  label.htmlFor = `f-${row.name}`;
  label.dataset.i18n = `label.${row.name}`;
  label.textContent = t(`label.${row.name}`);
  const input = control(row);
  box.append(label);
  if (row.name === "model") {
    input.setAttribute("list", "model-list");
    const list = document.createElement("datalist");
    list.id = "model-list";
    for (const name of page.declaration.models) list.append(new Option(name, name));
    const upload = document.createElement("input");
    upload.type = "file";
    upload.accept = ".json,application/json";
    upload.id = "upload-model";
    const uploadLabel = document.createElement("label");
    uploadLabel.htmlFor = upload.id;
    uploadLabel.className = "upload";
    uploadLabel.dataset.i18n = "ui.upload_config";
    uploadLabel.textContent = t("ui.upload_config");
    upload.addEventListener("change", () => upload.files[0] && sendFile("model", upload.files[0]));
    box.append(input, list, uploadLabel, upload);
  } else if (row.name === "data") {
    const zone = document.createElement("div");
    zone.className = "dropzone";
    zone.id = "data-drop";
    const hint = document.createElement("span");
    hint.dataset.i18n = "ui.upload_data";
    hint.textContent = t("ui.upload_data");
    zone.append(hint, input);
    input.addEventListener("change", () => input.files[0] && sendFile("data", input.files[0]));
    zone.addEventListener("dragover", (event) => { event.preventDefault(); zone.classList.add("over"); });
    zone.addEventListener("dragleave", () => zone.classList.remove("over"));
    zone.addEventListener("drop", (event) => {
      event.preventDefault();
      zone.classList.remove("over");
      if (event.dataTransfer.files[0]) sendFile("data", event.dataTransfer.files[0]);
    });
    box.append(zone);
  } else {
    box.append(input);
  }
  const upload = document.createElement("p");
  upload.className = "uploaded";
  upload.id = `uploaded-${row.name}`;
  upload.hidden = true;
  const help = document.createElement("small");
  help.id = `help-${row.name}`;
  help.className = "help";
  help.textContent = fieldHelp(row);
  const error = document.createElement("p");
  error.id = `error-${row.name}`;
  error.className = "error";
  error.setAttribute("role", "alert");
  error.hidden = true;
  box.append(upload, help, error);
  if (row.name !== "data") {
    // typing asks after a pause and leaving the field asks at once: the second of the two, with the value the
    // first already asked about, would only clear what the first answered (an upload's error among it)
    const update = () => {
      if (page.values[row.name] === input.value) return;
      setValue(row.name, input.value);
      changed();
    };
    input.addEventListener("change", update);
    if (input.tagName === "INPUT") input.addEventListener("input", debounce(update, 350));
  }
  return box;
}

function setValue(name, value) {
  // a catalog GPU and a typed memory size are two ways to name one card: choosing one drops the other
  page.values[name] = value;
  if (name === "gpu") {
    page.customCard = value === "";
    if (value) { delete page.values.vram; document.getElementById("f-vram").value = ""; }
  } else if (name === "vram" && value !== "") {
    page.customCard = true;
    delete page.values.gpu;
    document.getElementById("f-gpu").value = "";
  }
}

function buildForm() {
  const rows = page.declaration.options.filter((row) => !HIDDEN.includes(row.name));
  const basic = document.getElementById("fields-basic");
  const advanced = document.getElementById("fields-advanced");
  const savers = document.getElementById("fields-savers");
  for (const box of [basic, advanced, savers]) box.replaceChildren();
  for (const name of BASIC) basic.append(field(option(name)));
  for (const row of rows) {
    if (BASIC.includes(row.name)) continue;
    (row.group === "savers" ? savers : advanced).append(field(row));
  }
  fillForm();
}

function fillForm() {
  for (const row of page.declaration.options) {
    const input = document.getElementById(`f-${row.name}`);
    if (!input || input.type === "file") continue;
    input.value = page.values[row.name] ?? "";
  }
  const model = document.getElementById("f-model");
  if (model && page.values.model?.startsWith("upload:")) model.value = ""; // named by the line below it, not its digest
  if (page.customCard) document.getElementById("f-gpu").value = "";
  showUpload("model", page.values.model?.startsWith("upload:") ? page.values.model : null);
  showUpload("data", page.values.data ?? null);
}

function modelLabel(model) {
  // an uploaded config by what it is ("llama, 8.0B"), never by the digest it is stored under
  return `${model.architecture}, ${number(model.num_params / 1e9, 1)}B`;
}

function skippedLine(skipped) {
  const reasons = skipped.problems.map((problem) => problem.message);
  return t("ui.skipped_rows", { skipped: number(skipped.rows, 0), rows: number(skipped.of, 0), reasons: reasons.join("; ") });
}

function showUpload(kind, value, described = page.described[value]) {
  const line = document.getElementById(`uploaded-${kind}`);
  if (!line) return;
  line.replaceChildren();
  line.hidden = !value;
  if (!value) return;
  const text = document.createElement("span");
  let skipped = null;
  if (described && kind === "model") {
    text.textContent = t("ui.uploaded_model", { name: modelLabel(described.model) });
  } else if (described && kind === "data") {
    const tokens = described.tokens;
    text.textContent = t("ui.uploaded_data", { rows: number(tokens.rows, 0), tokens: number(tokens.total_tokens ?? tokens.tokens ?? 0, 0), max: number(tokens.max, 0) });
    if (described.skipped) {
      skipped = Object.assign(document.createElement("span"), { className: "skipped", id: "skipped-rows", textContent: skippedLine(described.skipped) });
    }
  } else {
    text.textContent = value.split("/").pop();
  }
  const remove = document.createElement("button");
  remove.type = "button";
  remove.className = "secondary small";
  remove.textContent = t("ui.remove_upload");
  remove.addEventListener("click", () => {
    delete page.values[kind];
    if (kind === "model") document.getElementById("f-model").placeholder = defaultText(option("model"));
    fillForm();
    changed();
  });
  line.append(text, " ", remove);
  if (skipped) line.append(skipped);
}

async function sendFile(kind, file) {
  ++page.requests; // a plan answer still on its way is for the form before this upload: it must not clear its error
  clearErrors();
  // a dataset is counted with the chat template of the model chosen, as the plan counts it
  const model = kind === "data" && page.values.model ? `&model=${encodeURIComponent(page.values.model)}` : "";
  const response = await fetch(`/api/upload?kind=${kind}&name=${encodeURIComponent(file.name)}${model}&lang=${page.lang}`, { method: "POST", body: file });
  const body = await response.json();
  if (!response.ok) return showError(body);
  page.values[kind] = body.value;
  page.described[body.value] = body;
  const input = document.getElementById(`f-${kind}`);
  if (kind === "model" && input) { input.value = ""; input.placeholder = modelLabel(body.model); }
  showUpload(kind, body.value, body);
  changed();
}

// --- the URL holds every setting -------------------------------------------------------------------------------
function readUrl() {
  const params = new URLSearchParams(location.search);
  page.values = {};
  for (const [key, value] of params) if (key !== "lang" && value !== "") page.values[key] = value;
  if (!params.has("model") && !params.has("gpu") && !params.has("vram")) Object.assign(page.values, DEFAULTS);
  page.customCard = Boolean(page.values.vram) && !page.values.gpu;
}

function query(values = page.values) {
  // the page's language goes with every question: the server answers its reasons and errors in it
  const params = new URLSearchParams();
  for (const [key, value] of Object.entries(values)) if (value !== "" && value != null) params.append(key, value);
  params.set("lang", page.lang);
  return params;
}

function writeUrl() {
  const params = query();
  params.set("lang", page.lang);
  history.replaceState(null, "", `${location.pathname}?${params}`);
}

// --- answers ---------------------------------------------------------------------------------------------------
function debounce(run, wait) {
  let timer;
  return (...args) => { clearTimeout(timer); timer = setTimeout(() => run(...args), wait); };
}

function clearErrors() {
  for (const element of document.querySelectorAll(".error")) { element.hidden = true; element.textContent = ""; }
  for (const element of document.querySelectorAll("[aria-invalid]")) element.removeAttribute("aria-invalid");
}

function showError(body) {
  const target = body.field && document.getElementById(`error-${body.field}`);
  const line = target || document.getElementById("form-error");
  line.textContent = body.error;
  line.hidden = false;
  const input = body.field && document.getElementById(`f-${body.field}`);
  if (input) input.setAttribute("aria-invalid", "true");
  document.getElementById("results").classList.add("stale");
}

async function changed() {
  writeUrl();
  const request = ++page.requests;
  if (page.customCard && !page.values.vram) return waitForMemory();
  const response = await fetch(`/api/plan?${query()}`);
  const body = await response.json();
  if (request !== page.requests) return; // a newer change is on its way
  clearErrors();
  if (!response.ok) return showError(body);
  document.getElementById("results").classList.remove("stale");
  page.plan = body;
  page.whatif = null;
  renderPlan();
  loadRun(request);
  loadGpus();
}

function waitForMemory() {
  // "my card has N GB" with no number yet: ask for it instead of planning for some other card
  clearErrors();
  const line = document.getElementById("error-vram");
  line.textContent = t("ui.type_vram");
  line.hidden = false;
  document.getElementById("results").classList.add("stale");
  document.getElementById("f-vram").focus();
}

async function loadRun(request) {
  // the command of this plan when it fits; else of the nearest plan that fits; else none
  const nearest = page.plan.fits ? null : nearestFitting(page.plan);
  for (const id of ["train-command", "train-yaml"]) document.getElementById(id).textContent = ""; // never the last plan's
  if (!page.plan.fits && !nearest) return;
  const response = await fetch(`/api/run?${nearest ? query(nearest.values) : query()}`);
  const body = await response.json();
  if (request !== page.requests || !response.ok) return;
  document.getElementById("train-command").textContent = body.command;
  document.getElementById("train-yaml").textContent = body.yaml;
}

// The table fills as the server plans each card (/api/compare: one JSON line per card, then a "done" line). The
// comparison depends on neither the GPU nor the rent price, so changing only those keeps the table as it is.
const loadGpus = debounce(async () => {
  const values = { ...page.values };
  delete values.gpu;
  delete values.vram;
  delete values.rent_price; // the table prices each card from the catalog
  const asked = query(values).toString();
  if (asked === page.compared) return renderGpus();
  page.comparing?.abort(); // the table of older settings is no longer wanted
  const comparing = page.comparing = new AbortController();
  page.compared = null;
  page.gpuRows = [];
  page.cheapest = null;
  page.cheapestUnderPrice = null;
  document.getElementById("cheapest").textContent = t("ui.gpus_loading");
  try {
    const response = await fetch(`/api/compare?${asked}`, { signal: comparing.signal });
    if (!response.ok) return;
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffered = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffered += value;
      const lines = buffered.split("\n");
      buffered = lines.pop();
      for (const line of lines.filter(Boolean).map((text) => JSON.parse(text))) {
        if (line.plan) page.gpuRows.push(line.plan);
        if (line.done) {
          page.cheapest = line.cheapest;
          page.cheapestUnderPrice = line.cheapest_under_price;
          page.compared = asked;
        }
      }
      renderGpus();
      if (!page.compared) document.getElementById("cheapest").textContent = t("ui.gpus_loading");
    }
    if (!page.compared) document.getElementById("cheapest").textContent = ""; // it stopped: an error line
  } catch (error) {
    if (error.name !== "AbortError") throw error;
  }
}, 300);

// --- rendering ---------------------------------------------------------------------------------------------
function usableGib(plan) {
  return plan.gpu.memory_gib * (plan.gpu.usable_fraction ?? 1) * (1 - plan.estimate.headroom);
}

function settingsSummary(settings) {
  return t("ui.settings_summary", {
    method: settings.method === "qlora" ? `QLoRA ${settings.quant}` : settings.method === "lora" ? "LoRA" : "full",
    micro_batch: settings.micro_batch,
    grad_accum: settings.grad_accum,
    seq_len: number(settings.seq_len, 0),
    grad_ckpt: settings.grad_ckpt ? t("ui.on") : t("ui.off"),
    optimizer: settings.optimizer,
  });
}

function saversOf(settings) {
  const on = [];
  if (settings.loss === "chunked") on.push("loss chunked");
  for (const name of ["offload_activations", "offload_embeddings", "expandable_segments"]) if (settings[name]) on.push(name);
  return on;
}

function modelName(plan) {
  const value = page.values.model;
  if (!value?.startsWith("upload:")) return plan.model.name;
  const described = page.described[value];
  return modelLabel(described ? described.model : { architecture: plan.model.architecture, num_params: plan.estimate.total_params });
}

function tokensSource(plan) {
  // where the tokens the hours are for came from: the dataset, the form's Dataset size, or the default run
  if (plan.tokens) return t("ui.tokens_from_data", { rows: number(plan.tokens.rows, 0) });
  if (page.values.tokens_per_epoch || plan.tokens_per_epoch !== DEFAULT_TOKENS_PER_EPOCH) return t("ui.tokens_from_form");
  return t("ui.tokens_default");
}

function timeLine(plan) {
  const fill = {
    hours: duration(plan.hours) + (plan.hours_range ? ` (${duration(plan.hours_range[0])} – ${duration(plan.hours_range[1])})` : ""),
    epochs: number(plan.epochs, 2),
    tokens: number(plan.tokens_per_epoch, 0),
    source: tokensSource(plan),
    speed: number(plan.tokens_per_s, 0),
    cost_cloud: money(plan.cost_cloud_usd),
    cost_local: money(plan.cost_local_usd),
  };
  const line = t(plan.cost_cloud_usd == null ? "ui.time_line_no_rent" : "ui.time_line", fill);
  return plan.break_even_runs ? `${line} ${t("ui.break_even_line", { n: number(plan.break_even_runs, 0) })}` : line;
}

function trainersLine(plan) {
  // said only when the trainer changes the verdict: which trainers the step fits with
  const rows = plan.trainers || [];
  if (!plan.gpu || rows.every((row) => Boolean(row.fits) === plan.fits)) return "";
  const fitting = [plan.fits ? plan.settings.stack : null, ...rows.filter((row) => row.fits).map((row) => row.stack)].filter(Boolean);
  const failing = [plan.fits ? null : plan.settings.stack, ...rows.filter((row) => !row.fits).map((row) => row.stack)].filter(Boolean);
  return t("ui.trainers_line", { fit: fitting.join(", ") || "–", no: failing.join(", ") });
}

function renderStacks(plan) {
  // the job under each offered trainer (plan.trainers, as `lorafit plan --stack all` tables it): its peak, whether it fits
  const box = document.getElementById("stacks-box");
  const others = plan.gpu ? plan.trainers || [] : [];
  box.hidden = others.length === 0;
  const own = { stack: plan.settings.stack, peak_device_gib: plan.estimate.peak_device_gib, verdict: plan.verdict };
  const rows = [own, ...others.map((row) => ({ ...row, verdict: row.fits ? "fits" : "no" }))];
  box.querySelector("tbody").replaceChildren(...rows.map((row) => {
    const line = document.createElement("tr");
    line.dataset.stack = row.stack;
    line.dataset.verdict = row.verdict;
    for (const text of [row.stack, gib(row.peak_device_gib), t(`ui.verdict_${row.verdict}`)]) {
      line.append(Object.assign(document.createElement("td"), { textContent: text }));
    }
    return line;
  }));
}

function renderPlan() {
  const plan = page.plan;
  const verdict = document.getElementById("verdict");
  const name = plan.gpu.name;
  const state = plan.verdict || (plan.fits ? "fits" : "no");
  const word = document.getElementById("verdict-word");
  word.textContent = t(`ui.verdict_${state}`);
  word.dataset.verdict = state;
  const fill = {
    verdict: plan.fits ? t("ui.fits", { gpu: name }) : t("ui.does_not_fit", { gpu: name }),
    model: modelName(plan),
    settings: settingsSummary(plan.settings),
    peak: gib(plan.estimate.peak_device_gib),
    usable: gib(usableGib(plan)),
  };
  verdict.textContent = t(plan.fits ? "ui.verdict_fit" : "ui.verdict_no_fit", fill);
  verdict.dataset.fits = String(plan.fits);
  verdict.dataset.verdict = state;
  const time = document.getElementById("time-line");
  time.hidden = !plan.fits;
  time.textContent = plan.fits ? timeLine(plan) : "";
  const tight = document.getElementById("tight-line");
  tight.hidden = state !== "tight";
  tight.textContent = t("ui.tight_line", { leanest: gib(plan.leanest_peak_gib ?? plan.estimate.peak_device_gib), usable: gib(usableGib(plan)) });
  const trainers = document.getElementById("trainers-line");
  trainers.textContent = trainersLine(plan);
  trainers.hidden = !trainers.textContent;
  renderStacks(plan);
  const savers = saversOf(plan.settings);
  const saversLine = document.getElementById("savers-line");
  saversLine.hidden = savers.length === 0;
  saversLine.textContent = t("ui.savers_on", { savers: savers.join(", ") });
  const reasons = document.getElementById("reasons");
  reasons.replaceChildren(...plan.reasons.map((reason) => Object.assign(document.createElement("li"), { textContent: reason })));
  if (page.values.model?.startsWith("upload:")) showUpload("model", page.values.model, { model: page.described[page.values.model]?.model ?? { architecture: plan.model.architecture, num_params: plan.estimate.total_params } });
  renderSuggestions(plan);
  renderRun(plan);
  renderServing(plan);
  setWhatif(plan.settings);
  page.shown = plan.estimate;
  renderChart();
}

function renderServing(plan) {
  // will the merged model run on this card afterwards, at the form's serving context
  const serving = plan.serving;
  const box = document.getElementById("serving-box");
  box.hidden = !serving;
  if (!serving) return;
  document.getElementById("serving-caption").textContent = t("ui.serving_caption", { context: number(serving.context, 0), gpu: serving.gpu ?? plan.gpu.name });
  box.querySelector("tbody").replaceChildren(...serving.formats.map((row) => {
    const line = document.createElement("tr");
    line.dataset.format = row.format;
    line.dataset.fits = String(row.fits_gpu);
    for (const text of [row.format, row.runtime, gib(row.total_gib), row.fits_gpu ? t("ui.yes") : t("ui.no"), row.smallest_gpu ?? "–"]) {
      line.append(Object.assign(document.createElement("td"), { textContent: text }));
    }
    return line;
  }));
}

function nearestFitting(plan) {
  // the settings of the first suggestion, as a query for /api/run: the nearest plan that fits
  const row = (plan.suggestions || [])[0];
  if (!row) return null;
  const values = {};
  for (const key of ["model", "data", "tokens_per_epoch", "epochs", "headroom", "vram", "gpu"]) if (page.values[key]) values[key] = page.values[key];
  for (const [key, value] of Object.entries(row.settings)) if (value != null) values[key] = value;
  if (row.gpu && row.gpu !== plan.gpu.name) { values.gpu = row.gpu; delete values.vram; }
  return { row, values };
}

function renderRun(plan) {
  const instead = document.getElementById("run-instead");
  const commands = document.getElementById("run-commands");
  const nearest = plan.fits ? null : nearestFitting(plan);
  instead.hidden = plan.fits;
  commands.hidden = !plan.fits && !nearest;
  document.getElementById("run-help").hidden = commands.hidden;
  if (plan.fits) return;
  instead.textContent = nearest
    ? t("ui.run_nearest", { change: nearest.row.change, settings: settingsSummary(nearest.row.settings) + (nearest.row.gpu && nearest.row.gpu !== plan.gpu.name ? ` (${nearest.row.gpu})` : "") })
    : t("ui.run_none");
}

function renderSuggestions(plan) {
  const box = document.getElementById("suggestions-box");
  const rows = plan.suggestions || [];
  box.hidden = plan.fits || rows.length === 0;
  const body = box.querySelector("tbody");
  body.replaceChildren(...rows.map((row) => {
    const line = document.createElement("tr");
    const gpu = row.gpu && row.gpu !== plan.gpu.name ? ` (${row.gpu})` : "";
    for (const text of [row.change, settingsSummary(row.settings) + gpu, gib(row.estimate.peak_device_gib)]) {
      line.append(Object.assign(document.createElement("td"), { textContent: text }));
    }
    return line;
  }));
}

function renderChart() {
  const estimate = page.shown;
  const plan = page.plan;
  const chart = document.getElementById("chart");
  const capacity = plan.gpu.memory_gib * (plan.gpu.usable_fraction ?? 1);
  const usable = usableGib(plan);
  const scale = Math.max(capacity, estimate.peak_device_gib) * 1.04;
  const parts = Object.entries(estimate.breakdown_gib);
  const ordered = [...PARTS.filter((part) => part in estimate.breakdown_gib), ...parts.map(([part]) => part).filter((part) => !PARTS.includes(part))];
  const bar = document.createElement("div");
  bar.className = "bar";
  for (const part of ordered) {
    const value = estimate.breakdown_gib[part];
    if (value <= 0) continue;
    const segment = document.createElement("div");
    segment.className = `segment part-${PARTS.includes(part) ? part : "other"}`;
    segment.dataset.part = part;
    segment.dataset.gib = String(value);
    segment.style.width = `${(100 * value) / scale}%`;
    segment.title = `${t(`ui.part.${part}`)}: ${gib(value)}`;
    bar.append(segment);
  }
  const markers = [["capacity", capacity, t("ui.capacity", { gib: gib(capacity) })], ["usable", usable, t("ui.usable", { gib: gib(usable) })]];
  for (const [kind, value, label] of markers) {
    const marker = document.createElement("div");
    marker.className = `marker marker-${kind}`;
    marker.dataset.gib = String(value);
    marker.style.left = `${(100 * value) / scale}%`;
    marker.append(Object.assign(document.createElement("span"), { textContent: label }));
    bar.append(marker);
  }
  chart.replaceChildren(bar);
  chart.dataset.fits = String(estimate.fits);
  chart.setAttribute("aria-label", `${t("ui.device")}: ${gib(estimate.peak_device_gib)}; ${t("ui.usable", { gib: gib(usable) })}`);
  const legend = document.getElementById("chart-legend");
  legend.replaceChildren(...ordered.filter((part) => estimate.breakdown_gib[part] > 0).map((part) => {
    const item = document.createElement("li");
    item.dataset.part = part;
    const swatch = Object.assign(document.createElement("span"), { className: `swatch part-${PARTS.includes(part) ? part : "other"}` });
    item.append(swatch, `${t(`ui.part.${PARTS.includes(part) ? part : "other"}`)} ${gib(estimate.breakdown_gib[part])}`);
    return item;
  }));
  const totals = document.getElementById("chart-totals");
  totals.replaceChildren();
  for (const [key, value] of [["allocated", estimate.peak_allocated_gib], ["reserved", estimate.peak_reserved_gib], ["device", estimate.peak_device_gib]]) {
    const term = Object.assign(document.createElement("dt"), { textContent: t(`ui.${key}`) });
    const figure = Object.assign(document.createElement("dd"), { textContent: gib(value), id: `total-${key}` });
    figure.dataset.gib = String(value);
    totals.append(term, figure);
  }
  document.getElementById("whatif-badge").hidden = page.whatif === null;
}

// --- what if -------------------------------------------------------------------------------------------------
function setWhatif(settings) {
  // number fields that take what the form's fields take (any length, any micro-batch), not a fixed ladder
  for (const name of ["seq_len", "micro_batch"]) {
    const input = document.getElementById(`whatif-${name}`);
    const bounds = option(name)?.bounds ?? {};
    if (bounds.le ?? bounds.lt) input.max = String(bounds.le ?? bounds.lt);
    input.value = String(settings[name]);
  }
  document.getElementById("whatif-grad_ckpt").checked = settings.grad_ckpt;
}

async function whatifChanged() {
  const plan = page.plan;
  const seqLen = Number(document.getElementById("whatif-seq_len").value);
  const microBatch = Number(document.getElementById("whatif-micro_batch").value);
  if (!Number.isInteger(seqLen) || seqLen < 1 || !Number.isInteger(microBatch) || microBatch < 1) return;
  page.whatif = {
    seq_len: seqLen,
    micro_batch: microBatch,
    grad_ckpt: document.getElementById("whatif-grad_ckpt").checked,
  };
  const values = { ...plan.settings, ...page.whatif };
  for (const key of ["model", "gpu", "vram", "headroom"]) if (page.values[key]) values[key] = page.values[key];
  if (!page.values.gpu && !page.values.vram) values.gpu = plan.gpu.name;
  const request = ++page.requests;
  const response = await fetch(`/api/estimate?${query(values)}`);
  const body = await response.json();
  if (request !== page.requests) return;
  clearErrors();
  if (!response.ok) return showError(body);
  page.shown = body;
  renderChart();
}

// --- the GPU table -------------------------------------------------------------------------------------------
function gpuCount(row) {
  return row.settings.n_gpus * (row.settings.nodes ?? 1);
}

function gpuLabel(row) {
  // "2x RTX A5000, FSDP + offload": every card the row needs and how they share the model
  const count = gpuCount(row);
  const s = row.settings;
  const how = [s.shard && s.shard !== "none" ? s.shard.toUpperCase() : "", s.offload && s.offload !== "none" ? t(`ui.offload.${s.offload}`) : ""].filter(Boolean);
  return `${count > 1 ? `${count}x ` : ""}${row.gpu.name}${how.length ? `, ${how.join(" + ")}` : ""}`;
}

function servingAnswer(row) {
  // the smallest-loss format (the list runs from f16 down) that runs on this card after the fine-tune
  const fitting = (row.serving?.formats || []).find((format) => format.fits_gpu);
  return fitting ? fitting.format : t("ui.no");
}

function gpuValue(row, key) {
  return {
    gpu: row.gpu.name,
    memory: row.gpu.memory_gib,
    fits: { fits: 2, tight: 1 }[row.verdict] ?? 0,
    tokens_per_s: row.tokens_per_s,
    hours: row.hours,
    cost_cloud: row.cost_cloud_usd ?? Infinity,
    cost_local: row.cost_local_usd ?? Infinity,
    break_even: row.break_even_runs ?? Infinity,
  }[key];
}

function renderGpus() {
  const { key, descending } = page.sort;
  const rows = [...page.gpuRows].sort((a, b) => {
    const x = gpuValue(a, key);
    const y = gpuValue(b, key);
    const order = typeof x === "string" ? x.localeCompare(y) : x === y ? 0 : x < y ? -1 : 1;
    return descending ? -order : order;
  });
  const mine = page.plan?.gpu?.name;
  const cap = page.values.max_price_hour ? Number(page.values.max_price_hour) : null;
  const body = document.querySelector("#gpus tbody");
  body.replaceChildren(...rows.map((row) => {
    const line = document.createElement("tr");
    line.dataset.gpu = row.gpu.name;
    line.dataset.fits = String(row.fits);
    line.dataset.count = String(gpuCount(row));
    if (row.gpu.name === mine) { line.classList.add("mine"); line.setAttribute("aria-current", "true"); }
    // the cap is per GPU, as --max-price-hour's declaration says
    if (cap != null && row.gpu.rent_usd_per_hour != null && row.gpu.rent_usd_per_hour > cap) line.dataset.overCap = "true";
    const s = row.settings;
    const cells = [
      gpuLabel(row) + (row.gpu.name === mine ? ` (${t("ui.your_card")})` : ""),
      `${number(row.gpu.memory_gb, 0)} GB`,
      t(`ui.verdict_${row.verdict ?? (row.fits ? "fits" : "no")}`),
      `mb ${s.micro_batch} × ${s.grad_accum}${s.grad_ckpt ? ", ckpt" : ""}`,
      number(row.tokens_per_s, 0),
      row.fits ? duration(row.hours) : "–",
      row.fits ? money(row.cost_cloud_usd) : "–",
      row.fits ? money(row.cost_local_usd) : "–",
      row.fits && row.break_even_runs ? t("ui.runs", { n: number(row.break_even_runs, 0) }) : "–",
      servingAnswer(row),
    ];
    for (const text of cells) line.append(Object.assign(document.createElement("td"), { textContent: text }));
    return line;
  }));
  for (const header of document.querySelectorAll("#gpus th[data-sort]")) {
    header.setAttribute("aria-sort", header.dataset.sort === key ? (descending ? "descending" : "ascending") : "none");
  }
  const cheapest = page.gpuRows.find((row) => row.gpu.name === page.cheapest);
  document.getElementById("cheapest").textContent = cheapest ? t("ui.cheapest", { gpu: gpuLabel(cheapest), hours: duration(cheapest.hours), cost: money(cheapest.cost_cloud_usd) }) : t("ui.cheapest_none");
  const capLine = document.getElementById("price-cap");
  capLine.hidden = cap == null;
  if (cap != null) {
    const under = page.gpuRows.find((row) => row.gpu.name === page.cheapestUnderPrice);
    capLine.textContent = under
      ? t("ui.cheapest_under", { cap: money(cap), gpu: gpuLabel(under), hours: duration(under.hours), cost: money(under.cost_cloud_usd) })
      : t("ui.cheapest_under_none", { cap: money(cap) });
  }
}

// --- language and theme --------------------------------------------------------------------------------------
async function setLanguage(lang) {
  page.lang = lang;
  const response = await fetch(`/api/strings/${lang}`);
  page.strings = await response.json();
  translateStatic();
  if (page.declaration) {
    buildForm();
    changed(); // asked again: the plan's reasons, suggestions and errors come in the new language

  }
}

function setTheme(theme) {
  document.documentElement.dataset.theme = theme;
  document.getElementById("theme-toggle").setAttribute("aria-pressed", String(theme === "dark"));
}

// --- start ---------------------------------------------------------------------------------------------------
async function start() {
  const stored = localStorage.getItem("lorafit-theme");
  setTheme(stored || (matchMedia("(prefers-color-scheme: dark)").matches ? "dark" : "light"));
  document.getElementById("theme-toggle").addEventListener("click", () => {
    const theme = document.documentElement.dataset.theme === "dark" ? "light" : "dark";
    localStorage.setItem("lorafit-theme", theme);
    setTheme(theme);
  });
  document.getElementById("lang-select").addEventListener("change", (event) => setLanguage(event.target.value));
  for (const id of ["whatif-seq_len", "whatif-micro_batch", "whatif-grad_ckpt"]) {
    document.getElementById(id).addEventListener("input", debounce(whatifChanged, 250));
  }
  document.getElementById("whatif-reset").addEventListener("click", () => {
    page.whatif = null;
    setWhatif(page.plan.settings);
    page.shown = page.plan.estimate;
    renderChart();
  });
  for (const header of document.querySelectorAll("#gpus th[data-sort] button")) {
    header.addEventListener("click", () => {
      const key = header.parentElement.dataset.sort;
      page.sort = { key, descending: page.sort.key === key ? !page.sort.descending : key !== "gpu" && key !== "hours" && !key.startsWith("cost") };
      renderGpus();
    });
  }
  for (const button of document.querySelectorAll("button.copy")) {
    button.addEventListener("click", () => copy(document.getElementById(button.dataset.copy).textContent, button));
  }
  document.getElementById("share").addEventListener("click", (event) => copy(location.href, event.currentTarget));
  readUrl();
  const [declaration] = await Promise.all([fetch("/api/options").then((r) => r.json()), setLanguage(page.lang)]);
  page.declaration = declaration;
  buildForm();
  document.body.dataset.ready = "true";
  changed();
}

async function copy(text, button) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    const area = Object.assign(document.createElement("textarea"), { value: text });
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  const label = button.querySelector("span");
  const before = label.textContent;
  label.textContent = t("ui.copied");
  setTimeout(() => { label.textContent = before; }, 1200);
}

start();
