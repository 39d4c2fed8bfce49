// diffbatch playground: talks to the server's own OpenAI-compatible API, same origin.
//
// - Generate: POST /v1/images/generations (JSON), "Requests" copies at once (seeds
//   seed, seed+1, ...) so they can share a wave.
// - Edit: POST /v1/images/edits (multipart): an uploaded or generated image, and the
//   mask painted on the canvas (transparent where painted, as OpenAI's masks are).
// - With n = 1 the request streams (`stream: true`, `partial_images` from the
//   "Previews" field): the card shows each partial image as the server sends it,
//   then the image (OpenAI's server-sent events, read from the fetch body).
// - Each image shows its seed and the server's timings: the size of the wave it ran
//   in, its queue and forward time (x-diffbatch-* headers, or the completed event's
//   `diffbatch` object when streamed).
// - The wave strip polls GET /v1/waves?after=<last id> once a second.
// - What the model takes comes from GET /v1/models (its `diffbatch` object): the
//   sizes offered, and whether the Edit tab paints masks (inpainting), redraws the
//   whole image only (image-to-image), or is off (no edits).
// - Cards are laid out when the requests are sent, in request order (newest first
//   across clicks), and filled as the answers come.
// - Video (a video model only: GET /v1/videos answers): POST /v1/videos starts a job,
//   its card's bar follows the job's `progress` (GET /v1/videos/{id}), and the clip
//   (GET /v1/videos/{id}/content, fetched with the key) plays in the card when done.
"use strict";

const $ = (id) => document.getElementById(id);
const WAVE_POLL_MS = 1000;
const MAX_WAVES_SHOWN = 40;
const KEY_STORAGE = "diffbatch-playground-api-key";
const VIDEO_POLL_MS = 250;

const state = {
  mode: "generate",
  lastWaveId: 0,
  edit: null, // {blob, name, width, height, url} of the image to edit
  mask: null, // offscreen canvas: opaque, transparent where painted
  painted: false,
  edits: ["image-to-image", "inpaint"], // edit tasks the model runs (GET /v1/models)
  requests: { generate: "1", edit: "1", video: "1" }, // each tab's own "Requests" count
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
  const n = numberField("n");
  const stream = n === undefined || n === 1; // the server streams one image per request
  const fields = {
    prompt: $("prompt").value,
    negative_prompt: $("negative-prompt").value.trim() || undefined,
    size: $("size").value.trim() || undefined,
    num_inference_steps: numberField("steps"),
    guidance_scale: numberField("guidance"),
    n,
    seed,
    stream: stream || undefined,
    partial_images: stream ? numberField("previews") : undefined,
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
  if (state.mode === "video") {
    await submitVideos(copies, firstSeed);
    return;
  }
  // Disabled before anything is awaited (an edit's mask is encoded first): a second
  // press meanwhile sends nothing.
  $("submit").disabled = true;
  try {
    const requests = [];
    for (let i = 0; i < copies; i++) {
      const seed = firstSeed === undefined ? undefined : firstSeed + i;
      requests.push(state.mode === "edit" ? await editRequest(seed) : generationRequest(seed));
    }
    setStatus(`${copies} request${copies > 1 ? "s" : ""} sent…`);
    const started = performance.now();
    const cards = addCards(copies);
    const outcomes = await Promise.all(requests.map((r, i) => send(r, cards[i])));
    const failed = outcomes.filter((o) => o.error);
    setStatus(`${copies - failed.length} of ${copies} done in ${Math.round(performance.now() - started)} ms`);
    if (failed.length) showError(failed[0].error);
  } finally {
    $("submit").disabled = false;
  }
}

// One request's whole answer, shown in its `card`; never throws: a failure at any
// point (the connection lost mid-stream, a body that is not what was promised) is its
// `error`, and a card that got nothing to show is removed.
async function send(request, card) {
  let outcome;
  try {
    outcome = await receive(request, card);
  } catch (err) {
    outcome = { error: `network error: ${err.message || err}` };
  }
  if (outcome.error && card.dataset.state === "waiting") card.remove();
  return outcome;
}

async function receive({ url, init }, card) {
  const response = await fetch(url, init);
  if (!response.ok) return { error: await errorMessage(response) };
  if ((response.headers.get("content-type") || "").startsWith("text/event-stream")) {
    return readStream(response, card);
  }
  const body = await response.json();
  const timing = {
    batchSize: response.headers.get("x-diffbatch-batch-size"),
    queueMs: response.headers.get("x-diffbatch-queue-ms"),
    executeMs: response.headers.get("x-diffbatch-execute-ms"),
    seed: Number(response.headers.get("x-diffbatch-seed")),
  };
  let place = card; // image i goes after image i - 1, in the request's place
  body.data.forEach((item, index) => {
    const seed = Number.isFinite(timing.seed) ? timing.seed + index : "?";
    if (index > 0) {
      const next = makeCard();
      place.after(next);
      place = next;
    }
    showFinal(place, item.b64_json, body.output_format, body.size, { ...timing, seed });
  });
  return {};
}

// A streamed answer in `card`: its partial images, then its image (or an error event).
// A stream that breaks off or ends without its image marks its card failed.
async function readStream(response, card) {
  let completed = false;
  try {
    for await (const { event, data } of serverSentEvents(response)) {
      if (event === "error") {
        if (card.dataset.state !== "waiting") card.dataset.state = "failed";
        return { error: data.error.message };
      }
      if (event.endsWith(".partial_image")) {
        showPartial(card, data);
      } else if (event.endsWith(".completed")) {
        completed = true;
        const extra = data.diffbatch || {};
        showFinal(card, data.b64_json, data.output_format, data.size, {
          batchSize: String(extra.batch_size), queueMs: extra.queue_ms,
          executeMs: extra.execute_ms, seed: extra.seed,
        });
      }
    }
  } catch (err) {
    if (card.dataset.state !== "waiting") card.dataset.state = "failed";
    throw err;
  }
  if (completed) return {};
  if (card.dataset.state !== "waiting") card.dataset.state = "failed";
  return { error: "the stream ended before its image arrived (the server stopped?)" };
}

// The events of a text/event-stream body: {event, data (parsed JSON)}, as they arrive.
async function* serverSentEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const fields = {};
      for (const line of buffer.slice(0, end).split("\n")) {
        const colon = line.indexOf(":");
        if (colon > 0) fields[line.slice(0, colon)] = line.slice(colon + 1).replace(/^ /, "");
      }
      buffer = buffer.slice(end + 2);
      if (fields.data !== undefined) yield { event: fields.event || "message", data: JSON.parse(fields.data) };
    }
  }
}

// -- results --------------------------------------------------------------------------
// `count` empty cards at the top of the results, in request order (the first request's
// first), each waiting for its answer.
function addCards(count) {
  const results = $("results");
  const empty = results.querySelector(".empty");
  if (empty) empty.remove();
  const cards = Array.from({ length: count }, makeCard);
  results.prepend(...cards);
  return cards;
}

function makeCard() {
  const card = document.createElement("figure");
  card.className = "card";
  card.dataset.state = "waiting";
  const frame = document.createElement("div");
  frame.className = "frame";
  const image = document.createElement("img");
  image.alt = `${state.mode === "edit" ? "edited" : "generated"} image`;
  const badge = document.createElement("span");
  badge.className = "badge";
  frame.append(image, badge);
  const meta = document.createElement("dl");
  meta.className = "meta";
  const prompt = document.createElement("figcaption");
  prompt.className = "prompt";
  prompt.textContent = $("prompt").value;
  card.append(frame, prompt, meta);
  return card;
}

function showPartial(card, event) {
  card.dataset.state = "partial";
  card.dataset.partialIndex = String(event.partial_image_index);
  card.querySelector("img").src = `data:image/${event.output_format};base64,${event.b64_json}`;
  card.querySelector(".badge").textContent = `preview ${event.partial_image_index + 1}`;
}

function showFinal(card, b64, format, size, timing) {
  format = format || "png";
  card.dataset.state = "final";
  card.dataset.waveSize = timing.batchSize;
  card.dataset.seed = String(timing.seed);
  const image = card.querySelector("img");
  image.src = `data:image/${format};base64,${b64}`;
  image.alt += `, seed ${timing.seed}`;
  card.querySelector(".badge").textContent = "";
  const meta = card.querySelector(".meta");
  meta.replaceChildren();
  for (const [name, value] of [
    ["seed", timing.seed],
    ["wave", `${timing.batchSize} request${timing.batchSize === "1" ? "" : "s"}`],
    ["queue", `${Number(timing.queueMs).toFixed(0)} ms`],
    ["forward", `${Number(timing.executeMs).toFixed(0)} ms`],
    ["size", size],
  ]) {
    const dt = document.createElement("dt");
    dt.textContent = name;
    const dd = document.createElement("dd");
    dd.textContent = value;
    dd.className = name;
    meta.append(dt, dd);
  }
  const editButton = document.createElement("button");
  editButton.type = "button";
  editButton.className = "secondary edit-this";
  editButton.textContent = "Edit";
  editButton.addEventListener("click", () => {
    const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
    setEditImage(new Blob([bytes], { type: `image/${format}` }), `result.${format}`);
    setMode("edit");
  });
  card.append(editButton);
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

// Paint from the stroke's last point (`from`, null at its start) to the pointer: a
// line as wide as the brush, so a fast stroke is one band, not a row of dots. Returns
// the point painted, the next segment's start.
function paintTo(event, from) {
  const overlay = $("edit-mask");
  const box = overlay.getBoundingClientRect();
  const scale = overlay.width / box.width;
  const to = { x: (event.clientX - box.left) * scale, y: (event.clientY - box.top) * scale };
  const width = Number($("brush").value) * scale;
  const shown = overlay.getContext("2d");
  shown.strokeStyle = getComputedStyle(document.documentElement).getPropertyValue("--paint");
  segment(shown, from || to, to, width);
  const mask = state.mask.getContext("2d");
  mask.globalCompositeOperation = "destination-out"; // transparent where painted
  segment(mask, from || to, to, width);
  state.painted = true;
  return to;
}

function segment(context, from, to, width) {
  context.lineWidth = width;
  context.lineCap = "round";
  context.beginPath();
  context.moveTo(from.x, from.y);
  context.lineTo(to.x, to.y);
  context.stroke();
}

function canvasBlob(canvas) {
  return new Promise((resolve) => canvas.toBlob(resolve, "image/png"));
}

function wirePainting() {
  const overlay = $("edit-mask");
  let last = null; // the stroke's last point; null while the pointer is up
  overlay.addEventListener("pointerdown", (e) => {
    if (!canInpaint()) return;
    overlay.setPointerCapture(e.pointerId);
    last = paintTo(e, null);
  });
  overlay.addEventListener("pointermove", (e) => { if (last) last = paintTo(e, last); });
  for (const name of ["pointerup", "pointercancel"]) overlay.addEventListener(name, () => { last = null; });
}

function canInpaint() { return state.edits.includes("inpaint"); }

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
    else if (i < wave.num_errors + (wave.num_aborted || 0)) block.className = "aborted";
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

// -- video: jobs of /v1/videos ---------------------------------------------------------
function videoFields(seed) {
  const fields = {
    prompt: $("prompt").value,
    negative_prompt: $("negative-prompt").value.trim() || undefined,
    size: $("size").value.trim() || undefined,
    seconds: $("seconds").value.trim() || undefined,
    num_inference_steps: numberField("steps"),
    guidance_scale: numberField("guidance"),
    seed,
  };
  if (fields.size === "auto") delete fields.size;
  for (const name of Object.keys(fields)) if (fields[name] === undefined) delete fields[name];
  return fields;
}

async function submitVideos(copies, firstSeed) {
  $("submit").disabled = true;
  try {
    setStatus(`${copies} video job${copies > 1 ? "s" : ""} sent…`);
    const started = performance.now();
    const cards = Array.from({ length: copies }, makeVideoCard);
    const results = $("results");
    const empty = results.querySelector(".empty");
    if (empty) empty.remove();
    results.prepend(...cards);
    const outcomes = await Promise.all(cards.map((card, i) =>
      runVideo(firstSeed === undefined ? undefined : firstSeed + i, card)
        .catch((error) => ({ error: String(error) }))));
    const failed = outcomes.filter((o) => o.error);
    setStatus(`${copies - failed.length} of ${copies} videos done in ` +
      `${Math.round(performance.now() - started)} ms`);
    if (failed.length) showError(failed[0].error);
  } finally {
    $("submit").disabled = false;
  }
}

function makeVideoCard() {
  const card = document.createElement("figure");
  card.className = "card video-card";
  card.dataset.state = "queued";
  const frame = document.createElement("div");
  frame.className = "frame";
  const video = document.createElement("video");
  video.controls = true;
  video.loop = true;
  video.muted = true;
  video.playsInline = true;
  const bar = document.createElement("progress");
  bar.max = 100;
  bar.value = 0;
  const badge = document.createElement("span");
  badge.className = "badge";
  badge.textContent = "queued";
  frame.append(video, bar, badge);
  const prompt = document.createElement("figcaption");
  prompt.className = "prompt";
  prompt.textContent = $("prompt").value;
  card.append(frame, prompt);
  return card;
}

async function runVideo(seed, card) {
  const response = await fetch("/v1/videos", {
    method: "POST",
    headers: { "Content-Type": "application/json", ...authHeaders() },
    body: JSON.stringify(videoFields(seed)),
  });
  if (!response.ok) return failVideo(card, await errorMessage(response));
  let job = await response.json();
  card.dataset.videoId = job.id;
  while (job.status === "queued" || job.status === "in_progress") {
    showVideoProgress(card, job);
    await new Promise((resolve) => setTimeout(resolve, VIDEO_POLL_MS));
    const poll = await fetch(`/v1/videos/${job.id}`, { headers: authHeaders() });
    if (!poll.ok) return failVideo(card, await errorMessage(poll));
    job = await poll.json();
  }
  if (job.status !== "completed") {
    return failVideo(card, (job.error && job.error.message) || `the job ${job.status}`);
  }
  showVideoProgress(card, job);
  const content = await fetch(`/v1/videos/${job.id}/content`, { headers: authHeaders() });
  if (!content.ok) return failVideo(card, await errorMessage(content));
  const video = card.querySelector("video");
  video.src = URL.createObjectURL(await content.blob());
  video.play().catch(() => { /* autoplay refused: the controls remain */ });
  card.dataset.state = "final";
  card.querySelector(".badge").textContent = `${job.size}, ${job.seconds} s`;
  return {};
}

function showVideoProgress(card, job) {
  card.dataset.state = job.status;
  card.dataset.progress = String(job.progress);
  card.querySelector("progress").value = job.progress;
  card.querySelector(".badge").textContent =
    job.status === "in_progress" ? `${job.progress} %` : job.status.replace("_", " ");
}

function failVideo(card, message) {
  card.dataset.state = "failed";
  card.querySelector(".badge").textContent = "failed";
  return { error: message };
}

// -- page -------------------------------------------------------------------------------
function setMode(mode) {
  state.requests[state.mode] = $("requests").value; // each tab keeps its own count
  $("requests").value = state.requests[mode];
  state.mode = mode;
  $("tab-generate").classList.toggle("active", mode === "generate");
  $("tab-edit").classList.toggle("active", mode === "edit");
  $("tab-video").classList.toggle("active", mode === "video");
  $("edit-panel").hidden = mode !== "edit";
  $("video-panel").hidden = mode !== "video";
  $("submit").textContent = { edit: "Edit", video: "Generate video" }[mode] || "Generate";
}

function setStatus(text) { $("status").textContent = text; }

function showError(text) {
  $("error").hidden = !text;
  $("error").textContent = text || "";
}

async function showModel() {
  try {
    const response = await fetch("/v1/models", { headers: authHeaders() });
    if (!response.ok) {
      $("model").textContent =
        `model: (${response.status === 401 ? "enter the API key" : await errorMessage(response)})`;
      return;
    }
    const models = (await response.json()).data;
    $("model").textContent = `model: ${models.map((m) => m.id).join(", ")}`;
    const accepts = models[0] && models[0].diffbatch;
    if (accepts) showWhatTheModelTakes(accepts);
    await offerVideo();
  } catch (_) {
    $("model").textContent = "model: (server unreachable)";
  }
}

// A video model serves GET /v1/videos (an image model answers 404): the Video tab is
// then the page's only one.
async function offerVideo() {
  const response = await fetch("/v1/videos?limit=1", { headers: authHeaders() });
  const video = response.ok;
  $("tab-video").hidden = !video;
  $("tab-generate").disabled = video;
  $("tab-edit").disabled = video || !state.edits.length;
  if (video && state.mode !== "video") setMode("video");
}

// Offer the sizes the model takes, and paint masks only for a model that inpaints.
function showWhatTheModelTakes(accepts) {
  const sizes = $("sizes");
  sizes.replaceChildren();
  for (const size of ["auto", ...accepts.sizes]) {
    const option = document.createElement("option");
    option.value = size;
    sizes.append(option);
  }
  $("size").placeholder = `auto (${accepts.default_size})`;
  state.edits = accepts.edits;
  const note = $("edit-note");
  if (!accepts.edits.length) {
    note.textContent = "This model cannot edit images: it runs no image-to-image or inpainting pipeline.";
  } else if (!canInpaint()) {
    note.textContent = "This model cannot inpaint: an edit redraws the whole image " +
      "(image-to-image), so there is no mask to paint.";
  }
  note.hidden = canInpaint();
  $("edit-mask").hidden = !canInpaint();
  $("mask-tools").hidden = !canInpaint();
  $("tab-edit").disabled = !accepts.edits.length;
}

function start() {
  $("api-key").value = sessionStorage.getItem(KEY_STORAGE) || "";
  $("api-key").addEventListener("change", () => {
    sessionStorage.setItem(KEY_STORAGE, $("api-key").value.trim());
    showModel();
  });
  $("tab-generate").addEventListener("click", () => setMode("generate"));
  $("tab-edit").addEventListener("click", () => setMode("edit"));
  $("tab-video").addEventListener("click", () => setMode("video"));
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
