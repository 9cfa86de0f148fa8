"""Kyutai TTS through the engine (the paged KV cache with its sliding window, the runner's text
stream, the request's rule, Mimi streamed): greedy requests give the reference's fixtures
(tests/fixtures/kyutai_tts) exactly: every fed text id, every audio code, the audio within 1e-4,
alone and batched with each other; voices and refusals name their field."""

from __future__ import annotations

import numpy as np
import pytest

from audio_pipeline.errors import RequestError
from helpers import run_to_completion, start_engine
from kyutai_tts_cases import FIXTURES, check, dialogue, load_case, model_with_options, requests_of

#: The engine's settings for the reference's cases (the checkpoint, its manifest's layout_options)
#: and the cases it serves as the reference generated them.
SERVED = {
    # Room for one condition: two voices batched make each again at every step.
    "distilled": ("distilled", {"kept_conditions": 1}, ["distilled_one", "distilled_batch", "distilled_long"]),
    "distilled-nq4": ("distilled", {"n_q": 4}, ["distilled_nq4"]),
    "distilled-bonus": ("distilled", {"padding_bonus": 10.0}, ["distilled_padding_bonus"]),
    "plain-unguided": ("plain", {"cfg_coef": 1.0}, ["plain_no_cfg"]),
    "plain-doubled": ("plain", {}, ["plain_cfg"]),
    "plain-doubled-bonus": ("plain", {"padding_bonus": -8.0}, ["plain_other_ids"]),
}


@pytest.fixture(scope="module", params=sorted(SERVED))
def engine(request, tmp_path_factory):
    checkpoint, options, cases = SERVED[request.param]
    directory = FIXTURES / "models" / checkpoint
    if options:
        directory = model_with_options(tmp_path_factory.mktemp("kyutai") / checkpoint, checkpoint, options)
    engine = start_engine(directory, "chunk_size=96,128", "sampling.max_tokens=400",
                          model={"kv_cache": {"cache_dtype": "float32"}})
    engine.variant, engine.cases = request.param, cases
    yield engine
    engine.stop()


def test_each_case_alone_equals_the_reference(engine):
    for context, name, item in requests_of(engine, engine.cases):
        [chunks] = run_to_completion(engine, [context])
        check(context, chunks, name, item)


def test_the_cases_batched_together_equal_the_reference(engine):
    requests = requests_of(engine, engine.cases)
    results = run_to_completion(engine, [context for context, _, _ in requests])
    for (context, name, item), chunks in zip(requests, results):
        check(context, chunks, name, item)


def test_voices_are_named_as_published_and_refusals_name_their_field(engine):
    layout = engine.layout
    assert layout.voice_names == ("expresso/ex03-ex01_happy_001_channel1_334s", "vctk/p225_023")
    for name in ("vctk/p225_023", "vctk/p225_023.wav", "p225_023", "p225_023.wav"):
        assert engine.create_context("Hello.", voice=name).prompt_ids == \
            engine.create_context("Hello.", voice="vctk/p225_023").prompt_ids
    with pytest.raises(RequestError) as refused:
        engine.create_context("Hello.", voice="nobody")
    assert refused.value.field == "voice"


def test_ssml_voices_speak_the_references_dialogues_batched_with_another_request(engine):
    """Through the speech service: an SSML document whose <voice> names a second voice is one
    dialogue (the request's voice the main speaker, each turn marked by its speaker's token, the
    two voices in one condition): two dialogues (one starting with the other speaker) and a plain
    request, all at once, give the reference's fed ids, frames, timestamps and audio."""
    if engine.variant != "distilled":
        pytest.skip("one model is enough")
    import asyncio

    from audio_pipeline.service.request import SpeechRequest
    from audio_pipeline.service.speech import SpeechService

    service = SpeechService(engine)
    service.ready = True
    dialog, one = load_case("distilled_dialog"), load_case("distilled_one")
    requests = [(*dialogue(dialog, 0), "distilled_dialog", 0), (*dialogue(dialog, 1), "distilled_dialog", 1),
                (one["script"][0][0], one["voices"][0], "distilled_one", 0)]

    async def speak(text, voice):
        stream = await service.open(SpeechRequest(text=text, voice=voice, sampling={"temperature": 0.0},
                                                  format="float32"))
        chunks = [np.frombuffer(event.data, dtype="<f4") async for event in stream.events()
                  if getattr(event, "data", b"")]
        return stream.synthesis._submitted, chunks

    async def all_at_once():
        return await asyncio.gather(*(speak(text, voice) for text, voice, _, _ in requests))

    try:
        for (contexts, chunks), (_, _, name, item) in zip(asyncio.run(all_at_once()), requests):
            assert len(contexts) == 1  # the whole dialogue is one request
            check(contexts[0], chunks, name, item)
    finally:
        service.close()


def test_a_dialogue_of_more_than_two_voices_or_an_unknown_one_is_refused_naming_the_element(tmp_path):
    """Two speakers take turns (their tokens mark them): on a checkpoint of three voices, a document
    naming two voices besides the request's, or a voice the model does not have, is refused before
    any audio, naming the field and the element; the request's own voice under another of its
    names is its main speaker."""
    import asyncio
    import shutil

    from audio_pipeline.errors import InvalidArgument, NotFound
    from audio_pipeline.service.request import SpeechRequest
    from audio_pipeline.service.speech import SpeechService

    directory = tmp_path / "three"
    shutil.copytree(FIXTURES / "models" / "distilled", directory)
    vctk = directory / "voices" / "vctk"
    shutil.copy(next(vctk.iterdir()), vctk / "p226_001.wav.d5a1c0de@7.safetensors")
    engine = start_engine(directory, "chunk_size=96,128", "sampling.max_tokens=40")
    service = SpeechService(engine)
    service.ready = True
    voices = engine.layout.voice_names
    assert len(voices) == 3

    async def speak(text):
        stream = await service.open(SpeechRequest(text=text, voice=voices[0]))
        stream.close()

    try:
        asyncio.run(speak(f"<speak>Hi. <voice name='{voices[0].split('/')[-1]}.wav'>Yes.</voice> "
                          f"<voice name='{voices[1]}'>No.</voice></speak>"))
        with pytest.raises(NotFound) as unknown:
            asyncio.run(speak("<speak>Hi. <voice name='nobody'>Yes.</voice></speak>"))
        assert unknown.value.field == "text" and "<voice name='nobody'>: unknown voice" in str(unknown.value)
        with pytest.raises(InvalidArgument) as refused:
            asyncio.run(speak(f"<speak>Hi. <voice name='{voices[1]}'>Yes.</voice><voice name='{voices[2]}'>No."
                              "</voice></speak>"))
        assert refused.value.field == "text" and "a dialogue of two voices" in str(refused.value)
        assert voices[1] in str(refused.value) and voices[2] in str(refused.value)
    finally:
        service.close()
        engine.stop()


def _served(tmp_path):
    """A real server (the engine core in its own process) on the distilled fixture checkpoint,
    greedy requests exact: a float32 KV cache."""
    from audio_pipeline.config import AudioGenerationConfig
    from audio_pipeline.testing.background import BackgroundServer

    config = AudioGenerationConfig.load(
        env={}, audio_flags=["grace_period_s=5", "sampling.max_tokens=400"],
        model={"model_path": str(FIXTURES / "models" / "distilled"), "device": "cpu",
               "kv_cache": {"cache_dtype": "float32"}}, voices_dir=str(tmp_path / "voices"))
    return BackgroundServer(config, http_port=0).start()


@pytest.mark.slow
def test_served_over_grpc_http_and_the_websocket_with_its_voices_and_clear_errors(tmp_path):
    """A checkpoint laid out as published (no manifest) behind the real server (the engine core in
    its own process): gRPC streams the reference's audio (greedy, as PCM16), /v1/audio/voices lists
    the voices folder, OpenAI's speech route (a voice by its file name) and the WebSocket speak what
    gRPC speaks for the same seed; a reference recording or an unknown voice is refused naming the
    field; an SSML <voice> speaks the reference's dialogue."""
    import grpc
    import httpx

    from helpers import pcm_of, recording, socket_session, synthesize

    server = _served(tmp_path)
    try:
        case = load_case("distilled_one")
        text, voice = case["script"][0][0], case["voices"][0]
        reference = np.load(FIXTURES / "cases" / "distilled_one" / "audio_0.npy")
        chunks = synthesize(server.target, text, voice=voice, temperature=0.0)
        np.testing.assert_allclose(pcm_of(chunks).astype(np.float32) / 32768, reference, atol=1e-4, rtol=0)
        # Word timings are the model's own: each word of the text once, in order, starting where the
        # reference read it (frame s, less the two frames of lead-in), ending where the next starts.
        timings = [w for c in chunks if c.HasField("audio") for w in c.audio.words]
        assert [(text[w.text_start:w.text_end], w.text) for w in timings] == [(w, w) for w in text.split(" ")]
        assert [w.start_sample for w in timings] == [(step - 2) * 1920 for _, step in case["transcripts"][0]]
        assert [w.end_sample for w in timings] == [w.start_sample for w in timings[1:]] + [reference.size]
        voices = httpx.get(f"{server.http_url}/v1/audio/voices", timeout=30).json()
        assert {v["name"] for v in voices["voices"] if not v["registered"]} == set(load_case("distilled_batch")["voices"])
        # The other doors take a seed, not a temperature: the family's sampling, the same audio as gRPC's.
        seeded = pcm_of(synthesize(server.target, text, voice=voice, seed=7)).tobytes()
        spoken = httpx.post(f"{server.http_url}/v1/audio/speech", timeout=120,
                            json={"model": "tts", "input": text, "voice": "ex03-ex01_happy_001_channel1_334s.wav",
                                  "response_format": "pcm", "seed": 7})
        assert spoken.status_code == 200, spoken.text
        assert spoken.content == seeded
        received, audio = socket_session(server, [
            {"type": "start", "context_id": "a", "voice": voice, "seed": 7},
            {"type": "text", "context_id": "a", "text": text}, {"type": "end", "context_id": "a"}])
        assert [e["type"] for e in received if e["type"] in ("done", "error")] == ["done"], received
        assert audio["a"] == seeded
        # An SSML <break> is the model's own pause, as the reference reads <break time="..."/> in a script.
        broken = load_case("distilled_break")
        document = "<speak>" + broken["script"][0][0] + "</speak>"
        chunks = synthesize(server.target, document, voice=broken["voices"][0], temperature=0.0, ssml=True)
        np.testing.assert_allclose(pcm_of(chunks).astype(np.float32) / 32768,
                                   np.load(FIXTURES / "cases" / "distilled_break" / "audio_0.npy"), atol=1e-4, rtol=0)
        # An SSML <voice> is a dialogue's other speaker: the reference's dialogue (the other speaker
        # first), its words' timings pointing into the document where the reference read them.
        dialog = load_case("distilled_dialog")
        document, main = dialogue(dialog, 1)
        chunks = synthesize(server.target, document, voice=main, temperature=0.0, ssml=True)
        np.testing.assert_allclose(pcm_of(chunks).astype(np.float32) / 32768,
                                   np.load(FIXTURES / "cases" / "distilled_dialog" / "audio_1.npy"), atol=1e-4, rtol=0)
        timings = [w for c in chunks if c.HasField("audio") for w in c.audio.words]
        assert [document[w.text_start:w.text_end] for w in timings] == [word for word, _ in dialog["transcripts"][1]]
        assert [w.start_sample for w in timings] == [(step - 2) * 1920 for _, step in dialog["transcripts"][1]]
        for fields, name in ((dict(reference=recording(rate=24000)), "reference"), (dict(voice="nobody"), "voice")):
            with pytest.raises(grpc.RpcError) as error:
                synthesize(server.target, "Hello.", **fields)
            assert error.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
            assert name in error.value.details(), error.value.details()
    finally:
        server.stop()


def _wait_for(condition, timeout: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def test_words_sent_in_time_give_the_one_shot_frames(engine):
    """A request whose words come in two pieces, the second well before the model needs it (the
    word two ahead of the one being read), then the close: the frames, fed ids and timestamps of
    the one-shot request."""
    if engine.variant != "distilled":
        pytest.skip("one model is enough")
    case = load_case("distilled_long")
    text, voice = case["script"][0][0], case["voices"][0]
    first, rest = text.split(" ", 4)[:4], text.split(" ", 4)[4]
    context = engine.create_context(" ".join(first), voice=voice, temperature=0.0)
    context.text_rule.state.open = True
    import queue as queues

    events: queues.Queue = queues.Queue()
    engine.submit(context, events.put)
    engine.extend(context.request_id, engine.layout.words(rest, after=0))
    engine.extend(context.request_id, [], close=True)
    chunks = []
    while (event := events.get(timeout=120)).kind == "audio":
        chunks.append(event.samples)
    assert event.kind == "complete", event.error
    check(context, chunks, "distilled_long", 0)


def test_late_words_are_waited_for_and_all_spoken_in_order(engine):
    """Words that arrive after the model asked for them: it pads until they come (no word skipped
    or repeated), the wait shows in when each word was read, and the speech ends only once the
    input is closed."""
    if engine.variant != "distilled":
        pytest.skip("one model is enough")
    import queue as queues

    case = load_case("distilled_one")
    text, voice = case["script"][0][0], case["voices"][0]
    words = text.split(" ")
    context = engine.create_context(" ".join(words[:2]), voice=voice, temperature=0.0)
    context.text_rule.state.open = True
    events: queues.Queue = queues.Queue()
    engine.submit(context, events.put)
    # Well past where the one-shot request read its third word, nothing more has come: it waits.
    third = case["consumption_times"][0][2]
    _wait_for(lambda: len(context.frames) > third + 12)
    assert [word for word, _ in context.text_rule.state.transcript] == words[:2]
    assert context.stop_reason is None
    engine.extend(context.request_id, engine.layout.words(" ".join(words[2:]), after=0))
    _wait_for(lambda: len(context.text_rule.state.transcript) == len(words))
    assert context.stop_reason is None  # not closed: it goes on waiting
    engine.extend(context.request_id, [], close=True)
    while (event := events.get(timeout=120)).kind == "audio":
        pass
    assert event.kind == "complete" and event.stop_reason.name == "END_OF_SPEECH", event.error
    read = context.text_rule.state.transcript
    assert [word for word, _ in read] == words
    assert read[2][1] > third + 12  # read once it came
    assert context.text_rule.end_step > read[-1][1]


@pytest.mark.slow
def test_live_text_is_spoken_word_by_word_before_the_sentence_ends(tmp_path):
    """Over gRPC's live text (the client library's stream_text) the model speaks while the text
    is still coming: audio arrives while the client holds back the end of an unfinished sentence;
    all the text sent at once, then closed, speaks the one-shot audio; the WebSocket takes words
    in pieces too."""
    import threading

    from audio_pipeline_client import TTSClient

    from helpers import socket_session

    server = _served(tmp_path)
    try:
        case = load_case("distilled_one")
        text, voice = case["script"][0][0], case["voices"][0]
        heard = threading.Event()
        held_back = []

        def pieces():  # read by gRPC's own thread while this one reads the audio
            yield "Hello world, this "
            held_back.append(heard.wait(timeout=120))  # False: no audio came while the text was held back
            yield "is a tiny test."

        with TTSClient(server.target, timeout=300) as client:
            chunks = []
            for chunk in client.stream_text(pieces(), voice=voice, temperature=0.0):
                if not chunk.final:
                    heard.set()
                    chunks.append(chunk.samples)
            assert held_back == [True] and sum(c.size for c in chunks) > 0
            whole = [c.samples for c in client.stream_text([text], voice=voice, temperature=0.0) if not c.final]
        reference = np.load(FIXTURES / "cases" / "distilled_one" / "audio_0.npy")
        np.testing.assert_allclose(np.concatenate(whole), reference, atol=1e-4, rtol=0)
        received, audio = socket_session(server, [
            {"type": "start", "context_id": "a", "voice": voice, "seed": 1},
            *({"type": "text", "context_id": "a", "text": piece} for piece in ("Hello wor", "ld, this is ", "a test.")),
            {"type": "end", "context_id": "a"}])
        assert [e["type"] for e in received if e["type"] in ("done", "error")] == ["done"], received
        assert audio["a"]
        # The model's word timings, in order, pointing into all the pieces joined.
        said = [w for e in received if e["type"] == "words" for w in e["words"]]
        assert [w["text"] for w in said] == ["Hello", "world,", "this", "is", "a", "test."], said
    finally:
        server.stop()


@pytest.mark.slow
def test_a_random_model_of_the_published_shape_serves_and_the_live_text_benchmark_measures_it(tmp_path, capsys):
    """The benchmarks' random models: the tiny shape through bench.live_text (first audio after the
    first word); the 1.6B shape's directory is laid out as published and its config reads."""
    from audio_pipeline.bench.live_text import main
    from audio_pipeline.checkpoints.kyutai_tts_config import read_dsm_config
    from audio_pipeline.layouts.registry import detect_family
    from audio_pipeline.testing.random_models import write_random_model

    assert main(["--sentences", "1", "--rounds", "1", "--rate", "50", "--random-model", "kyutai-tts-tiny",
                 "--task-arg", "chunk_size=96,128", "--task-arg", "sampling.max_tokens=120"]) == 0
    assert "ms after the first word" in capsys.readouterr().out
    directory = write_random_model(tmp_path / "big", "kyutai-tts-1.6b")
    config = read_dsm_config(directory)
    assert (config.dim, config.num_layers, config.n_q, config.card, config.audio_delay_steps) == (2048, 16, 32, 2048, 16)
    assert detect_family(directory).name == "kyutai-tts"


def test_the_conditions_kept_are_bounded_and_one_made_again_is_alike(engine):
    """A server keeps a few voices' conditions (their cross-attention keys and values are large;
    the manifest's kept_conditions): with room for one, two voices batched still speak the
    reference's audio, each condition made again when it comes back, and the model holds no more
    than the bound. A bound that is not a whole number from 1 is refused naming the option."""
    if engine.variant != "distilled":
        pytest.skip("one model is enough")
    from audio_pipeline.checkpoints.kyutai_tts_config import generation_options

    model = engine.backend.assembly.model.model
    assert model.options.kept_conditions == 1
    model._conditions.clear()  # what earlier tests left
    requests = requests_of(engine, ["distilled_batch"])
    results = run_to_completion(engine, [context for context, _, _ in requests])
    for (context, name, item), chunks in zip(requests, results):
        check(context, chunks, name, item)
    assert len(model._conditions) == 1
    config = model.dsm.config
    assert generation_options(FIXTURES, config, {}).kept_conditions == 16
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="layout_options.kept_conditions"):
            generation_options(FIXTURES, config, {"kept_conditions": bad})


SENTENCES = ["Hello world, this is a tiny test.", "How are you today?", "The quick brown fox jumps.",
             "Bonjour tout le monde.", "Streaming text arrives word by word.", "I am fine, thank you."]


def test_a_text_longer_than_one_request_is_spoken_whole_in_runs(tmp_path):
    """A text stream's request takes words while they fit in what it may generate (a model of 200
    positions here): a longer text, whole or live (in small pieces, or all in one message, whose
    words are cut where they do not fit), goes on in the next request at a segment's start, and
    every word is read once, in order, with its timing, the speech ending at its end (not cut at a
    token budget); a text that fits is one request, the one-shot request's frames exactly."""
    import asyncio

    from audio_pipeline.service.request import SpeechDone, SpeechRequest
    from audio_pipeline.service.speech import SpeechService

    engine = start_engine(FIXTURES / "models" / "distilled", "chunk_size=96,128", max_length=200)
    service = SpeechService(engine)
    service.ready = True
    text = " ".join(SENTENCES * 3)

    async def whole(text):
        stream = await service.open(SpeechRequest(text=text, sampling={"temperature": 0.0}, format="float32"))
        events = [event async for event in stream.events()]
        return stream.synthesis._submitted, events

    async def live(pieces):
        stream = service.open_live(SpeechRequest(sampling={"temperature": 0.0}, format="float32"))
        for piece in pieces:
            await stream.text.add(piece)
        await stream.text.end()
        await stream.start()
        return stream.synthesis._submitted, [event async for event in stream.events()]

    try:
        for contexts, events in (asyncio.run(whole(text)),
                                 asyncio.run(live([text[i:i + 7] for i in range(0, len(text), 7)])),
                                 asyncio.run(live([text]))):  # all of it in one message
            assert len(contexts) > 2  # several requests
            assert isinstance(events[-1], SpeechDone) and events[-1].stop_reason.name == "END_OF_SPEECH"
            read = [word for context in contexts for word, _ in context.text_rule.state.transcript]
            assert read == text.split(" ")
            timings = [w for event in events for w in getattr(event, "words", ())]
            assert [text[w.text_start:w.text_end] for w in timings] == text.split(" ")
            starts = [w.start_sample for w in timings]
            assert starts == sorted(starts) and starts[-1] < events[-1].audio_samples
            for context in contexts:  # each ended by its own end of speech
                assert context.text_rule.end_step is not None and context.stop_reason.name == "END_OF_SPEECH"
        # Two sentences fit in one request: the one-shot request's frames.
        short = " ".join(SENTENCES[:2])
        (context,), _ = asyncio.run(whole(short))
        alone = engine.create_context(short, temperature=0.0)
        run_to_completion(engine, [alone])
        assert context.frames == alone.frames and context.generated == alone.generated
    finally:
        service.close()
        engine.stop()


def test_words_after_a_request_ran_out_waiting_start_the_next_one(tmp_path):
    """Live text that stops coming for longer than a request may wait (it pads until its positions
    run out): the words that come after it are spoken by the next request, none lost."""
    import asyncio
    import contextlib

    from audio_pipeline.service.request import SpeechDone, SpeechRequest
    from audio_pipeline.service.speech import SpeechService

    # Padding as fast as it runs (not paced to its listener), so that it runs out soon.
    engine = start_engine(FIXTURES / "models" / "distilled", "chunk_size=96,128", "sampling.max_tokens=100",
                          max_length=120, text_wait_lead_ms=None)
    service = SpeechService(engine)
    service.ready = True

    async def run():
        stream = service.open_live(SpeechRequest(sampling={"temperature": 0.0}, format="float32"))
        await stream.text.add("Hello world, this is ")
        await stream.start()
        events = []
        async with contextlib.aclosing(stream.events()) as reading:
            async for event in reading:
                events.append(event)
                first = stream.synthesis._submitted[0]
                if first.stop_reason is not None and len(events) > 1:
                    break
            assert first.stop_reason.name == "MAX_TOKENS"  # it waited until it could not go on
            await stream.text.add("a tiny test. How are you?")
            await stream.text.end()
            events += [event async for event in reading]
        return stream.synthesis._submitted, events

    try:
        contexts, events = asyncio.run(run())
        assert len(contexts) == 2 and isinstance(events[-1], SpeechDone)
        read = [word for context in contexts for word, _ in context.text_rule.state.transcript]
        assert read == "Hello world, this is a tiny test. How are you?".split(" ")
        assert contexts[1].stop_reason.name == "END_OF_SPEECH"
    finally:
        service.close()
        engine.stop()


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_a_long_request_holds_about_a_window_of_kv_and_speaks_the_reference(kernel):
    """Pages of 8 positions against the model's 32-position window: the pages a request's queries
    no longer see go back to the pool as it goes (94 frames hold at most the window and two part
    pages, not all 12), and both attention forms (the native kernel, the torch form gathering only
    the window) still give the reference's frames and audio, alone and batched."""
    import threading

    engine = start_engine(FIXTURES / "models" / "distilled", "chunk_size=96,128", "sampling.max_tokens=400",
                          model={"kv_cache": {"cache_dtype": "float32", "kv_cache_page_size": 8,
                                              "attention_kernel": kernel}})
    peak, done = [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], engine.kv_cache.num_used_blocks)
            done.wait(0.0005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        [(context, name, item)] = requests_of(engine, ["distilled_long"])
        [chunks] = run_to_completion(engine, [context])
        check(context, chunks, name, item)
        assert 0 < peak[0] <= (32 + 2 * 8) // 8 < -(-len(context.frames) // 8)
        requests = requests_of(engine, ["distilled_long", "distilled_batch"])
        results = run_to_completion(engine, [context for context, _, _ in requests])
        for (context, name, item), chunks in zip(requests, results):
            check(context, chunks, name, item)
    finally:
        done.set()
        watcher.join()
        engine.stop()
    assert engine.kv_cache.num_used_blocks == 0


def test_word_timings_point_at_what_was_written_where_the_text_is_normalized(engine):
    """Words the model reads in their spoken form (numbers, money, times, abbreviations) time the
    text as the client wrote it: one timing per written piece (what the normalizer replaced as one,
    "in 1847" whole), in order, none overlapping, its ``spoken`` what was said; whole or as live
    text, where a word whose reading goes with the next waits for it so that they are read
    together (a number and its unit, a year's cue and the year)."""
    if engine.variant != "distilled":
        pytest.skip("one model is enough")
    import asyncio

    from audio_pipeline.service.request import SpeechRequest
    from audio_pipeline.service.speech import SpeechService

    service = SpeechService(engine)
    service.ready = True
    text = "They came in 1847, with $4,500 for Dr. Smith at 7:30 am. It was 120 m long."

    async def whole():
        stream = await service.open(SpeechRequest(text=text, sampling={"seed": 3}, format="float32"))
        return [w for event in [e async for e in stream.events()] for w in getattr(event, "words", ())]

    async def live():
        stream = service.open_live(SpeechRequest(sampling={"seed": 3}, format="float32"))
        for index in range(0, len(text), 5):
            await stream.text.add(text[index:index + 5])
        await stream.text.end()
        await stream.start()
        return [w for event in [e async for e in stream.events()] for w in getattr(event, "words", ())]

    try:
        for timings in (asyncio.run(whole()), asyncio.run(live())):
            assert all(a.text_end <= b.text_start for a, b in zip(timings, timings[1:]))
            assert all(text[w.text_start:w.text_end] == w.text for w in timings)
            assert " ".join(w.text for w in timings) == text  # every written word, once
            spoken = {w.text.strip(".,"): w.spoken.strip(".,") for w in timings}
            assert spoken["$4,500"] == "four thousand five hundred dollars" and spoken["Dr"] == "doctor"
            # Live, a number waits for the word after it, a year's cue for the year: read together.
            assert spoken["7:30 am"] == "seven thirty a m" and spoken["120 m"] == "one hundred twenty meters"
            assert spoken["in 1847"] == "in eighteen forty-seven"
    finally:
        service.close()


def test_a_pause_in_live_text_is_heard_about_as_long_as_it_was(engine):
    """While live text has no next word, the model pads only while its listener has less than
    text_wait_lead_ms of audio left: a second's pause adds about a second (and the model's
    text-to-audio delay) to the audio, not the many seconds it pads in a second on its own (15 on
    2 cores); the words after the pause are all spoken."""
    if engine.variant != "distilled":
        pytest.skip("one model is enough")
    import asyncio
    import time

    from audio_pipeline.service.request import SpeechRequest
    from audio_pipeline.service.speech import SpeechService

    service = SpeechService(engine)
    service.ready = True

    async def speak(pause: float):
        stream = service.open_live(SpeechRequest(sampling={"temperature": 0.0}, format="float32"))
        await stream.text.add("Hello world, this ")
        await stream.start()
        waited = []

        async def feed():
            started = time.monotonic()
            await asyncio.sleep(pause)
            waited.append(time.monotonic() - started)
            await stream.text.add("is a tiny test.")
            await stream.text.end()

        feeding = asyncio.create_task(feed())
        samples = 0
        async for event in stream.events():
            samples += len(getattr(event, "data", b"")) // 4
        await feeding
        [context] = stream.synthesis._submitted
        return samples / engine.sample_rate, waited[0], context

    try:
        alone, _, _ = asyncio.run(speak(0.0))
        paused, waited, context = asyncio.run(speak(1.0))
        assert [word for word, _ in context.text_rule.state.transcript] == "Hello world, this is a tiny test.".split()
        assert paused - alone <= waited + 2.5, (alone, paused, waited)
    finally:
        service.close()



def test_a_small_max_tokens_ends_a_text_whose_pieces_cannot_be_cut_further(engine):
    """An explicit max_tokens too small for a written word's reading ("$42.50" reads as six words
    from one place in the text): each piece goes in a request of its own and the speech ends (no
    endless requests cut at nothing)."""
    if engine.variant != "distilled":
        pytest.skip("one model is enough")
    import asyncio

    from audio_pipeline.service.request import SpeechDone, SpeechRequest
    from audio_pipeline.service.speech import SpeechService

    service = SpeechService(engine)
    service.ready = True

    async def speak():
        stream = await service.open(SpeechRequest(text="The total comes to $42.50, including tax. It is sunny.",
                                                  sampling={"max_tokens": 60, "seed": 1}, format="float32"))
        events = [event async for event in stream.events()]
        return events, stream.synthesis._submitted

    try:
        events, contexts = asyncio.run(asyncio.wait_for(speak(), 120))
        assert isinstance(events[-1], SpeechDone) and 1 < len(contexts) < 20
        assert all(context.text_rule.state.consumed_at for context in contexts)  # each read a word
    finally:
        service.close()
