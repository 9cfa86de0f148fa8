// The playground: speaks through the server's WebSocket (/v1/audio/stream) and plays the PCM as it
// comes with Web Audio, so the first audio plays before the speech is done; the words light up from
// the word timings the server sends with the audio. Everything it loads comes from this server.
//
// An utterance (a "session") is spoken, then played: Stop stays on until its playback ends. When
// the synthesis ends (done, stopped or failed) the player holds the audio received for it, and only
// that: a new utterance or an error leaves no earlier clip behind.
"use strict";

const $ = (id) => document.getElementById(id);
// What a test (or a curious user in the console) can read: the words highlighted, in order, the
// last utterance's figures (set when its synthesis ends), the errors shown, where its playback
// stands (idle, playing, ended, stopped) and its Web Audio context (audio); the functions below add
// the player's WAV, how much has come of the utterance in progress and the audible-onset rule.
const playground = (window.playground = { highlighted: [], last: null, errors: [], playback: "idle", audio: null });

let session = null; // the utterance being spoken or played (see speak())
let clip = null; // what the player holds: the audio received for the last utterance (see setClip())
let connected = false;
// The WAV the player holds (null: none).
playground.clipBlob = () => (clip ? clip.blob : null);
// How much of the utterance in progress has come: samples and timed words (null: none in progress).
playground.received = () => (session && session.synthesizing
  ? { samples: session.total, words: session.words.length } : null);

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
    connected = true;
    showError("");
  } catch (error) {
    connected = false;
    showError(error.message);
  }
  update();
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

// --- audible onset ------------------------------------------------------------------------------
// A port of audio_pipeline/audio/audibility.py (keep the two the same): a sample is the audible
// onset when it starts the first two consecutive 20 ms frames (10 ms hop, each frame's mean
// removed) whose RMS is at or above -45 dBFS (full scale 1.0).

const FRAME_S = 0.020;
const HOP_S = 0.010;
const AUDIBLE_DBFS = -45.0;
const FRAMES_NEEDED = 2;
const AUDIBLE_RMS = 10.0 ** (AUDIBLE_DBFS / 20.0);

// Python's round(): halves go to the even neighbour (22050 Hz: a 220.5-sample hop is 220).
function roundHalfEven(x) {
  const nearest = Math.round(x);
  return nearest - x === 0.5 && nearest % 2 !== 0 ? nearest - 1 : nearest;
}

// For each frame start 0, hop, 2 hop, ... that fits in samples: whether its RMS, mean removed,
// reaches the audible level.
function loudFrames(samples, frame, hop) {
  const count = Math.max(0, Math.floor((samples.length - frame) / hop) + 1);
  const loud = new Uint8Array(count);
  for (let f = 0; f < count; f++) {
    const start = f * hop, end = start + frame;
    let sum = 0;
    for (let i = start; i < end; i++) sum += samples[i];
    const mean = sum / frame;
    let power = 0;
    for (let i = start; i < end; i++) {
      const d = samples[i] - mean;
      power += d * d;
    }
    loud[f] = Math.sqrt(power / frame) >= AUDIBLE_RMS ? 1 : 0;
  }
  return loud;
}

// The index of the audible onset in samples (mono floats), or null when nothing is audible.
function audibleOnset(samples, sampleRate) {
  const frame = roundHalfEven(FRAME_S * sampleRate), hop = roundHalfEven(HOP_S * sampleRate);
  const loud = loudFrames(samples, frame, hop);
  let run = 0;
  for (let f = 0; f < loud.length; f++) {
    run = loud[f] ? run + 1 : 0;
    if (run >= FRAMES_NEEDED) return (f - FRAMES_NEEDED + 1) * hop;
  }
  return null;
}

// The audible onset of a stream fed in pieces: feed() returns the onset's sample index (counted
// from the stream's start) in the piece that completes it, else null; afterwards it returns null.
// Keeps only the samples of frames not yet analysed between pieces.
class OnsetTracker {
  constructor(sampleRate) {
    this.frame = roundHalfEven(FRAME_S * sampleRate);
    this.hop = roundHalfEven(HOP_S * sampleRate);
    this.tail = new Float32Array(0);
    this.tailStart = 0;
    this.run = 0; // loud frames in a row up to the last one analysed (a run may straddle pieces)
    this.onset = null;
  }

  feed(samples) {
    if (this.onset !== null) return null;
    const pending = new Float32Array(this.tail.length + samples.length);
    pending.set(this.tail);
    pending.set(samples, this.tail.length);
    const loud = loudFrames(pending, this.frame, this.hop);
    for (let f = 0; f < loud.length; f++) {
      this.run = loud[f] ? this.run + 1 : 0;
      if (this.run >= FRAMES_NEEDED) {
        this.onset = this.tailStart + (f - FRAMES_NEEDED + 1) * this.hop;
        this.tail = new Float32Array(0);
        return this.onset;
      }
    }
    const consumed = loud.length * this.hop;
    this.tail = pending.slice(consumed);
    this.tailStart += consumed;
    return null;
  }
}

playground.audibility = { onset: audibleOnset, OnsetTracker, FRAME_S, HOP_S, AUDIBLE_DBFS, FRAMES_NEEDED };

// --- words ------------------------------------------------------------------------------------

function isSsml(text) {
  return text.trimStart().startsWith("<speak");
}

const TAG = /<!--[\s\S]*?-->|<(?:[^>"']|"[^"]*"|'[^']*')*>/g;
const ENTITIES = { amp: "&", lt: "<", gt: ">", quot: '"', apos: "'" };

// What SSML text reads as: no tags (one between two letters parts them: "a<break/>b" is "a b"),
// entities decoded.
function ssmlText(source) {
  const untagged = source.replace(TAG, "\u0000").replace(/(?<=[\p{L}\p{N}])\u0000+(?=[\p{L}\p{N}])/gu, " ")
    .replace(/\u0000/g, "");
  return untagged.replace(/&(#x[0-9a-f]+|#[0-9]+|[a-z]+);/gi, (whole, name) => {
    if (name[0] === "#") {
      const code = name[1] === "x" || name[1] === "X" ? parseInt(name.slice(2), 16) : parseInt(name.slice(1), 10);
      return Number.isFinite(code) && code <= 0x10ffff ? String.fromCodePoint(code) : whole;
    }
    return ENTITIES[name.toLowerCase()] ?? whole;
  });
}

// The words of an utterance as the page shows them: [text between, word, text between, ...]. Plain
// text reads as the client wrote it, each timed word a span over its [text_start, text_end); an
// SSML document reads as it is spoken: the words as said (a <sub>'s alias, an entity's word), no
// markup, its whitespace folded.
function wordParts(text, words, ssml) {
  const parts = [];
  let at = 0;
  words.forEach((word, index) => {
    if (word.text_start < at) return;
    parts.push({ text: text.slice(at, word.text_start) });
    const shown = ssml ? (word.spoken || ssmlText(text.slice(word.text_start, word.text_end)).trim())
      : text.slice(word.text_start, word.text_end);
    parts.push({ text: shown, index });
    at = word.text_end;
  });
  parts.push({ text: text.slice(at) });
  if (ssml) {
    parts.forEach((part, i) => {
      if (part.index !== undefined) return;
      const between = i > 0 && i < parts.length - 1;
      let shown = ssmlText(part.text).replace(/\s+/g, " ");
      // Markup between two words parts them (<break/>): "a<break/>b" reads "a b", "a</sub>,b" "a, b".
      if (between && part.text.includes("<") && !/\s/.test(shown)) shown += " ";
      if (i === 0) shown = shown.trimStart();
      if (i === parts.length - 1) shown = shown.trimEnd();
      part.text = shown;
    });
  }
  return parts;
}

function renderWords(view) {
  const nodes = wordParts(view.wanted.input, view.words, view.ssml).filter((p) => p.text).map((part) => {
    if (part.index === undefined) return document.createTextNode(part.text);
    const span = document.createElement("span");
    span.className = "word";
    span.dataset.index = String(part.index);
    span.textContent = part.text;
    return span;
  });
  $("words").replaceChildren(...nodes);
  if (view.heard !== undefined) paint(view, view.heard);
}

// Lights the words of ``view`` (the utterance playing, or the player's clip) at ``t`` seconds into
// its audio: the word sounding then, and those already said; null: none (a reset).
function paint(view, t) {
  view.heard = t;
  let now = -1;
  if (t !== null) {
    view.words.forEach((word, index) => {
      if (word.start <= t && t < Math.max(word.end, word.start + 0.02)) now = index;
    });
  }
  if (now >= 0 && now !== view.lit) {
    view.lit = now;
    const span = $("words").querySelector(`span.word[data-index="${now}"]`);
    playground.highlighted.push(span ? span.textContent : view.words[now].text);
  }
  for (const span of $("words").querySelectorAll("span.word")) {
    const index = Number(span.dataset.index);
    span.classList.toggle("now", index === now);
    span.classList.toggle("said", t !== null && index !== now && view.words[index].end <= t);
  }
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

// --- the player: the last utterance's audio -----------------------------------------------------

function clearClip() {
  const player = $("player");
  player.pause();
  if (clip) URL.revokeObjectURL(clip.url);
  clip = null;
  // Without load() the element keeps playing the old source after its src is gone.
  player.removeAttribute("src");
  player.load();
  $("download").disabled = true;
  $("format").disabled = false;
  $("download-note").textContent = "";
}

// The player gets the audio received for ``mine``: all of it (``complete``), or what came before a
// stop or an error, which is all Download can offer then (as WAV: the server's other formats
// would be the whole text).
function setClip(mine, complete) {
  clearClip();
  if (!mine.total) return;
  const blob = wavBlob(mine.chunks, mine.rate);
  clip = { blob, url: URL.createObjectURL(blob), complete, chunks: mine.chunks, total: mine.total,
           rate: mine.rate, words: mine.words, wanted: mine.wanted, ssml: mine.ssml, seed: mine.seed, lit: -1,
           heard: null };
  $("player").src = clip.url;
  $("download").disabled = false;
  $("format").disabled = !complete;
  if (!complete) {
    const seconds = (mine.total / mine.rate).toFixed(2);
    $("download-note").textContent = `Stopped: Download saves the ${seconds} s received, as WAV.`;
  }
}

function followPlayer() {
  const player = $("player");
  if (!clip || player.paused) return;
  paint(clip, player.currentTime);
  requestAnimationFrame(followPlayer);
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

// The buttons and the status line, from where the utterance stands.
function update() {
  const s = session;
  $("speak").disabled = Boolean(s && s.synthesizing);
  $("stop").disabled = !(s && (s.synthesizing || s.playing));
  $("status").textContent = s && s.synthesizing ? "speaking…" : s && s.playing ? "playing…"
    : connected ? "ready" : "not connected";
}

function speak() {
  if (session && session.synthesizing) return;
  if (session) stopPlayback(session);
  clearClip();
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
  const mine = session = {
    socket, audio, seed, wanted, ssml: isSsml(wanted.input), words: [], chunks: [], total: 0, rate: 24000,
    synthesizing: true, playing: false, sent: null, firstByte: null, onset: null, audible: null, tracker: null,
    schedule: [], nextTime: 0, lastSource: null, frame: null, lit: -1, heard: null,
  };
  playground.highlighted = [];
  playground.last = null;
  playground.playback = "idle";
  playground.audio = audio;
  $("first-audio").textContent = $("rtf").textContent = $("duration").textContent = "–";
  renderWords(mine);
  drawWave([], 0);
  update();
  socket.onopen = () => {
    mine.sent = performance.now();
    socket.send(JSON.stringify({
      type: "start", context_id: "play", input: wanted.input, model: wanted.model, voice: wanted.voice,
      speed: wanted.speed, response_format: "pcm", seed,
    }));
  };
  socket.onmessage = (event) => {
    if (!mine.synthesizing) return;
    if (typeof event.data !== "string") return received(mine, event.data);
    const message = JSON.parse(event.data);
    if (message.type === "started") mine.rate = message.sample_rate;
    else if (message.type === "words") {
      mine.words.push(...message.words);
      renderWords(mine);
    } else if (message.type === "done") synthesisEnded(mine, "done", message.usage);
    else if (message.type === "error") {
      showError(message.message);
      synthesisEnded(mine, "failed");
    } else if (message.type === "interrupted") synthesisEnded(mine, "stopped");
  };
  socket.onclose = (event) => {
    if (!mine.synthesizing) return;
    showError(event.reason || `the connection closed (code ${event.code})`);
    synthesisEnded(mine, "failed");
  };
}

// performance.now()'s time when the audio context plays its time ``t``: from the output's own
// timestamp (which counts the output's latency) once it runs, else from its clock now.
function contextToPage(audio, t) {
  const stamp = audio.getOutputTimestamp ? audio.getOutputTimestamp() : null;
  if (stamp && stamp.performanceTime > 0) return stamp.performanceTime + (t - stamp.contextTime) * 1000;
  return performance.now() + (t - audio.currentTime) * 1000;
}

// When sample ``index`` of ``mine`` plays, in ms after the request was sent.
function playsAt(mine, index) {
  const chunk = mine.schedule.find((c) => c.first <= index && index < c.first + c.length);
  return chunk ? chunk.plays + (index - chunk.first) / mine.rate * 1000 : null;
}

function received(mine, data) {
  const pcm = new Int16Array(data);
  if (!pcm.length) return;
  const samples = new Float32Array(pcm.length);
  for (let i = 0; i < pcm.length; i++) samples[i] = pcm[i] / 32768;
  const audio = mine.audio;
  if (mine.firstByte === null) {
    mine.firstByte = performance.now() - mine.sent;
    mine.tracker = new OnsetTracker(mine.rate);
    mine.nextTime = audio.currentTime + 0.05;
    mine.playing = true;
    playground.playback = "playing";
    mine.frame = requestAnimationFrame(() => follow(mine));
  }
  const buffer = audio.createBuffer(1, samples.length, mine.rate);
  buffer.copyToChannel(samples, 0);
  const source = audio.createBufferSource();
  source.buffer = buffer;
  source.connect(audio.destination);
  // Chunks play back to back; one that comes late starts as soon as it can.
  const at = Math.max(mine.nextTime, audio.currentTime + 0.01);
  source.start(at);
  source.onended = () => {
    if (source === mine.lastSource && !mine.synthesizing) playbackEnded(mine);
  };
  mine.lastSource = source;
  mine.nextTime = at + buffer.duration;
  mine.schedule.push({ first: mine.total, length: samples.length, at, plays: contextToPage(audio, at) - mine.sent });
  mine.chunks.push(samples);
  mine.total += samples.length;
  const onset = mine.tracker.feed(samples);
  if (onset !== null) {
    mine.onset = onset;
    mine.audible = playsAt(mine, onset);
    $("first-audio").textContent = `${Math.round(mine.audible)} ms`;
  }
  drawWave(mine.chunks, mine.total);
  update();
}

// Where the listener is in ``mine``'s audio (seconds; null before it starts), from the chunk that
// plays now: a chunk that came late started late.
function heardAt(mine) {
  const now = mine.audio.currentTime;
  for (let i = mine.schedule.length - 1; i >= 0; i--) {
    const chunk = mine.schedule[i];
    if (chunk.at <= now) return (chunk.first + Math.min(chunk.length, (now - chunk.at) * mine.rate)) / mine.rate;
  }
  return null;
}

function follow(mine) {
  if (!mine.playing) return;
  paint(mine, heardAt(mine));
  mine.frame = requestAnimationFrame(() => follow(mine));
}

// The synthesis is over: ``done`` (the whole text), ``stopped`` (Stop, or the server interrupted
// it) or ``failed``. After a whole text the audio plays on (Stop stays on); otherwise playback stops
// and the player holds what came.
function synthesisEnded(mine, outcome, usage) {
  if (!mine.synthesizing) return;
  mine.synthesizing = false;
  try { mine.socket.close(); } catch (_) { /* already closed */ }
  const complete = outcome === "done";
  const seconds = mine.total / mine.rate;
  const elapsed = mine.sent === null ? 0 : (performance.now() - mine.sent) / 1000;
  $("duration").textContent = mine.total ? `${seconds.toFixed(2)} s` : "–";
  $("rtf").textContent = complete && seconds ? (elapsed / seconds).toFixed(3) : "–";
  playground.last = {
    ok: complete, outcome, complete, seconds, elapsed, rate: mine.rate, words: mine.words, seed: mine.seed,
    wanted: mine.wanted, samples: mine.total, onset: mine.onset, usage: usage || null,
    firstAudio: mine.audible === null ? null : mine.audible / 1000,
    firstByte: mine.firstByte === null ? null : mine.firstByte / 1000,
    schedule: mine.schedule.map(({ first, length, plays }) => ({ first, length, plays })),
  };
  if (complete) {
    setClip(mine, true);
    if (!mine.playing || mine.audio.currentTime >= mine.nextTime) playbackEnded(mine);
  } else {
    stopPlayback(mine);
    setClip(mine, false);
  }
  finishSession(mine);
}

// Silences what ``mine`` scheduled and frees the output (once: a second close would be refused).
function closeAudio(mine) {
  if (mine.audioClosed) return;
  mine.audioClosed = true;
  mine.audio.close().catch(() => { /* closed already */ });
}

// The audio played to its end: every word said.
function playbackEnded(mine) {
  if (!mine.playing) {
    closeAudio(mine);
    return;
  }
  mine.playing = false;
  cancelAnimationFrame(mine.frame);
  paint(mine, Infinity);
  closeAudio(mine);
  playground.playback = "ended";
  finishSession(mine);
}

// Playback stops where it is; the words go back to none lit (the player's clip lights them again).
function stopPlayback(mine) {
  const was = mine.playing;
  mine.playing = false;
  cancelAnimationFrame(mine.frame);
  closeAudio(mine);
  paint(mine, null);
  if (was) playground.playback = "stopped";
  finishSession(mine);
}

function finishSession(mine) {
  if (session === mine && !mine.synthesizing && !mine.playing) session = null;
  update();
}

function stop() {
  const mine = session;
  if (!mine) return;
  if (mine.synthesizing) {
    if (mine.socket.readyState === WebSocket.OPEN) {
      mine.socket.send(JSON.stringify({ type: "interrupt", context_id: "play" }));
    }
    synthesisEnded(mine, "stopped");
  } else stopPlayback(mine);
}

function save(blob, name) {
  const link = document.createElement("a");
  link.href = URL.createObjectURL(blob);
  link.download = name;
  link.click();
  setTimeout(() => URL.revokeObjectURL(link.href), 60000);
}

async function download() {
  if (!clip) return;
  if (!clip.complete) return save(wavBlob(clip.chunks, clip.rate), "speech.wav");
  // The same request and seed in the chosen format: seeded speech is the same speech.
  const format = $("format").value;
  try {
    const response = await api("/v1/audio/speech", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ ...clip.wanted, response_format: format, seed: clip.seed, stream: false }),
    });
    save(await response.blob(), `speech.${format}`);
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
const player = $("player");
player.addEventListener("play", () => {
  if (session && session.playing) stopPlayback(session); // one voice at a time
  if (!clip) return;
  if (player.currentTime < 0.05) {
    playground.highlighted = [];
    clip.lit = -1;
  }
  requestAnimationFrame(followPlayer);
});
player.addEventListener("seeked", () => { if (clip) paint(clip, player.currentTime); });
player.addEventListener("ended", () => { if (clip) paint(clip, Infinity); });
$("speed").addEventListener("input", () => { $("speed-value").textContent = Number($("speed").value).toFixed(2); });
$("token").value = localStorage.getItem("audio-pipeline-token") || "";
$("token").addEventListener("change", () => {
  localStorage.setItem("audio-pipeline-token", token());
  loadServer();
});
loadServer();
