"""The playground page (GET / of the HTTP port) in a real headless Chromium against a real server
behind a bearer token: it loads with no console errors and nothing from elsewhere, speaks a
sentence while it streams (first audio, real-time factor, words lit in order, a waveform), its
player holds as much audio as the server's WAV of the same text, a bad request shows the server's
own words, and a reference upload registers a cloned voice where the model can clone. A
screenshot goes to $PLAYGROUND_SCREENSHOT (default: the test's temporary folder)."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import httpx
import pytest
import soundfile as sf

from audio_pipeline.service.auth import AuthTokens
from audio_pipeline.testing.background import BackgroundServer
from browser import Browser, chromium_path
from conftest import make_config, scratch_voices_dir

pytestmark = pytest.mark.slow
TOKEN = "playground-token-0123456789"
SENTENCE = "The quick brown fox jumps over the lazy dog."


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
    assert voices == [v.name for v in server.engine.voices]
    assert browser.evaluate("document.getElementById('clone').hidden") is True  # the built-in voice cannot clone

    last = speak(browser, SENTENCE)
    assert last["ok"], browser.evaluate("document.getElementById('error').textContent")
    assert 0 < last["firstAudio"] < last["elapsed"]
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
    from speech_requests import TRANSCRIPT, recording

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
        assert "my-voice" in [v.name for v in running.engine.registered_voices()]
        # A bad upload: the server's refusal, as it words it.
        browser.evaluate("document.getElementById('clone-transcript').value = ''; "
                         "document.getElementById('clone-form').requestSubmit(); true")
        assert browser.evaluate("document.getElementById('error').hidden") is True  # the form's own check
        assert browser.console_errors == []
    finally:
        running.stop()
