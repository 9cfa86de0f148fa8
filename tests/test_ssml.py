"""SSML and pronunciations: the document read into segments (spoken words mapped back into the
document, breaks, rates, say-as, sub, phoneme), refused with the element and its place when
malformed or unsupported, and spoken through real servers (HTTP, gRPC, the WebSocket) on the
default voice, with breaks and rates measured in the audio."""

from __future__ import annotations

import io
import json

import grpc
import httpx
import numpy as np
import pytest
import soundfile as sf

from audio_pipeline.errors import InvalidArgument
from audio_pipeline.text import ssml
from audio_pipeline.text.ipa import ipa_units
from audio_pipeline.text.pronunciations import from_entries, from_pls, load_voice_lexicons, respell
from audio_pipeline.text.normalize import normalize
from helpers import scratch_voices_dir

DOCUMENT = """<speak version="1.0" xmlns="http://www.w3.org/2001/10/synthesis" xml:lang="en-US">
  Hello <sub alias="World Wide Web">WWW</sub> users. It costs $5.50 &amp; more.<break time="500ms"/>
  <p><s>Call <say-as interpret-as="telephone">555-0143</say-as> on
     <say-as interpret-as="date" format="mdy">12/25/2024</say-as>.</s>
  <s>Spell <say-as interpret-as="characters">SSML</say-as>, say <phoneme alphabet="ipa" ph="təˈmɑːtoʊ">tomato</phoneme>
     <prosody rate="slow">slowly</prosody> <emphasis level="strong">now</emphasis>.</s></p>
</speak>"""


def spoken_and_sources(document):
    """[(spoken text, [(spoken word, where it was written)], pause, rate)] of each segment."""
    out = []
    for segment in ssml.parse(document):
        n = segment.normalized
        words = [(n.spoken[s.start:s.end], document[segment.start + s.source_start:segment.start + s.source_end])
                 for s in n.spans]
        out.append((n.spoken, words, segment.pause, segment.rate))
    return out


def test_the_document_reads_into_segments_whose_words_point_where_they_were_written():
    segments = spoken_and_sources(DOCUMENT)
    assert [s[0] for s in segments] == [
        "Hello World Wide Web users.", "It costs five dollars and fifty cents and more.",
        "Call five five five, zero one four three on December twenty-fifth, twenty twenty-four.",
        "Spell ess ess em el, say tomato", "slowly", "now."]
    words = dict(segments[0][1])
    assert words["World"] == words["Web"] == "WWW" and words["Hello"] == "Hello"
    assert dict(segments[1][1])["dollars"] == "$5.50" and ("and", "&amp;") in segments[1][1]
    assert dict(segments[2][1])["December"] == "12/25/2024"
    assert [s[2] for s in segments] == [0.35, 0.5, 0.35, 0.0, 0.0, ssml.PARAGRAPH_PAUSE]
    assert [s[3] for s in segments] == [1.0, 1.0, 1.0, 1.0, 0.75, 1.0]
    phoneme = ssml.parse(DOCUMENT)[3]
    (start, end, ipa), = phoneme.phonemes
    assert phoneme.normalized.spoken[start:end] == "tomato" and ipa == "təˈmɑːtoʊ"


def test_markup_is_never_spoken():
    for segment in ssml.parse(DOCUMENT):
        spoken = segment.normalized.spoken.lower()
        assert not any(mark in spoken for mark in ("<", ">", "speak", "break", "prosody", "say-as", "sub ", "alias",
                                                   "phoneme", "emphasis", "xmlns", "amp"))


@pytest.mark.parametrize("kind, text, spoken", [
    ("characters", "AB1", "ay bee one"), ("spell-out", "xyz", "ex why zee"), ("cardinal", "1,234", "one thousand two hundred thirty-four"),
    ("ordinal", "3", "third"), ("ordinal", "21st", "twenty-first"), ("digits", "2024", "two zero two four"),
    ("time", "9:15", "nine fifteen"), ("time", "7pm", "seven p m"), ("telephone", "(415) 555-2671", "four one five, five five five, two six seven one"),
])
def test_say_as_readings(kind, text, spoken):
    segment, = ssml.parse(f'<speak><say-as interpret-as="{kind}">{text}</say-as></speak>')
    assert segment.normalized.spoken == spoken


@pytest.mark.parametrize("document, fragment", [
    ("<speak>Hi <audio src='x.wav'/></speak>", "<audio> is not supported (supported: <speak>, <p>, <s>, <break>, "
                                               "<prosody>, <say-as>, <sub>, <phoneme>, <emphasis>, <voice>) (at line 1, column 11)"),
    ("<speak>Hi\n  <prosody pitch='high'>x</prosody></speak>", "<prosody> attribute 'pitch' is not supported (supported: rate) (at line 2, column 3)"),
    ("<speak>Hi <break time='5 minutes'/></speak>", "<break> time='5 minutes' is not a duration like 500ms or 1.5s"),
    ("<speak>Hi <break time='11s'/></speak>", "over the longest break, 10 s"),
    ("<speak>Hi" + "<break time='10s'/>" * 13 + "</speak>", "the document's breaks add up to over 120 s of silence"),
    ("<speak><prosody rate='10'>x</prosody></speak>", "makes the rate 10, out of range: 0.25 to 4"),
    ("<speak><say-as interpret-as='date'>13/45/2020</say-as></speak>", "'13/45/2020' is not a date in format mdy (at line 1, column 8)"),
    ("<speak><say-as interpret-as='fraction'>1/2</say-as></speak>", "interpret-as='fraction' is not supported"),
    ("<speak><sub alias='x'><break/></sub></speak>", "<sub> takes text only, not <break>"),
    ("<speak><phoneme alphabet='x-sampa' ph='t@'>a</phoneme></speak>", "alphabet='x-sampa' is not supported (supported: ipa)"),
    ("<speak>Hi <s>there</speak>", "not well-formed XML: mismatched tag (at line 1, column 21)"),
    ("<speak>&custom;</speak>", "not well-formed XML: undefined entity"),
    ('<!DOCTYPE speak [<!ENTITY a "aaaaaaaaaa">]><speak>&a;&a;</speak>', "a document type declaration is not allowed"),
    ("<voice name='x'>Hi</voice>", "the document must be a <speak> element, not <voice>"),
    ("<speak>Hi <voice name=' '>there</voice></speak>", "<voice> needs a name (at line 1, column 11)"),
    ("<speak>Hi <voice gender='female'>there</voice></speak>", "<voice> attribute 'gender' is not supported (supported: name)"),
    ("<speak><sub alias='x'><voice name='a'>y</voice></sub></speak>", "<sub> takes text only, not <voice>"),
    ("<speak> <break time='1s'/> </speak>", "the document has nothing to speak"),
])
def test_bad_documents_are_refused_naming_the_element_and_its_place(document, fragment):
    with pytest.raises(InvalidArgument) as raised:
        ssml.parse(document)
    assert raised.value.field == "text" and fragment in str(raised.value), str(raised.value)


def test_a_voice_element_gives_its_segments_their_voice():
    """A <voice>'s content is its own segments (never one with the words around it), in the voice
    it names; nested, the innermost names it; rates and breaks inside it work as anywhere."""
    document = ("<speak>Hello there, <voice name='leah'>how are <prosody rate='slow'>you</prosody> today?"
                "<break time='1s'/><voice name='dan'>Fine.</voice> Good.</voice> Bye.</speak>")
    found = [(s.normalized.spoken, s.voice, s.rate, s.pause) for s in ssml.parse(document)]
    assert found == [("Hello there,", None, 1.0, 0.12), ("how are", "leah", 1.0, 0.0), ("you", "leah", 0.75, 0.0),
                     ("today?", "leah", 1.0, 1.0), ("Fine.", "dan", 1.0, 0.35), ("Good.", "leah", 1.0, 0.35),
                     ("Bye.", None, 1.0, 0.35)]
    assert [s.voice for s in ssml.parse(DOCUMENT)] == [None] * 6


def test_breaks_in_a_row_add_up_and_a_break_replaces_a_sentence_pause():
    assert [s.pause for s in ssml.parse("<speak>One. <break time='1s'/><break time='250ms'/>Two.</speak>")][0] == 1.25
    assert [s.pause for s in ssml.parse("<speak><s>One</s><break strength='x-strong'/><s>Two</s></speak>")][0] == 1.0


def test_ipa_reads_into_the_voices_units():
    assert ipa_units("təˈmɑːtoʊ") == ("t", "ax0", "m", "aa1", "t", "ow0")
    assert ipa_units("/ˈtʃɜːrtʃ/") == ("ch", "er1", "ch")
    with pytest.raises(InvalidArgument, match="IPA symbol '\\*'"):
        ipa_units("tə*")


def test_lexicons_come_as_request_entries_pls_or_per_voice_json(tmp_path):
    pls = """<?xml version="1.0" encoding="UTF-8"?>
<lexicon version="1.0" xmlns="http://www.w3.org/2005/01/pronunciation-lexicon" alphabet="ipa" xml:lang="en-US">
  <lexeme><grapheme>tomato</grapheme><phoneme>təˈmɑːtoʊ</phoneme></lexeme>
  <lexeme><grapheme>W3C</grapheme><alias>World Wide Web Consortium</alias></lexeme>
</lexicon>"""
    lexicon = from_pls(pls)
    assert lexicon.respellings() == {"w3c": "World Wide Web Consortium"}
    assert lexicon.phoneme_units() == (("tomato", ipa_units("təˈmɑːtoʊ")),)
    path = tmp_path / "voices.json"
    path.write_text(json.dumps({"*": [{"word": "gif", "respelling": "jif"}], "slt-en": [{"word": "gif", "phonemes": "ɡɪf"}]}))
    by_voice = load_voice_lexicons(path)
    assert by_voice["*"].merged(by_voice["slt-en"]).phoneme_units() == (("gif", ipa_units("ɡɪf")),)
    for bad, fragment in [([{"word": "a b", "respelling": "x"}], "pronunciations[0]"),
                          ([{"word": "x"}], "needs one of phonemes (IPA) or respelling"),
                          ([{"word": "x", "phonemes": "ta!"}], "IPA symbol '!'"), ("nope", "must be a list")]:
        with pytest.raises(InvalidArgument, match=fragment.replace("(", "\\(").replace(")", "\\)").replace("[", "\\[")):
            from_entries(bad)


def test_a_respelling_keeps_timings_on_the_word_as_written():
    text = normalize("I paid $5 for WWW access.")
    respelled, _ = respell(text, {"www": "world wide web"})
    assert respelled.spoken == "I paid five dollars for world wide web access."
    start = respelled.spoken.index("wide")
    assert text.original[slice(*respelled.source_of(start, start + 4))] == "WWW"
    start = respelled.spoken.index("access")
    assert text.original[slice(*respelled.source_of(start, start + 6))] == "access"
    start = respelled.spoken.index("dollars")
    assert text.original[slice(*respelled.source_of(start, start + 7))] == "$5"


# --- through real servers on the default voice ---------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):

    from audio_pipeline.config import AudioGenerationConfig
    from audio_pipeline.testing.background import BackgroundServer

    lexicon = tmp_path_factory.mktemp("lexicon") / "lexicon.json"
    lexicon.write_text(json.dumps({"*": [{"word": "zorb", "phonemes": "zɔɹb"}]}))
    config = AudioGenerationConfig.load(env={}, audio_flags=[], model={"device": "cpu"}, pronunciations=str(lexicon),
                                        voices_dir=scratch_voices_dir())
    running = BackgroundServer(config, http_port=0).start()
    yield running
    running.stop()


def wav(server, text, **fields):
    reply = httpx.post(f"{server.http_url}/v1/audio/speech", json={"input": text, "response_format": "wav", **fields},
                       timeout=120)
    assert reply.status_code == 200, reply.text
    samples, rate = sf.read(io.BytesIO(reply.content))
    return samples, rate


def seconds(server, text, **fields):
    samples, rate = wav(server, text, **fields)
    return len(samples) / rate


def inaudible_gaps(samples: np.ndarray, rate: int) -> list[float]:
    """Seconds between the audible stretches of ``samples``, longest first: runs of 20 ms frames
    (10 ms hop, mean removed) under -45 dBFS, the audibility rule of the streaming metrics."""
    from audio_pipeline.audio.audibility import AUDIBLE_DBFS

    hop, frame = rate // 100, rate // 50
    frames = np.lib.stride_tricks.sliding_window_view(samples, frame)[::hop].astype(np.float64)
    frames = frames - frames.mean(axis=1, keepdims=True)
    loud = np.flatnonzero(np.sqrt((frames * frames).mean(axis=1)) >= 10 ** (AUDIBLE_DBFS / 20))
    return sorted(((b - a) * hop - frame) / rate for a, b in zip(loud, loud[1:]) if b - a > 2)[::-1]


@pytest.mark.slow
def test_a_break_adds_its_time_to_the_audio(server):
    shorter = seconds(server, "<speak>The train leaves soon. <break time='1000ms'/> Please hurry.</speak>")
    longer = seconds(server, "<speak>The train leaves soon. <break time='1500ms'/> Please hurry.</speak>")
    assert abs(longer - shorter - 0.5) <= 0.02
    silence, rate = wav(server, "<speak>The train leaves soon. <break time='1500ms'/> Please hurry.</speak>")
    assert 1.45 <= inaudible_gaps(silence, rate)[0] <= 1.65  # the break is silence, not speech


@pytest.mark.slow
@pytest.mark.parametrize("document", [
    "<speak>Turn left here <break time='1000ms'/> and then go straight.</speak>",  # inside a sentence
    "<speak>I like tea. <break time='1000ms'/> You like coffee.</speak>",  # at a sentence's end
    "<speak><s>Please call Stella.</s><break time='1000ms'/><s>Thank you very much.</s></speak>"])
def test_a_break_is_the_silence_between_the_words_not_more(server, document):
    """The silence a listener hears across <break time="1000ms"/> is the break: the pause frames the
    voice speaks at each side of it are part of the second, not added to it."""
    samples, rate = wav(server, document, seed=3)
    gaps = inaudible_gaps(samples, rate)
    assert 0.95 <= gaps[0] <= 1.10
    assert gaps[1] < 0.3  # the rest are pauses inside the sentences


@pytest.mark.slow
def test_a_prosody_rate_changes_the_speaking_time(server):
    text = "The quick brown fox jumps over the lazy dog."
    normal = seconds(server, f"<speak>{text}</speak>")
    slow = seconds(server, f"<speak><prosody rate='50%'>{text}</prosody></speak>")
    fast = seconds(server, f"<speak><prosody rate='x-fast'>{text}</prosody></speak>")
    assert 1.9 < slow / normal < 2.1 and 0.45 < fast / normal < 0.6
    # Nested and combined with the request's speed: 0.5 x 2.0 is the normal rate again.
    assert abs(seconds(server, f"<speak><prosody rate='50%'>{text}</prosody></speak>", speed=2.0) - normal) < 0.1


@pytest.mark.slow
def test_word_timings_over_grpc_point_into_the_document(server):
    from helpers import synthesize

    document = "<speak>Read <sub alias='World Wide Web'>WWW</sub> <break time='300ms'/>on <say-as interpret-as='date'>1/2/2025</say-as>.</speak>"
    chunks = synthesize(server.target, document)
    timings = [w for c in chunks if c.HasField("audio") for w in c.audio.words]
    assert [(t.text, document[t.text_start:t.text_end]) for t in timings] == [
        ("Read", "Read"), ("WWW", "WWW"), ("on", "on"), ("1/2/2025", "1/2/2025")]
    assert timings[1].spoken == "World Wide Web" and timings[3].spoken == "January second twenty twenty five"
    starts = [t.start_sample for t in timings]
    assert starts == sorted(starts)
    # The explicit field: plain text that starts with <speak is spoken as text when ssml is false.
    with pytest.raises(grpc.RpcError) as refused:
        synthesize(server.target, "<speak>Hi <blink>there</blink></speak>")
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "<blink>" in refused.value.details()


@pytest.mark.slow
def test_bad_ssml_over_http_names_the_element_and_the_server_goes_on(server):
    reply = httpx.post(f"{server.http_url}/v1/audio/speech",
                       json={"input": "<speak>Hello\n<prosody volume='loud'>there</prosody></speak>"}, timeout=60)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "input" and "<prosody> attribute 'volume'" in error["message"] and "line 2" in error["message"]
    reply = httpx.post(f"{server.http_url}/v1/audio/speech", json={"input": "<speak>x", "ssml": True}, timeout=60)
    assert reply.status_code == 400 and "not well-formed XML" in reply.json()["error"]["message"]
    assert seconds(server, "Still speaking.") > 0.5


@pytest.mark.slow
def test_a_voice_element_over_http_speaks_a_voice_the_model_has_and_refuses_one_it_has_not(server):
    """<voice name> over OpenAI's speech route: the model's own voice (the built-in model has one)
    speaks as without the element; a voice it does not have is 404 naming ``input`` and the element."""
    plain, _ = wav(server, "<speak>Good morning. How are you?</speak>", seed=4)
    voiced, _ = wav(server, "<speak>Good morning. <voice name='slt-en'>How are you?</voice></speak>", seed=4)
    assert np.array_equal(plain, voiced)
    reply = httpx.post(f"{server.http_url}/v1/audio/speech", timeout=60,
                       json={"input": "<speak>Hi. <voice name='nobody'>There.</voice></speak>"})
    assert reply.status_code == 404, reply.text
    error = reply.json()["error"]
    assert error["param"] == "input" and "<voice name='nobody'>: unknown voice" in error["message"]


@pytest.mark.slow
def test_the_websocket_speaks_a_whole_ssml_document_and_refuses_markup_in_live_text(server):
    from starlette.testclient import TestClient  # noqa: F401 - the real server's socket is used below
    import websockets.sync.client as ws_client

    url = server.http_url.replace("http://", "ws://") + "/v1/audio/stream"
    document = "<speak>Good <break time='200ms'/> morning.</speak>"
    with ws_client.connect(url) as socket:
        socket.send(json.dumps({"type": "start", "context_id": "a", "input": document}))
        audio, words = b"", []
        while True:
            message = socket.recv(timeout=60)
            if isinstance(message, bytes):
                audio += message
                continue
            event = json.loads(message)
            if event["type"] == "words":
                words += event["words"]
            if event["type"] in ("done", "error"):
                break
        assert event["type"] == "done" and len(audio) > 16000
        assert [document[w["text_start"]:w["text_end"]] for w in words] == ["Good", "morning"]
        socket.send(json.dumps({"type": "start", "context_id": "b"}))
        socket.send(json.dumps({"type": "text", "context_id": "b", "text": "<speak>Hi</speak>"}))
        event = json.loads(socket.recv(timeout=60))
        assert event["type"] == "error" and event["param"] == "text" and "SSML comes whole" in event["message"]


@pytest.mark.slow
def test_pronunciations_change_what_the_built_in_voice_says(server):
    from audio_pipeline.layouts.phoneme_lpc import FOLD_BASE, PHONEME_BASE
    from audio_pipeline.service.prepare import RequestPreparer

    engine = server.engine
    requests = RequestPreparer(engine)
    layout = engine.layout
    vocab = {i: n for n, i in engine.tokenizer.get_vocab().items()}

    def units(text, **fields):
        context = requests.create_context(text, **fields)
        # A folded prompt (the default voice's) holds one id per phoneme and duration: its phoneme's.
        ids = [PHONEME_BASE + (t - FOLD_BASE) // 256 if t >= FOLD_BASE else t for t in context.prompt_ids]
        return [vocab[t][4:-1] for t in ids if vocab.get(t, "").startswith("<ph:")]

    plain = units("Say tomato.")
    given = units("Say tomato.", pronunciations=from_entries([{"word": "Tomato", "phonemes": "təˈmɑːtoʊ"}]))
    assert plain != given and "aa1" in given and given[given.index("t"):given.index("t") + 6] == list(ipa_units("təˈmɑːtoʊ"))
    # The voice's lexicon from the server's pronunciations file, for every voice.
    assert units("zorb") == ["pau", *ipa_units("zɔɹb"), "pau"]
    respelled = units("Say WWW.", pronunciations=from_entries([{"word": "www", "respelling": "world wide web"}]))
    assert respelled == units("Say world wide web.")
    assert layout.takes_pronunciations
    with pytest.raises(InvalidArgument, match="SSML is read by the speech service"):
        requests.create_context("<speak>Hi</speak>")  # one context would read its markup out
    # Over HTTP, with word timings on the word as written.
    samples, _ = wav(server, "Say tomato.", pronunciations=[{"word": "tomato", "phonemes": "təˈmɑːtoʊ"}])
    assert len(samples) > 8000
    reply = httpx.post(f"{server.http_url}/v1/audio/speech", json={
        "input": "Hi", "pronunciations": [{"word": "hi", "phonemes": "h*"}]}, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "pronunciations[0]"


@pytest.mark.slow
def test_a_model_that_speaks_text_respells_and_says_phoneme_content_as_written(idle_server):
    """A token-text model (the tiny Orpheus): respellings replace words in its text prompt, a
    <phoneme>'s content is read as written, and a <prosody rate> is refused up front."""
    from audio_pipeline.service.prepare import RequestPreparer

    engine = idle_server.engine
    requests = RequestPreparer(engine)
    respelled = requests.create_context("Say WWW now", pronunciations=from_entries([{"word": "www", "respelling": "dub"}]))
    assert respelled.prompt_ids == requests.create_context("Say dub now").prompt_ids
    phoneme_only = requests.create_context("Say tomato", pronunciations=from_entries([{"word": "tomato", "phonemes": "təˈmɑːtoʊ"}]))
    assert phoneme_only.prompt_ids == requests.create_context("Say tomato").prompt_ids
    from helpers import synthesize

    chunks = synthesize(idle_server.target, "<speak>Say <phoneme ph='təˈmɑːtoʊ'>tomato</phoneme> now</speak>", max_tokens=28)
    assert any(c.HasField("complete") for c in chunks)
    with pytest.raises(grpc.RpcError) as refused:
        synthesize(idle_server.target, "<speak><prosody rate='fast'>Quick</prosody></speak>")
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "speaks at one speed" in refused.value.details()


@pytest.mark.slow
def test_the_client_library_sends_ssml_and_pronunciations(server):
    from audio_pipeline_client import TTSClient

    with TTSClient(server.target) as client:
        said = client.synthesize("<speak>Go <break time='400ms'/> now.</speak>")
        longer = client.synthesize("<speak>Go <break time='900ms'/> now.</speak>")
        assert abs((len(longer.samples) - len(said.samples)) / said.sample_rate - 0.5) <= 0.02
        # ssml=False reads markup-looking text as plain text (the normalizer's words), never refused.
        assert len(client.synthesize("<speak>", ssml=False).samples) > 0
        plain = client.synthesize("Say tomato.", seed=1, temperature=0.0)
        given = client.synthesize("Say tomato.", seed=1, temperature=0.0,
                                  pronunciations=[{"word": "tomato", "phonemes": "təˈmɑːtoʊ"}])
        assert [w.text for w in given.words] == ["Say", "tomato"]
        assert not np.array_equal(plain.samples, given.samples)


@pytest.mark.slow
def test_the_cli_client_speaks_ssml_with_pronunciations(server, tmp_path, capsys):
    from audio_pipeline_client.cli import main

    lexicon = tmp_path / "lexicon.json"
    lexicon.write_text(json.dumps([{"word": "tomato", "phonemes": "təˈmɑːtoʊ"}]))
    document = "<speak>Say <sub alias='tomato'>TMT</sub>.</speak>"
    out, timings = tmp_path / "out.wav", tmp_path / "words.json"
    assert main(["--server", server.target, "--text", document, "--pronunciations", str(lexicon), "--output", str(out),
                 "--timings", str(timings), "--quiet"]) == 0
    words = json.loads(timings.read_text())["words"]
    assert [(w["text"], document[w["text_start"]:w["text_end"]]) for w in words] == [("Say", "Say"), ("TMT", "TMT")]
    assert sf.info(str(out)).duration > 0.3
    (tmp_path / "bad.json").write_text("{}")
    assert main(["--server", server.target, "--text", "Hi", "--pronunciations", str(tmp_path / "bad.json"),
                 "--output", str(out), "--quiet"]) != 0
    assert "must be a JSON list" in capsys.readouterr().err
    assert main(["--server", server.target, "--ssml", "--text", "<speak>Hi <b/></speak>", "--output", str(out),
                 "--quiet"]) != 0
    assert "<b> is not supported" in capsys.readouterr().err


def test_mangled_documents_are_read_or_refused_never_a_crash():
    """Random edits of a full document (markup characters, element names, cut tags): every one is
    either read (and then no markup is spoken) or refused with InvalidArgument naming the text."""
    import random

    rng = random.Random(5)
    pieces = ["<", ">", "/", "&", "&amp;", "&#x41;", "&#0;", '"', "'", "=", " ", "speak", "break", "prosody",
              "say-as", "sub", "phoneme", "rate", "time", "ph", "<s>", "</s>", "<p>", "]]>", "<!--", "-->", "\x00",
              "<![CDATA[", "é", "\n"]
    read = refused = 0
    for _ in range(1500):
        text = DOCUMENT
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(text))
            if rng.random() < 0.5:
                text = text[:at] + rng.choice(pieces) + text[at:]
            else:
                text = text[:at] + text[at + rng.randint(1, 8):]
        try:
            found = ssml.parse(text)
        except InvalidArgument as error:
            assert error.field == "text" and str(error).startswith("text: SSML: ")
            refused += 1
            continue
        read += 1
        for segment in found:
            spoken = segment.normalized.spoken
            assert "<" not in spoken and ">" not in spoken
            for span in segment.normalized.spans:  # every word maps inside the document
                assert 0 <= span.source_start <= span.source_end <= len(segment.normalized.original)
    assert read > 100 and refused > 100


def test_a_replaced_contents_place_is_found_whatever_its_attributes_and_entities_hold():
    document = "<speak>Read <sub alias='a&gt;b'> WWW </sub> and <say-as interpret-as='digits'>&#x31;23</say-as>.</speak>"
    words = spoken_and_sources(document)[0][1]
    assert [w for w in words if w[1] != w[0]] == [("a", "WWW"), (">", "WWW"), ("b", "WWW"), ("one", "&#x31;23"),
                                                ("two", "&#x31;23"), ("three", "&#x31;23")]
