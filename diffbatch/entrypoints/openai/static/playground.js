// diffbatch playground: talks to the server's own OpenAI-compatible API, same origin.
//
// - Generate: POST /v1/images/generations (JSON), "Requests" copies at once (seeds
//   seed, seed+1, ...) so they can share a wave.
// - Edit: POST /v1/images/edits (multipart): an uploaded or generated image, and the
//   mask painted on the canvas (transparent where painted, as OpenAI's masks are).
// - Each image shows its seed and the server's timing headers: the size of the wave
//   it ran in (x-diffbatch-batch-size), its queue and forward time.
// - The wave strip polls GET /v1/waves?after=<last id> once a second.
"use strict";

const $ = (id) => document.getElementById(id);
const WAVE_POLL_MS = 1000;
const MAX_WAVES_SHOWN = 40;
const KEY_STORAGE = "diffbatch-playground-api-key";

const state = {
  mode: "generate",
  lastWaveId: 0,
  edit: null, // {blob, name, width, height, url} of the image to edit
  mask: null, // offscreen canvas: opaque, transparent where painted
  painted: false,
};

// -- API ------------------------------------------------------------------------------
function authHeaders() {
  const key = $("api-key").value.trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (_) { /* not JSON */ }
  return `HTTP ${response.status}`;
}

function numberField(id) {
  const text = $(id).value.trim();
  return text === "" ? undefined : Number(text);
}

function commonFields(seed) {
  const fields = {
    prompt: $("prompt").value,
    negative_prompt: $("negative-prompt").value.trim() || undefined,
    size: $("size").value.trim() || undefined,
    num_inference_steps: numberField("steps"),
    guidance_scale: numberField("guidance"),
    n: numberField("n"),
    seed,
  };
  for (const name of Object.keys(fields)) if (fields[name] === undefined) delete fields[name];
  return fields;
}

function generationRequest(seed) {
  return {
    url: "/v1/images/generations",
    init: {
      method: "POST",
      headers: { "Content-Type": "application/json", ...authHeaders() },
      body: JSON.stringify(commonFields(seed)),
    },
  };
}

async function editRequest(seed) {
  const form = new FormData();
  for (const [name, value] of Object.entries(commonFields(seed))) form.append(name, String(value));
  const strength = numberField("strength");
  if (strength !== undefined) form.append("strength", String(strength));
  form.append("image", state.edit.blob, state.edit.name);
  if (state.painted) form.append("mask", await canvasBlob(state.mask), "mask.png");
  // No Content-Type: the browser sets multipart/form-data with its boundary.
  return { url: "/v1/images/edits", init: { method: "POST", headers: authHeaders(), body: form } };
}

// -- submit ---------------------------------------------------------------------------
async function submit(event) {
  event.preventDefault();
  showError(null);
  if (state.mode === "edit" && !state.edit) {
    showError("Choose an image to edit first (upload one, or press “Edit” under a result).");
    return;
  }
  const copies = Math.max(1, Math.min(16, numberField("requests") || 1));
  const firstSeed = numberField("seed");
  const requests = [];
  for (let i = 0; i < copies; i++) {
    const seed = firstSeed === undefined ? undefined : firstSeed + i;
    requests.push(state.mode === "edit" ? await editRequest(seed) : generationRequest(seed));
  }
  $("submit").disabled = true;
  setStatus(`${copies} request${copies > 1 ? "s" : ""} sent…`);
  const started = performance.now();
  const outcomes = await Promise.all(requests.map((r) => send(r)));
  const failed = outcomes.filter((o) => o.error);
  $("submit").disabled = false;
  setStatus(`${copies - failed.length} of ${copies} done in ${Math.round(performance.now() - started)} ms`);
  if (failed.length) showError(failed[0].error);
}

async function send({ url, init }) {
  let response;
  try {
    response = await fetch(url, init);
  } catch (err) {
    return { error: `network error: ${err}` };
  }
  if (!response.ok) return { error: await errorMessage(response) };
  const body = await response.json();
  const timing = {
    batchSize: response.headers.get("x-diffbatch-batch-size"),
    queueMs: response.headers.get("x-diffbatch-queue-ms"),
    executeMs: response.headers.get("x-diffbatch-execute-ms"),
    seed: Number(response.headers.get("x-diffbatch-seed")),
  };
  body.data.forEach((item, index) => addResult(item, index, body, timing));
  return {};
}

// -- results --------------------------------------------------------------------------
function addResult(item, index, body, timing) {
  const results = $("results");
  const empty = results.querySelector(".empty");
  if (empty) empty.remove();
  const format = body.output_format || "png";
  const seed = Number.isFinite(timing.seed) ? timing.seed + index : "?";
  const card = document.createElement("figure");
  card.className = "card";
  card.dataset.waveSize = timing.batchSize;
  card.dataset.seed = String(seed);
  const image = document.createElement("img");
  image.src = `data:image/${format};base64,${item.b64_json}`;
  image.alt = `${state.mode === "edit" ? "edited" : "generated"} image, seed ${seed}`;
  const meta = document.createElement("dl");
  meta.className = "meta";
  for (const [name, value] of [
    ["seed", seed],
    ["wave", `${timing.batchSize} request${timing.batchSize === "1" ? "" : "s"}`],
    ["queue", `${Number(timing.queueMs).toFixed(0)} ms`],
    ["forward", `${Number(timing.executeMs).toFixed(0)} ms`],
    ["size", body.size],
  ]) {
    const dt = document.createElement("dt");
    dt.textContent = name;
    const dd = document.createElement("dd");
    dd.textContent = value;
    dd.className = name;
    meta.append(dt, dd);
  }
  const prompt = document.createElement("figcaption");
  prompt.className = "prompt";
  prompt.textContent = $("prompt").value;
  const editButton = document.createElement("button");
  editButton.type = "button";
  editButton.className = "secondary edit-this";
  editButton.textContent = "Edit";
  editButton.addEventListener("click", () => {
    const bytes = Uint8Array.from(atob(item.b64_json), (c) => c.charCodeAt(0));
    setEditImage(new Blob([bytes], { type: `image/${format}` }), `result.${format}`);
    setMode("edit");
  });
  card.append(image, prompt, meta, editButton);
  results.prepend(card);
}

// -- edit: the image and its painted mask -----------------------------------------------
function setEditImage(blob, name) {
  if (state.edit) URL.revokeObjectURL(state.edit.url);
  const url = URL.createObjectURL(blob);
  const image = $("edit-image");
  image.onload = () => {
    state.edit = { blob, name, url, width: image.naturalWidth, height: image.naturalHeight };
    const overlay = $("edit-mask");
    overlay.width = state.edit.width;
    overlay.height = state.edit.height;
    state.mask = document.createElement("canvas");
    state.mask.width = state.edit.width;
    state.mask.height = state.edit.height;
    clearMask();
    $("edit-stage").hidden = false;
  };
  image.onerror = () => showError("That file is not an image this browser can show.");
  image.src = url;
}

function clearMask() {
  if (!state.mask) return;
  const overlay = $("edit-mask");
  overlay.getContext("2d").clearRect(0, 0, overlay.width, overlay.height);
  const mask = state.mask.getContext("2d");
  mask.globalCompositeOperation = "source-over";
  mask.fillStyle = "#000";
  mask.fillRect(0, 0, state.mask.width, state.mask.height);
  state.painted = false;
}

function paintAt(event) {
  const overlay = $("edit-mask");
  const box = overlay.getBoundingClientRect();
  const scale = overlay.width / box.width;
  const x = (event.clientX - box.left) * scale;
  const y = (event.clientY - box.top) * scale;
  const radius = (Number($("brush").value) / 2) * scale;
  const shown = overlay.getContext("2d");
  shown.fillStyle = getComputedStyle(document.documentElement).getPropertyValue("--paint");
  circle(shown, x, y, radius);
  const mask = state.mask.getContext("2d");
  mask.globalCompositeOperation = "destination-out"; // transparent where painted
  circle(mask, x, y, radius);
  state.painted = true;
}

function circle(context, x, y, radius) {
  context.beginPath();
  context.arc(x, y, radius, 0, 2 * Math.PI);
  context.fill();
}

function canvasBlob(canvas) {
  return new Promise((resolve) => canvas.toBlob(resolve, "image/png"));
}

function wirePainting() {
  const overlay = $("edit-mask");
  let down = false;
  overlay.addEventListener("pointerdown", (e) => {
    down = true;
    overlay.setPointerCapture(e.pointerId);
    paintAt(e);
  });
  overlay.addEventListener("pointermove", (e) => { if (down) paintAt(e); });
  for (const name of ["pointerup", "pointercancel"]) overlay.addEventListener(name, () => { down = false; });
}

// -- the live wave strip ----------------------------------------------------------------
async function pollWaves() {
  try {
    const response = await fetch(`/v1/waves?after=${state.lastWaveId}`, { headers: authHeaders() });
    if (response.ok) {
      const body = await response.json();
      for (const wave of body.data) addWave(wave);
      state.lastWaveId = Math.max(state.lastWaveId, body.last_id);
    }
  } catch (_) { /* the server is restarting; try again */ }
  setTimeout(pollWaves, WAVE_POLL_MS);
}

function addWave(wave) {
  const strip = $("waves");
  const item = document.createElement("li");
  item.className = "new";
  item.dataset.size = String(wave.num_requests);
  item.dataset.id = String(wave.id);
  item.title = `wave ${wave.wave_id}: admission wait ended by ${wave.admission}, ` +
    `longest queue wait ${wave.max_queue_wait_ms.toFixed(0)} ms`;
  const blocks = document.createElement("span");
  blocks.className = "blocks";
  for (let i = 0; i < wave.num_requests; i++) {
    const block = document.createElement("i");
    if (i < wave.num_errors) block.className = "failed";
    blocks.append(block);
  }
  const label = document.createElement("span");
  label.textContent = `${wave.num_requests} req · ${wave.forward_ms.toFixed(0)} ms · ${wave.close_reason}`;
  const key = document.createElement("span");
  key.className = "key";
  key.textContent = wave.key;
  item.append(blocks, label, key);
  strip.append(item);
  while (strip.children.length > MAX_WAVES_SHOWN) strip.firstElementChild.remove();
}

// -- page -------------------------------------------------------------------------------
function setMode(mode) {
  state.mode = mode;
  $("tab-generate").classList.toggle("active", mode === "generate");
  $("tab-edit").classList.toggle("active", mode === "edit");
  $("edit-panel").hidden = mode !== "edit";
  $("submit").textContent = mode === "edit" ? "Edit" : "Generate";
}

function setStatus(text) { $("status").textContent = text; }

function showError(text) {
  $("error").hidden = !text;
  $("error").textContent = text || "";
}

async function showModel() {
  try {
    const response = await fetch("/v1/models", { headers: authHeaders() });
    $("model").textContent = response.ok
      ? `model: ${(await response.json()).data.map((m) => m.id).join(", ")}`
      : `model: (${response.status === 401 ? "enter the API key" : await errorMessage(response)})`;
  } catch (_) {
    $("model").textContent = "model: (server unreachable)";
  }
}

function start() {
  $("api-key").value = sessionStorage.getItem(KEY_STORAGE) || "";
  $("api-key").addEventListener("change", () => {
    sessionStorage.setItem(KEY_STORAGE, $("api-key").value.trim());
    showModel();
  });
  $("tab-generate").addEventListener("click", () => setMode("generate"));
  $("tab-edit").addEventListener("click", () => setMode("edit"));
  $("edit-file").addEventListener("change", (e) => {
    const file = e.target.files[0];
    if (file) setEditImage(file, file.name);
  });
  $("clear-mask").addEventListener("click", clearMask);
  $("form").addEventListener("submit", submit);
  wirePainting();
  showModel();
  pollWaves();
  document.body.dataset.ready = "true";
}

start();
