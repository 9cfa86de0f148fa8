"""The playground page (GET / of the HTTP port) in a real headless Chromium against a real server
behind a bearer token: it loads with no console errors and nothing from elsewhere, speaks a
sentence while it streams (first audio, real-time factor, words lit in order, a waveform), its
player holds as much audio as the server's WAV of the same text, a bad request shows the server's
own words, and a reference upload registers a cloned voice where the model can clone. It fits a
390 px phone and a 1280 px screen; Speak sends the model and speed chosen (over the API's speed
range) and streams PCM whatever the download format; Ctrl/Cmd+Enter in the text speaks.
Stop stays on while the audio plays and stops it; after a stop the player holds the audio
received (Download saves it), the words are not left lit and no older clip plays; after an error
the player holds nothing. SSML shows the words spoken, not its markup. First audio is the
audible onset (audio/audibility.py's rule, ported to the page) as it played.
A screenshot goes to $PLAYGROUND_SCREENSHOT (default: the test's temporary folder)."""

from __future__ import annotations

import base64
import io
import json
import os
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf

from audio_pipeline.service.auth import AuthTokens
from audio_pipeline.testing.background import BackgroundServer
from browser import Browser, chromium_path
from helpers import TRANSCRIPT, make_config, recording, scratch_voices_dir

pytestmark = pytest.mark.slow
TOKEN = "playground-token-0123456789"
SENTENCE = "The quick brown fox jumps over the lazy dog."
#: About 10 s of speech, which the built-in voice speaks in well under that.
LONG = " ".join([SENTENCE] * 3)
SSML = '<speak>Hello<break time="300ms"/>there, <sub alias="World Wide Web">WWW</sub> &amp; friends.</speak>'
PLAYER = "document.getElementById('player')"




def started(config, **kwargs):
    return BackgroundServer(config, http_port=0, auth=AuthTokens(frozenset({TOKEN}), frozenset()), **kwargs).start()


@pytest.fixture(scope="module")
def browser():
    executable = chromium_path()
    if executable is None:
        pytest.fail("no Chromium: scripts/test.sh installs Debian's chromium package (apt-get install chromium)")
    opened = Browser(executable)
    yield opened
    opened.close()


@pytest.fixture(scope="module")
def server():

    from audio_pipeline.config import AudioGenerationConfig

    config = AudioGenerationConfig.load(env={}, audio_flags=[], model={"device": "cpu"},
                                        voices_dir=scratch_voices_dir())
    running = started(config)
    yield running
    running.stop()


def open_with_token(browser, url, token=TOKEN):
    browser.open(url)
    browser.evaluate(f"localStorage.setItem('audio-pipeline-token', {json.dumps(token)})")
    browser.console_errors.clear()
    browser.open(url)
    browser.wait_for("document.getElementById('status').textContent !== 'connecting…'")


def speak(browser, text):
    browser.evaluate(f"document.getElementById('text').value = {json.dumps(text)}; "
                     "document.getElementById('speak').click(); true")
    return browser.wait_for("window.playground.last", timeout=120)


def click(browser, element_id):
    browser.evaluate(f"document.getElementById({json.dumps(element_id)}).click(); true")


def player_duration(browser):
    return browser.wait_for(f"(() => {{ const p = {PLAYER}; "
                            "return isFinite(p.duration) && p.duration > 0 ? p.duration : null; })()")


def lit_words(browser):
    """The word spans lit as sounding now and as said."""
    return browser.evaluate("[document.querySelectorAll('#words span.now').length, "
                            "document.querySelectorAll('#words span.said').length]")


def download_state(browser):
    """Whether Download is off, and whether its format is."""
    return browser.evaluate("[document.getElementById('download').disabled, "
                            "document.getElementById('format').disabled]")


def page_audio(browser):
    """The WAV the page's player holds: its samples (floats) and rate."""
    encoded = browser.evaluate("window.playground.clipBlob().arrayBuffer().then(b => { "
                               "const bytes = new Uint8Array(b); let s = ''; "
                               "for (let i = 0; i < bytes.length; i += 32768) "
                               "s += String.fromCharCode(...bytes.subarray(i, i + 32768)); return btoa(s); })")
    samples, rate = sf.read(io.BytesIO(base64.b64decode(encoded)), dtype="float32")
    return samples, rate


def start_messages(browser):
    """The start messages the page sent on its WebSocket, as the wire carried them."""
    browser.pump(0.2)
    sent = [json.loads(e["params"]["response"]["payloadData"]) for e in browser.events
            if e.get("method") == "Network.webSocketFrameSent"]
    return [m for m in sent if m.get("type") == "start"]


def press_enter(browser, modifiers):
    """Enter in the focused element, as a keyboard types it (modifiers: 2 Ctrl, 4 Meta/Cmd)."""
    for kind in ("keyDown", "keyUp"):
        browser.call("Input.dispatchKeyEvent", type=kind, modifiers=modifiers, key="Enter", code="Enter",
                     windowsVirtualKeyCode=13, nativeVirtualKeyCode=13, **({"text": "\r"} if kind == "keyDown" else {}))


def test_the_page_speaks_streams_highlights_and_matches_the_servers_wav(server, browser, tmp_path):
    page = httpx.get(f"{server.http_url}/", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    # Everything the page loads comes from this server: no other origin is named in its files.
    for name in ("playground/playground.js", "playground/playground.css"):
        body = httpx.get(f"{server.http_url}/{name}", timeout=30).text
        assert "http://" not in body and "https://" not in body and "//cdn" not in body
    assert httpx.get(f"{server.http_url}/playground/../engine.py", timeout=30).status_code == 404

    open_with_token(browser, f"{server.http_url}/")
    assert browser.evaluate("document.getElementById('status').textContent") == "ready"
    voices = browser.evaluate("[...document.getElementById('voice').options].map(o => o.value)")
    assert voices == [v.name for v in server.engine.voice_catalogue.listed]
    assert browser.evaluate("document.getElementById('clone').hidden") is True  # the built-in voice cannot clone

    last = speak(browser, SENTENCE)
    assert last["ok"], browser.evaluate("document.getElementById('error').textContent")
    assert 0 < last["firstByte"] < last["elapsed"] and last["firstAudio"] > last["firstByte"]
    shown = browser.evaluate("[document.getElementById('first-audio').textContent, "
                             "document.getElementById('rtf').textContent]")
    assert shown[0].endswith(" ms") and float(shown[1]) > 0
    # The player holds the streamed audio: as long as the server's WAV of the same text.
    duration = browser.wait_for("(() => { const p = document.getElementById('player'); "
                                "return isFinite(p.duration) && p.duration > 0 ? p.duration : null; })()")
    reply = httpx.post(f"{server.http_url}/v1/audio/speech", headers={"Authorization": f"Bearer {TOKEN}"},
                       json={"input": SENTENCE, "response_format": "wav"}, timeout=120)
    samples, rate = sf.read(io.BytesIO(reply.content))
    assert abs(duration - len(samples) / rate) < 0.002
    assert abs(last["seconds"] - len(samples) / rate) < 0.002
    # Words light up in order while the audio plays, each a word of the sentence.
    browser.wait_for(f"window.playground.highlighted.length >= {len(SENTENCE.split()) - 1}", timeout=30)
    browser.pump(1.0)
    lit = browser.evaluate("window.playground.highlighted")
    words = [w.strip(".") for w in SENTENCE.split()]
    assert lit == words[:len(lit)] and len(lit) >= len(words) - 1
    assert browser.evaluate("document.querySelectorAll('#words span.word').length") == len(words)
    drawn = browser.evaluate("(() => { const c = document.getElementById('wave'); const d = c.getContext('2d')"
                             ".getImageData(0, 0, c.width, c.height).data; let n = 0; "
                             "for (let i = 3; i < d.length; i += 4) n += d[i] > 0; return n; })()")
    assert drawn > 1000  # the waveform is drawn
    # Download: the same request and seed in the chosen format, byte for byte the server's.
    browser.call("Page.setDownloadBehavior", behavior="allow", downloadPath=str(tmp_path))
    browser.evaluate("document.getElementById('format').value = 'flac'; document.getElementById('download').click(); true")
    downloaded = tmp_path / "speech.flac"
    for _ in range(300):
        if downloaded.is_file() and downloaded.stat().st_size:
            break
        browser.pump(0.1)
    again = httpx.post(f"{server.http_url}/v1/audio/speech", headers={"Authorization": f"Bearer {TOKEN}"},
                       json={"input": SENTENCE, "response_format": "flac", "seed": last["seed"], "speed": 1},
                       timeout=120)
    assert downloaded.read_bytes() == again.content
    shot = Path(os.environ.get("PLAYGROUND_SCREENSHOT", tmp_path / "playground.png"))
    assert browser.screenshot(shot).stat().st_size > 10000
    assert browser.console_errors == []


def test_a_bad_request_shows_the_servers_own_message(server, browser):
    open_with_token(browser, f"{server.http_url}/")
    bad = "<speak>Hello <blink>there</blink></speak>"
    reply = httpx.post(f"{server.http_url}/v1/audio/speech", headers={"Authorization": f"Bearer {TOKEN}"},
                       json={"input": bad}, timeout=60)
    expected = reply.json()["error"]["message"]
    last = speak(browser, bad)
    assert not last["ok"]
    assert browser.evaluate("document.getElementById('error').textContent") == expected
    # Without the token: the server's 401 in its own words, and no speech.
    open_with_token(browser, f"{server.http_url}/", token="")
    shown = browser.evaluate("document.getElementById('error').textContent")
    assert shown == "missing bearer token (Authorization: Bearer <token>)"
    last = speak(browser, SENTENCE)
    assert not last["ok"] and "bearer token" in browser.evaluate("document.getElementById('error').textContent")


def test_a_reference_upload_registers_a_cloned_voice(tiny_model_dir, browser, tmp_path):

    running = started(make_config(tiny_model_dir, "limits.max_message_bytes=200000",
                                  voices_dir=str(tmp_path / "voices")))
    try:
        open_with_token(browser, f"{running.http_url}/")
        assert browser.evaluate("document.getElementById('clone').hidden") is False
        reference = tmp_path / "me.wav"
        reference.write_bytes(recording())
        browser.set_files("#clone-file", [str(reference)])
        browser.evaluate("document.getElementById('clone-name').value = 'my-voice'; "
                         f"document.getElementById('clone-transcript').value = {json.dumps(TRANSCRIPT)}; "
                         "document.getElementById('clone-form').requestSubmit(); true")
        browser.wait_for("document.getElementById('voice').value === 'my-voice'", timeout=120)
        assert "my-voice" in [v.name for v in running.engine.voice_catalogue.registered()]
        # A bad upload: the server's refusal, as it words it.
        browser.evaluate("document.getElementById('clone-transcript').value = ''; "
                         "document.getElementById('clone-form').requestSubmit(); true")
        assert browser.evaluate("document.getElementById('error').hidden") is True  # the form's own check
        assert browser.console_errors == []
    finally:
        running.stop()


# --- the layout and the controls ------------------------------------------------------------------

def test_the_page_fits_a_phone_and_a_laptop(server, browser, tmp_path):
    open_with_token(browser, f"{server.http_url}/")
    assert speak(browser, SENTENCE)["ok"]
    player_duration(browser)
    browser.evaluate("document.getElementById('clone').hidden = false; true")  # its form is laid out too
    measure = (
        "(() => { const seen = []; for (const e of document.querySelectorAll("
        "'input, select, textarea, button, audio, output, canvas, #words, #status')) {"
        " e.scrollIntoView({ block: 'center', inline: 'center' }); const r = e.getBoundingClientRect();"
        " const hit = document.elementFromPoint(r.left + r.width / 2, r.top + r.height / 2);"
        " seen.push({ id: e.id || e.type, left: r.left, right: r.right, width: r.width, height: r.height,"
        " reachable: hit === e || e.contains(hit) || (hit !== null && hit.contains(e)) }); }"
        " window.scrollTo(0, 0);"
        " return { width: document.documentElement.scrollWidth, body: document.body.scrollWidth,"
        " viewport: window.innerWidth, scrollX: window.scrollX, seen }; })()")
    try:
        for width in (390, 1280):
            browser.call("Emulation.setDeviceMetricsOverride", width=width, height=844, deviceScaleFactor=1,
                         mobile=width < 600)
            browser.pump(0.3)
            page = browser.evaluate(measure)
            assert page["viewport"] == width
            assert page["width"] <= width and page["body"] <= width, page
            for control in page["seen"]:
                assert control["width"] > 0 and control["height"] > 0, (width, control)
                assert control["left"] >= 0 and control["right"] <= width + 0.5, (width, control)
                assert control["reachable"], (width, control)
            if width == 390:
                assert browser.screenshot(tmp_path / "phone.png").stat().st_size > 10000
    finally:
        browser.call("Emulation.clearDeviceMetricsOverride")
    assert browser.console_errors == []


def test_speak_sends_the_chosen_model_and_speed_and_ctrl_enter_speaks(server, browser):
    from audio_pipeline.service.prepare import MAX_SPEED, MIN_SPEED

    open_with_token(browser, f"{server.http_url}/")
    browser.call("Network.enable")
    try:
        # The speed slider spans the API's range.
        assert browser.evaluate("[Number(document.getElementById('speed').min), "
                                "Number(document.getElementById('speed').max)]") == [MIN_SPEED, MAX_SPEED]
        # The format is Download's: it sits with Download, says so, and Speak streams PCM whatever it is.
        placed = browser.evaluate(
            "(() => { const f = document.getElementById('format'); return [f.closest('.playback') !== null, "
            "f.closest('.controls') === null, f.closest('label').textContent.trim().startsWith('Download as'), "
            "document.getElementById(f.getAttribute('aria-describedby')).textContent]; })()")
        assert placed[:3] == [True, True, True] and "Speak always streams 16-bit PCM" in placed[3]
        # The shortcut is shown: in the hint under the text and on the Speak button.
        hint = browser.evaluate("document.getElementById('text-hint').textContent")
        assert "Ctrl+Enter" in hint and "⌘+Enter" in hint
        assert "Ctrl+Enter" in browser.evaluate("document.getElementById('speak').title")

        browser.evaluate(
            "const model = document.getElementById('model'); model.add(new Option('another-model', 'another-model')); "
            "model.value = 'another-model'; const speed = document.getElementById('speed'); speed.value = speed.max; "
            "speed.dispatchEvent(new Event('input')); document.getElementById('format').value = 'mp3'; "
            "document.getElementById('text').value = 'Hello there.'; document.getElementById('text').focus(); true")
        assert browser.evaluate("document.getElementById('speed-value').textContent") == "4.00"
        press_enter(browser, modifiers=2)  # Ctrl+Enter
        last = browser.wait_for("window.playground.last")
        assert last["ok"], browser.evaluate("document.getElementById('error').textContent")
        assert browser.evaluate("document.getElementById('text').value") == "Hello there."  # no new line typed
        start = start_messages(browser)[-1]
        assert (start["model"], start["speed"], start["response_format"], start["input"]) == \
            ("another-model", MAX_SPEED, "pcm", "Hello there.")
        # Cmd+Enter speaks too (at the slowest speed this time); a plain Enter is a new line.
        browser.evaluate("document.getElementById('speed').value = document.getElementById('speed').min; "
                         "window.playground.last = null; true")
        press_enter(browser, modifiers=4)
        assert browser.wait_for("window.playground.last")["ok"]
        starts = start_messages(browser)
        assert len(starts) == 2 and starts[-1]["speed"] == MIN_SPEED
        press_enter(browser, modifiers=0)
        assert browser.evaluate("document.getElementById('text').value") == "Hello there.\n"
        assert len(start_messages(browser)) == 2
    finally:
        browser.call("Network.disable")
    assert browser.console_errors == []


# --- playback, stop, errors and the words ---------------------------------------------------------

def test_stop_stays_on_while_the_audio_plays_and_stops_it(server, browser):
    open_with_token(browser, f"{server.http_url}/")
    last = speak(browser, LONG)
    assert last["ok"] and last["seconds"] > 5 and last["elapsed"] < last["seconds"] / 2
    # The synthesis is over, the audio is not: Stop stays on (and Speak is on again).
    state = browser.evaluate("[document.getElementById('stop').disabled, document.getElementById('speak').disabled, "
                             "window.playground.playback, window.playground.audio.state, "
                             "document.getElementById('status').textContent]")
    assert state == [False, False, "playing", "running", "playing…"]
    browser.wait_for("window.playground.highlighted.length >= 2", timeout=30)
    click(browser, "stop")
    state = browser.evaluate("[document.getElementById('stop').disabled, window.playground.playback, "
                             "document.getElementById('status').textContent]")
    assert state == [True, "stopped", "ready"]
    # The audio is silenced (its context closed), the words go back to none lit and stay so.
    browser.wait_for("window.playground.audio.state === 'closed'", timeout=10)
    heard = len(browser.evaluate("window.playground.highlighted"))
    browser.pump(0.5)
    assert len(browser.evaluate("window.playground.highlighted")) == heard
    assert lit_words(browser) == [0, 0]
    # The whole text came, so the player holds all of it, and Download offers it in any format.
    assert abs(player_duration(browser) - last["seconds"]) < 0.002
    assert download_state(browser) == [False, False]

    # Played to its end, Stop goes off by itself and every word is said.
    last = speak(browser, "Hello there.")
    assert last["ok"]
    browser.wait_for("window.playground.playback === 'ended'", timeout=30)
    assert browser.evaluate("document.getElementById('stop').disabled") is True
    words = browser.evaluate("document.querySelectorAll('#words span.word').length")
    assert words == 2 and lit_words(browser) == [0, words]
    assert browser.console_errors == []


def test_stop_while_speaking_keeps_the_audio_received_and_no_older_clip(server, browser, tmp_path):
    open_with_token(browser, f"{server.http_url}/")
    assert speak(browser, SENTENCE)["ok"]
    first = player_duration(browser)
    first_src = browser.evaluate(f"{PLAYER}.src")
    assert browser.evaluate(f"{PLAYER}.play().then(() => !{PLAYER}.paused)") is True
    # A long text at a quarter speed takes seconds to speak: Stop once its first words have come.
    text = " ".join(f"Sentence number {n} keeps the speaker busy for a while." for n in range(12))
    during = browser.evaluate(
        f"document.getElementById('text').value = {json.dumps(text)}; "
        "document.getElementById('speed').value = '0.25'; document.getElementById('speak').click(); "
        "new Promise((resolve) => { const poll = setInterval(() => { const got = window.playground.received(); "
        "if (!got || got.words < 2) return; clearInterval(poll); "
        f"const player = [{PLAYER}.paused, {PLAYER}.hasAttribute('src'), {PLAYER}.readyState, {PLAYER}.networkState]; "
        "document.getElementById('stop').click(); resolve(player); }, 2); })")
    # The new utterance paused and unloaded the old clip the moment it started.
    assert during == [True, False, 0, 0]
    last = browser.wait_for("window.playground.last")
    assert last["outcome"] == "stopped" and not last["ok"] and last["samples"] > 0
    assert browser.evaluate("[document.getElementById('stop').disabled, document.getElementById('speak').disabled, "
                            "window.playground.playback, window.playground.audio.state]") == \
        [True, False, "stopped", "closed"]
    # What came stays: the player holds it (not the older clip), Download saves it as WAV.
    duration = player_duration(browser)
    assert abs(duration - last["samples"] / last["rate"]) < 0.002 and abs(duration - first) > 0.01
    assert browser.evaluate(f"{PLAYER}.src") not in ("", first_src)
    assert download_state(browser) == [False, True]
    assert "Stopped" in browser.evaluate("document.getElementById('download-note').textContent")
    samples, rate = page_audio(browser)
    assert len(samples) == last["samples"] and rate == last["rate"]
    browser.call("Page.setDownloadBehavior", behavior="allow", downloadPath=str(tmp_path))
    click(browser, "download")
    downloaded = tmp_path / "speech.wav"
    for _ in range(100):
        if downloaded.is_file() and downloaded.stat().st_size:
            break
        browser.pump(0.1)
    saved, saved_rate = sf.read(downloaded, dtype="float32")
    assert saved_rate == rate and (saved == samples).all()
    # The words are not left lit mid-word: none lit, until the player plays them from the start.
    assert lit_words(browser) == [0, 0]
    assert browser.evaluate(f"{PLAYER}.play().then(() => true)") is True
    browser.wait_for("window.playground.highlighted.length >= 1", timeout=30)
    assert browser.evaluate("window.playground.highlighted")[0] == "Sentence"
    browser.evaluate(f"{PLAYER}.pause(); document.getElementById('speed').value = '1'; true")
    assert browser.console_errors == []


def test_an_error_leaves_no_earlier_clip_in_the_player(server, browser):
    open_with_token(browser, f"{server.http_url}/")
    assert speak(browser, SENTENCE)["ok"]
    player_duration(browser)
    last = speak(browser, "<speak>Hello <blink>there</blink></speak>")
    assert not last["ok"] and last["outcome"] == "failed"
    assert browser.evaluate("document.getElementById('error').hidden") is False
    state = browser.evaluate(f"[{PLAYER}.hasAttribute('src'), {PLAYER}.readyState, {PLAYER}.networkState, "
                             f"{PLAYER}.paused, "
                             "document.getElementById('download').disabled, "
                             "document.getElementById('duration').textContent, "
                             "document.getElementById('stop').disabled]")
    assert state == [False, 0, 0, True, True, "–", True]
    # Nothing to play: the old clip is gone, not just hidden (play() finds no media and waits for some).
    played = browser.evaluate(f"Promise.race([{PLAYER}.play().then(() => 'played', (e) => e.name), "
                              "new Promise((resolve) => setTimeout(() => resolve('nothing'), 500))])")
    assert played == "nothing"
    assert browser.evaluate(f"[{PLAYER}.readyState, {PLAYER}.currentTime]") == [0, 0]
    browser.evaluate(f"{PLAYER}.pause(); true")
    assert browser.console_errors == []


def test_ssml_shows_the_words_spoken_not_its_markup(server, browser):
    open_with_token(browser, f"{server.http_url}/")
    # Before its words come, the document reads without its tags and entities.
    before = browser.evaluate(f"document.getElementById('text').value = {json.dumps(SSML)}; "
                              "document.getElementById('speak').click(); document.getElementById('words').textContent")
    assert before == "Hello there, WWW & friends."
    last = browser.wait_for("window.playground.last")
    assert last["ok"], browser.evaluate("document.getElementById('error').textContent")
    spoken = [w["spoken"] for w in last["words"]]
    assert spoken == ["Hello", "there", "World Wide Web", "and", "friends"]
    assert browser.evaluate("[...document.querySelectorAll('#words span.word')].map(s => s.textContent)") == spoken
    shown = browser.evaluate("document.getElementById('words').textContent")
    assert shown == "Hello there, World Wide Web and friends."
    # The words light up as spoken, in order.
    browser.wait_for("window.playground.playback === 'ended'", timeout=30)
    lit = browser.evaluate("window.playground.highlighted")
    assert lit == spoken[:len(lit)] and len(lit) >= len(spoken) - 1
    assert browser.console_errors == []


# --- first audio: the audible onset --------------------------------------------------------------

def onset_cases():
    """Signals (mono float32) and rates that exercise the onset rule's corners."""
    rng = np.random.default_rng(7)

    def noise(seconds, rate, dbfs):
        return (rng.standard_normal(round(seconds * rate)) * 10 ** (dbfs / 20)).astype(np.float32)

    def tone(seconds, rate, amplitude, hz=220.0):
        t = np.arange(round(seconds * rate)) / rate
        return (amplitude * np.sin(2 * np.pi * hz * t)).astype(np.float32)

    cases = []
    for rate in (24000, 22050, 16000, 44100):
        # Quiet, then speech-level noise.
        cases.append((np.concatenate([noise(0.3, rate, -60), noise(0.5, rate, -30)]), rate))
        # A large DC offset that is not sound, then a tone: only the mean-removed level counts.
        cases.append((np.concatenate([np.full(round(0.25 * rate), 0.4, np.float32),
                                      0.4 + tone(0.3, rate, 0.02)]).astype(np.float32), rate))
    # A tone that swells slowly through -45 dBFS: the onset falls where two frames in a row reach it.
    t = np.arange(24000) / 24000
    cases.append(((np.linspace(0, 0.02, t.size) * np.sin(2 * np.pi * 180 * t)).astype(np.float32), 24000))
    # A click in the first hop is in one frame alone (not an onset); one later is in two (an onset).
    for at in (0, 4800):
        click = np.zeros(24000, np.float32)
        click[at:at + 10] = 0.5
        click[12000:] = noise(0.5, 24000, -35)
        cases.append((click, 24000))
    # Nothing audible, and too short for a frame.
    cases.append((noise(0.5, 24000, -55), 24000))
    cases.append((noise(0.015, 24000, -20), 24000))
    return cases


def page_onsets(browser, samples, rate, pieces):
    """The page's onset of ``samples``: whole, and fed to its tracker in ``pieces``."""
    encoded = base64.b64encode(samples.astype("<f4").tobytes()).decode()
    return browser.evaluate(
        f"(() => {{ const raw = atob('{encoded}'); const bytes = new Uint8Array(raw.length); "
        "for (let i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i); "
        "const x = new Float32Array(bytes.buffer); const A = window.playground.audibility; "
        f"const tracker = new A.OnsetTracker({rate}); let at = 0, found = null; "
        f"for (const n of {json.dumps(pieces)}) {{ const got = tracker.feed(x.subarray(at, at + n)); "
        "if (got !== null) found = got; at += n; } "
        f"return [A.onset(x, {rate}), found]; }})()")


def test_the_pages_audible_onset_is_the_servers_rule(server, browser):
    from audio_pipeline.audio.audibility import AUDIBLE_DBFS, FRAME_S, FRAMES_NEEDED, HOP_S, audible_onset

    open_with_token(browser, f"{server.http_url}/")
    constants = browser.evaluate("(() => { const A = window.playground.audibility; "
                                 "return [A.FRAME_S, A.HOP_S, A.AUDIBLE_DBFS, A.FRAMES_NEEDED]; })()")
    assert constants == [FRAME_S, HOP_S, AUDIBLE_DBFS, FRAMES_NEEDED]
    rng = np.random.default_rng(11)
    found = 0
    for samples, rate in onset_cases():
        expected = audible_onset(samples, rate)
        found += expected is not None
        # The stream comes in pieces of any size: some under a hop, some single samples.
        pieces, left = [], samples.size
        while left:
            pieces.append(min(left, int(rng.choice([1, 7, 100, 239, 480, 1000, 4800]))))
            left -= pieces[-1]
        assert page_onsets(browser, samples, rate, pieces) == [expected, expected], rate
    assert found == 11  # all but the last two, each where the rule alone puts it


def test_first_audio_shown_is_the_audible_onset_as_played(server, browser):
    from audio_pipeline.audio.audibility import HOP_S, audible_onset

    open_with_token(browser, f"{server.http_url}/")
    last = speak(browser, SENTENCE)
    assert last["ok"]
    samples, rate = page_audio(browser)
    onset = audible_onset(samples, rate)
    assert onset is not None and last["onset"] == onset
    # When the onset sample played, in ms after the request was sent, from the page's schedule of
    # the chunks it received: the figure shown is that, within one hop.
    chunk = next(c for c in last["schedule"] if c["first"] <= onset < c["first"] + c["length"])
    expected = chunk["plays"] + (onset - chunk["first"]) / rate * 1000
    shown = browser.evaluate("document.getElementById('first-audio').textContent")
    assert shown.endswith(" ms")
    assert abs(float(shown[:-3]) - expected) <= HOP_S * 1000
    assert abs(last["firstAudio"] * 1000 - expected) < 1e-6
    # It is after the first byte (a chunk plays a little after it comes) and no later than the audio.
    assert last["firstByte"] * 1000 < expected
    assert browser.console_errors == []
