// The playground: speaks through the server's WebSocket (/v1/audio/stream) and plays the PCM as it
// comes with Web Audio, so the first audio plays before the speech is done; the words light up from
// the word timings the server sends with the audio. Everything it loads comes from this server.
"use strict";

const $ = (id) => document.getElementById(id);
// What a test (or a curious user in the console) can read: the words highlighted, in order, and
// the last utterance's figures.
const playground = (window.playground = { highlighted: [], last: null, errors: [] });

let session = null; // the utterance in progress (see speak())

function token() {
  return $("token").value.trim();
}

function authHeaders() {
  return token() ? { Authorization: `Bearer ${token()}` } : {};
}

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = !message;
  if (message) playground.errors.push(message);
}

// A request to the server's HTTP API; an error response becomes an Error with the server's words.
async function api(path, options = {}) {
  const response = await fetch(path, { ...options, headers: { ...authHeaders(), ...(options.headers || {}) } });
  if (!response.ok) {
    let message = `${response.status} ${response.statusText}`;
    try {
      const body = await response.json();
      if (body.error && body.error.message) message = body.error.message;
    } catch (_) { /* not JSON: the status line says it */ }
    throw new Error(message);
  }
  return response;
}

async function loadServer() {
  try {
    const [models, voices] = await Promise.all([
      api("/v1/models").then((r) => r.json()),
      api("/v1/audio/voices").then((r) => r.json()),
    ]);
    const model = $("model");
    model.replaceChildren(...models.data.map((m) => new Option(m.id, m.id)));
    fillVoices(voices);
    $("status").textContent = "ready";
    showError("");
  } catch (error) {
    $("status").textContent = "not connected";
    showError(error.message);
  }
}

function fillVoices(body, chosen) {
  const select = $("voice");
  const previous = chosen || select.value;
  select.replaceChildren(...body.voices.map((v) => {
    const label = v.name + (v.default ? " (default)" : "") + (v.registered ? " (cloned)" : "");
    const option = new Option(label, v.name);
    option.title = v.description || "";
    return option;
  }));
  const names = body.voices.map((v) => v.name);
  if (names.includes(previous)) select.value = previous;
  else {
    const fallback = body.voices.find((v) => v.default);
    if (fallback) select.value = fallback.name;
  }
  $("clone").hidden = !body.cloning;
}

// --- words ------------------------------------------------------------------------------------

function renderWords(text, words) {
  // The text as the client sent it, each timed word a span over its [text_start, text_end).
  const box = $("words");
  const nodes = [];
  let at = 0;
  words.forEach((word, index) => {
    if (word.text_start < at) return;
    if (word.text_start > at) nodes.push(document.createTextNode(text.slice(at, word.text_start)));
    const span = document.createElement("span");
    span.className = "word";
    span.dataset.index = String(index);
    span.textContent = text.slice(word.text_start, word.text_end);
    nodes.push(span);
    at = word.text_end;
  });
  if (at < text.length) nodes.push(document.createTextNode(text.slice(at)));
  box.replaceChildren(...nodes);
}

function highlight() {
  if (!session) return;
  const t = session.audio.currentTime - session.playStart;
  let now = -1;
  session.words.forEach((word, index) => {
    if (word.start <= t && t < Math.max(word.end, word.start + 0.02)) now = index;
  });
  if (now >= 0 && now !== session.now) {
    session.now = now;
    playground.highlighted.push(session.words[now].text);
  }
  for (const span of $("words").querySelectorAll("span.word")) {
    const word = session.words[Number(span.dataset.index)];
    span.classList.toggle("now", Number(span.dataset.index) === session.now && t < word.end + 0.05);
    span.classList.toggle("said", word.end <= t);
  }
  const playing = session.audio.currentTime < session.nextTime + 0.05;
  if (!session.finished || playing) session.frame = requestAnimationFrame(highlight);
}

// --- waveform ---------------------------------------------------------------------------------

function drawWave(chunks, total) {
  const canvas = $("wave");
  const context = canvas.getContext("2d");
  const width = canvas.width, height = canvas.height;
  context.clearRect(0, 0, width, height);
  context.fillStyle = "#2456c8";
  if (!total) return;
  let peak = 1e-3; // drawn to the loudest sample so far, so quiet speech still shows
  for (const chunk of chunks) for (let i = 0; i < chunk.length; i++) peak = Math.max(peak, Math.abs(chunk[i]));
  const perColumn = Math.max(1, Math.ceil(total / width));
  let column = 0, low = 0, high = 0, count = 0;
  for (const chunk of chunks) {
    for (let i = 0; i < chunk.length; i++) {
      const v = chunk[i];
      if (v < low) low = v;
      if (v > high) high = v;
      if (++count === perColumn) {
        const top = (1 - high / peak) * height / 2, bottom = (1 - low / peak) * height / 2;
        context.fillRect(column, top, 1, Math.max(1, bottom - top));
        column++; low = 0; high = 0; count = 0;
      }
    }
  }
}

// --- WAV for the player ---------------------------------------------------------------------------

function wavBlob(chunks, rate) {
  const total = chunks.reduce((n, c) => n + c.length, 0);
  const buffer = new ArrayBuffer(44 + total * 2);
  const view = new DataView(buffer);
  const text = (offset, s) => { for (let i = 0; i < s.length; i++) view.setUint8(offset + i, s.charCodeAt(i)); };
  text(0, "RIFF"); view.setUint32(4, 36 + total * 2, true); text(8, "WAVE"); text(12, "fmt ");
  view.setUint32(16, 16, true); view.setUint16(20, 1, true); view.setUint16(22, 1, true);
  view.setUint32(24, rate, true); view.setUint32(28, rate * 2, true); view.setUint16(32, 2, true);
  view.setUint16(34, 16, true); text(36, "data"); view.setUint32(40, total * 2, true);
  let offset = 44;
  for (const chunk of chunks) {
    for (let i = 0; i < chunk.length; i++, offset += 2) {
      view.setInt16(offset, Math.max(-32768, Math.min(32767, Math.round(chunk[i] * 32768))), true);
    }
  }
  return new Blob([buffer], { type: "audio/wav" });
}

// --- speaking ---------------------------------------------------------------------------------

function request() {
  return {
    input: $("text").value,
    voice: $("voice").value || undefined,
    speed: Number($("speed").value),
    model: $("model").value || undefined,
  };
}

function speak() {
  if (session) stop();
  showError("");
  const wanted = request();
  if (!wanted.input.trim()) {
    showError("input: must not be empty");
    return;
  }
  const seed = Math.floor(Math.random() * 2 ** 31);
  const audio = new AudioContext();
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  // A browser cannot set headers on a WebSocket: the token travels as its subprotocol.
  const socket = new WebSocket(`${scheme}//${location.host}/v1/audio/stream`, token() ? [`bearer.${token()}`] : []);
  socket.binaryType = "arraybuffer";
  session = {
    socket, audio, seed, wanted, words: [], chunks: [], total: 0, rate: 24000, now: -1, finished: false,
    clicked: performance.now(), firstAudio: null, playStart: null, nextTime: 0, frame: null,
  };
  playground.highlighted = [];
  playground.last = null;
  $("first-audio").textContent = $("rtf").textContent = $("duration").textContent = "–";
  $("download").disabled = true;
  $("player").removeAttribute("src");
  renderWords(wanted.input, []);
  drawWave([], 0);
  $("speak").disabled = true;
  $("stop").disabled = false;
  const mine = session;
  socket.onopen = () => socket.send(JSON.stringify({
    type: "start", context_id: "play", input: wanted.input, model: wanted.model, voice: wanted.voice,
    speed: wanted.speed, response_format: "pcm", seed,
  }));
  socket.onmessage = (event) => {
    if (session !== mine) return;
    if (typeof event.data !== "string") return play(mine, event.data);
    const message = JSON.parse(event.data);
    if (message.type === "started") mine.rate = message.sample_rate;
    else if (message.type === "words") {
      mine.words.push(...message.words);
      renderWords(wanted.input, mine.words);
    } else if (message.type === "done") finish(mine, message.usage);
    else if (message.type === "error") {
      showError(message.message);
      finish(mine, null);
    } else if (message.type === "interrupted") finish(mine, null);
  };
  socket.onclose = (event) => {
    if (session !== mine || mine.finished) return;
    showError(event.reason || `the connection closed (code ${event.code})`);
    finish(mine, null);
  };
}

function play(mine, data) {
  const pcm = new Int16Array(data);
  if (!pcm.length) return;
  const samples = new Float32Array(pcm.length);
  for (let i = 0; i < pcm.length; i++) samples[i] = pcm[i] / 32768;
  const audio = mine.audio;
  if (mine.firstAudio === null) {
    mine.firstAudio = (performance.now() - mine.clicked) / 1000;
    $("first-audio").textContent = `${Math.round(mine.firstAudio * 1000)} ms`;
    mine.playStart = audio.currentTime + 0.05;
    mine.nextTime = mine.playStart;
    mine.frame = requestAnimationFrame(highlight);
  }
  const buffer = audio.createBuffer(1, samples.length, mine.rate);
  buffer.copyToChannel(samples, 0);
  const source = audio.createBufferSource();
  source.buffer = buffer;
  source.connect(audio.destination);
  // Chunks play back to back; one that comes late starts as soon as it can.
  const at = Math.max(mine.nextTime, audio.currentTime + 0.01);
  source.start(at);
  mine.nextTime = at + buffer.duration;
  mine.chunks.push(samples);
  mine.total += samples.length;
  drawWave(mine.chunks, mine.total);
}

function finish(mine, usage) {
  if (mine.finished) return;
  mine.finished = true;
  const seconds = mine.total / mine.rate;
  const elapsed = (performance.now() - mine.clicked) / 1000;
  if (usage) {
    $("duration").textContent = `${seconds.toFixed(2)} s`;
    $("rtf").textContent = seconds ? (elapsed / seconds).toFixed(3) : "–";
    $("player").src = URL.createObjectURL(wavBlob(mine.chunks, mine.rate));
    $("download").disabled = false;
  }
  playground.last = { seconds, elapsed, firstAudio: mine.firstAudio, rate: mine.rate, words: mine.words,
                      ok: Boolean(usage), seed: mine.seed, wanted: mine.wanted };
  $("speak").disabled = false;
  $("stop").disabled = true;
  try { mine.socket.close(); } catch (_) { /* already closed */ }
}

function stop() {
  if (!session) return;
  const mine = session;
  if (!mine.finished && mine.socket.readyState === WebSocket.OPEN) {
    mine.socket.send(JSON.stringify({ type: "interrupt", context_id: "play" }));
  }
  finish(mine, null);
  cancelAnimationFrame(mine.frame);
  mine.audio.close();
  session = null;
}

async function download() {
  // The same request and seed in the chosen format: seeded speech is the same speech.
  const last = playground.last;
  if (!last) return;
  const format = $("format").value;
  try {
    const response = await api("/v1/audio/speech", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ ...last.wanted, response_format: format, seed: last.seed, stream: false }),
    });
    const link = document.createElement("a");
    link.href = URL.createObjectURL(await response.blob());
    link.download = `speech.${format === "pcm" ? "pcm" : format}`;
    link.click();
  } catch (error) {
    showError(error.message);
  }
}

async function registerVoice(event) {
  event.preventDefault();
  const form = new FormData();
  form.append("name", $("clone-name").value.trim());
  form.append("transcript", $("clone-transcript").value.trim());
  form.append("file", $("clone-file").files[0]);
  try {
    await api("/v1/audio/voices", { method: "POST", body: form });
    const voices = await api("/v1/audio/voices").then((r) => r.json());
    fillVoices(voices, $("clone-name").value.trim());
    showError("");
  } catch (error) {
    showError(error.message);
  }
}

$("speak").addEventListener("click", speak);
$("stop").addEventListener("click", stop);
$("download").addEventListener("click", download);
$("clone-form").addEventListener("submit", registerVoice);
$("text").addEventListener("keydown", (event) => {
  // Ctrl+Enter (Cmd+Enter on a Mac) speaks, as the hint under the text says.
  if (event.key !== "Enter" || !(event.ctrlKey || event.metaKey) || event.altKey || event.shiftKey
      || event.isComposing) return;
  event.preventDefault();
  if (!$("speak").disabled) speak();
});
$("speed").addEventListener("input", () => { $("speed-value").textContent = Number($("speed").value).toFixed(2); });
$("token").value = localStorage.getItem("audio-pipeline-token") || "";
$("token").addEventListener("change", () => {
  localStorage.setItem("audio-pipeline-token", token());
  loadServer();
});
loadServer();
