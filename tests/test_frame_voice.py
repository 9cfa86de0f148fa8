"""The phoneme-lpc-frame layout (one LM position and one backbone pass per 20 ms frame: the envelope
from the backbone, the prosody from a depth head, the alignment in the frame's other columns), on a
tiny random voice the test writes as the recipe writes one: the recipe's training sequences and
the engine's inputs agree, greedy frames equal a dense transformers reference alone, batched,
with overlap and one pass a round, seeded frames do not depend on the batch, one pass per frame,
and served for real with streamed audio equal to one-shot."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf

from audio_pipeline.layouts.phoneme_lpc import (CONTEXT, END_OF_SPEECH, ENVELOPE, PHONEME, PHONEME_BASE, PROSODY,
                                              alignment_tokens, prompt_ids, slot_token, split_prompt)
from audio_pipeline.layouts.phoneme_lpc_frame import PhonemeLPCFrameLayout
from frame_voice import load_reference, reference_frames, write_tiny_frame_voice
from helpers import alone_and_together, audio_of, make_config, pcm_of, run_to_completion, start_engine, synthesize

TEXTS = ["Hello there.", "A second, longer sentence to speak.", "Three."]
FLAGS = ("chunk_size=8,40",)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_frame_voice(tmp_path_factory.mktemp("frame-voice") / "model")


@pytest.fixture(scope="module")
def reference(model_dir):
    return load_reference(model_dir)


@pytest.fixture(scope="module")
def engine(model_dir):
    engine = start_engine(model_dir, *FLAGS)
    yield engine
    engine.stop(0.0)


def greedy(engine, texts):
    contexts = [engine.create_context(text, temperature=0.0, repetition_penalty=1.0) for text in texts]
    run_to_completion(engine, contexts)
    return contexts


# --- the layout --------------------------------------------------------------------------------

def test_each_position_carries_its_frame_and_the_next_frames_alignment():
    """Position k: frame k's envelope (its id) and prosody, frame k + 1's phoneme and context
    (none after the last); the start of speech carries frame 0's; the end of speech is forced
    right after the last frame. The recipe's training sequence has exactly these inputs."""
    from recipes.builtin_voice.frame_training import example

    pairs = [(PHONEME_BASE + 3, 2), (PHONEME_BASE + 7, 1)]
    prompt = prompt_ids(pairs)
    layout = PhonemeLPCFrameLayout()
    alignment = layout.alignment(prompt)
    assert alignment.tokens == 3
    assert [alignment.forced(p) for p in range(4)] == [None, None, None, END_OF_SPEECH]
    aligned = [(ph - slot_token(PHONEME, 0), ctx - slot_token(CONTEXT, 0)) for ph, ctx in alignment_tokens(pairs)]
    assert aligned == [(3, 7 * 4 + 1), (3, 7 * 4 + 0), (7, 248 * 4 + 0)]
    assert alignment.frame_codes(0) == [3, 28, -1, -1]
    assert alignment.frame_codes(1) == [7, 992, -1, -1]
    assert alignment.frame_codes(2) == [-1, -1, -1, -1]
    rows = layout.prompt_frames(prompt)
    assert rows.shape == (len(prompt), 4) and (rows[:-1] == -1).all() and rows[-1].tolist() == [3, 29, -1, -1]
    assert layout.token_range(5) == (slot_token(ENVELOPE, 0), slot_token(ENVELOPE, 0) + 1024)
    assert layout.codes_per_frame == 4 and layout.tokens_per_frame == 1

    codes = np.array([[10, 20], [11, 21], [12, 22]])
    item = example(np.array([3, 7]), np.array([2, 1]), codes)
    assert item.ids.tolist() == prompt + [slot_token(ENVELOPE, c) for c in (10, 11, 12)]
    assert item.frames[:len(prompt)].tolist() == rows.tolist()
    for k in range(3):
        expected = alignment.frame_codes(k)
        expected[ENVELOPE], expected[PROSODY] = codes[k]
        assert item.frames[len(prompt) + k].tolist() == expected
    # The output of the position before frame k predicts frame k.
    assert item.envelope[len(prompt) - 1:].tolist() == [10, 11, 12, -1]
    assert item.prosody[len(prompt) - 1:].tolist() == [20, 21, 22, -1]


def test_a_manifest_names_the_family_and_the_checkpoint_runs_with_its_depth_head(model_dir, engine):
    from audio_pipeline.layouts.manifest import ModelManifest
    from audio_pipeline.models.frame_llama import FrameLlamaPipelineModel

    assert ModelManifest.read(model_dir).family == "phoneme-lpc-frame"
    assert isinstance(engine.layout, PhonemeLPCFrameLayout)
    assert isinstance(engine.model, FrameLlamaPipelineModel) and engine.model.codes_per_token == 4


def test_a_bad_frame_head_in_config_json_is_refused_naming_it():
    from types import SimpleNamespace

    from audio_pipeline.models.frame_head import FrameHeadConfig
    from audio_pipeline.layouts.phoneme_lpc_frame import frame_head_config

    good = frame_head_config()
    assert FrameHeadConfig.of(SimpleNamespace(vocab_size=4608, frame_head=good)).codes == 4
    assert FrameHeadConfig.of(SimpleNamespace(vocab_size=4608)) is None
    for bad, message in [({**good, "depth_column": 2}, "two different columns"),
                         ({**good, "code_offsets": [256, 1280, 2304, 4000]}, "do not fit"),
                         ({k: v for k, v in good.items() if k != "codebook_size"}, "invalid frame_head"),
                         ([1, 2], "must be an object")]:
        with pytest.raises(ValueError, match=message):
            FrameHeadConfig.of(SimpleNamespace(vocab_size=4608, frame_head=bad))


# --- the engine ---------------------------------------------------------------------------------

def test_greedy_frames_equal_the_dense_reference_alone_and_batched(engine, reference):
    alone = [greedy(engine, [text])[0] for text in TEXTS]
    batched = greedy(engine, TEXTS)
    for one, together in zip(alone, batched):
        expected = reference_frames(reference, engine.layout, one.prompt_ids)
        assert len(expected) == one.alignment.tokens
        assert one.frames == expected
        assert together.frames == expected
        assert one.generated == [slot_token(ENVELOPE, f[ENVELOPE]) for f in expected]
    assert len({tuple(map(tuple, c.frames)) for c in alone}) == len(TEXTS)


def test_a_folded_prompt_is_half_as_long_and_gives_the_dense_references_greedy_frames(tmp_path, engine):
    """layout_options.prompt folded: one prompt position per phoneme (its id stands for the phoneme
    and its duration, embedded as the sum of both), the same alignment, and greedy frames equal
    to the dense reference's, alone and batched."""
    folded_dir = write_tiny_frame_voice(tmp_path / "folded", folded=True)
    folded = start_engine(folded_dir, *FLAGS)
    try:
        assert folded.layout.folded_prompt and not engine.layout.folded_prompt
        alone = [greedy(folded, [text])[0] for text in TEXTS]
        batched = greedy(folded, TEXTS)
        paired = [engine.create_context(text, temperature=0.0) for text in TEXTS]
        reference = load_reference(folded_dir)
        for one, together, pairs in zip(alone, batched, paired):
            (head, given), (paired_head, paired_given) = split_prompt(one.prompt_ids), split_prompt(pairs.prompt_ids)
            phonemes = (len(paired_head) - 3) // 2
            assert len(head) == phonemes + 3  # begin, a position per phoneme, end, start of speech
            assert given == paired_given  # then the same leading pause frames
            assert one.alignment.frames == pairs.alignment.frames  # the same speech to make
            expected = reference_frames(reference, folded.layout, one.prompt_ids)
            assert one.frames == expected and together.frames == expected
    finally:
        folded.stop(0.0)


def test_a_prompt_form_the_model_was_not_trained_on_is_refused_at_start(tmp_path, model_dir):
    import json
    import shutil

    from audio_pipeline.service.engine import TTSEngine

    mismatched = tmp_path / "mismatched"
    shutil.copytree(model_dir, mismatched)
    manifest = json.loads((mismatched / "audio_pipeline.json").read_text())
    (mismatched / "audio_pipeline.json").write_text(json.dumps({**manifest, "layout_options": {"prompt": "folded"}}))
    with pytest.raises(ValueError, match="layout_options.prompt is folded, but config.json's frame_head has no fold"):
        TTSEngine(make_config(mismatched, *FLAGS))
    (mismatched / "audio_pipeline.json").write_text(json.dumps({**manifest, "layout_options": {"prompt": "triples"}}))
    with pytest.raises(ValueError, match="layout_options.prompt 'triples' is not pairs or folded"):
        TTSEngine(make_config(mismatched, *FLAGS))


def test_one_backbone_pass_per_frame(engine):
    passes = []
    forward = engine.model.forward

    def counting(*args, **kwargs):
        passes.append(1)
        return forward(*args, **kwargs)

    engine.model.forward = counting
    try:
        (context,) = greedy(engine, TEXTS[1:2])
    finally:
        engine.model.forward = forward
    frames = context.alignment.tokens
    assert len(context.frames) == frames
    # The prompt (with frame 0's sample) in one pass, then one pass per frame; the forced end of
    # speech takes none. A multi-step round may launch a pass or two past the end (dropped).
    assert frames <= len(passes) <= frames + 2


@pytest.mark.parametrize("flags", [("enable_overlap_scheduler=true",), ("max_num_steps=1",),
                                   ("max_num_steps=3", "model.kv_cache.enable_prefix_caching=false")])
def test_scheduling_modes_give_the_same_greedy_frames(engine, model_dir, flags):
    expected = [c.frames for c in greedy(engine, TEXTS)]
    other = start_engine(model_dir, *FLAGS, *flags)
    try:
        assert [c.frames for c in greedy(other, TEXTS)] == expected
    finally:
        other.stop(0.0)


def test_seeded_frames_are_the_same_alone_and_in_any_batch(engine):
    def contexts():
        return [engine.create_context(text, seed=5 + i, temperature=4.0, top_k=40) for i, text in enumerate(TEXTS)]

    alone = []
    for context in contexts():
        run_to_completion(engine, [context])
        alone.append(context.frames)
    batched = contexts()
    run_to_completion(engine, batched)
    assert [c.frames for c in batched] == alone
    assert len({f[PROSODY] for frames in alone for f in frames}) > 3  # the depth head samples too


@pytest.mark.slow
def test_served_streams_equal_one_shot_audio_and_http_writes_a_wav(model_dir):
    """Through the real server: streams at once each get, chunk by chunk, the audio they get alone,
    one frame's samples per generated token; the vocoder decoding the whole frames at once gives
    the same audio; OpenAI's speech route writes a WAV."""
    import httpx
    import torch

    from audio_pipeline.testing.background import BackgroundServer

    server = BackgroundServer(make_config(model_dir, *FLAGS), http_port=0).start()
    try:
        def speak(index):
            return synthesize(server.target, TEXTS[index], seed=index)

        alone, together = alone_and_together(speak, 3)
        samples_per_frame = server.engine.decoder.samples_per_frame
        for one, batched in zip(alone, together):
            usage = batched[-1].complete.usage
            heard = pcm_of(batched)
            assert len(audio_of(batched)) >= 2
            assert heard.size == usage.generated_tokens * samples_per_frame
            np.testing.assert_array_equal(heard, pcm_of(one))

        context = server.engine.create_context(TEXTS[1], temperature=0.0)
        run_to_completion(server.engine, [context])
        whole = server.engine.decoder.decode(torch.tensor(context.frames).reshape(-1)).numpy()
        streamed = pcm_of(synthesize(server.target, TEXTS[1], temperature=0.0))
        np.testing.assert_allclose(streamed.astype(np.float64) / 32768, whole, atol=1 / 32768)
        response = httpx.post(f"{server.http_url}/v1/audio/speech", timeout=120,
                              json={"model": "tts", "input": "Hello from the frame voice.", "response_format": "wav"})
        assert response.status_code == 200, response.text
        wave, rate = sf.read(io.BytesIO(response.content))
        assert rate == 24000 and wave.size > 0  # OpenAI's rate, resampled from the vocoder's 16 kHz
    finally:
        server.stop()


def test_the_recipe_trains_exports_and_the_engine_speaks_a_frame_voice(tmp_path):
    """The recipe's own commands on a small synthetic dataset: a few training steps with
    --layout phoneme-lpc-frame --fold-prompt (initialised from the shipped voice's weights), the
    export, and the engine loading the exported directory as a folded-prompt phoneme-lpc-frame
    voice that speaks."""
    import json

    from audio_pipeline.service.engine import TTSEngine
    from recipes.builtin_voice import dataset, export, train
    from frame_voice import FRONT_END, SHIPPED

    rng = np.random.default_rng(0)
    inventory = [n[4:-1] for n in json.loads((SHIPPED / "tokenizer.json").read_text())["model"]["vocab"]
                 if n.startswith("<ph:")]
    phonemes = [rng.integers(0, len(inventory), 6) for _ in range(8)]
    durations = [rng.integers(1, 6, 6) for _ in range(8)]
    codes = [np.stack([rng.integers(0, 1024, d.sum()), rng.integers(0, 1024, d.sum())], 1) for d in durations]
    data = tmp_path / "data.npz"
    dataset.save({"inventory": inventory, "centroids": np.zeros((1024, 2)), "texts": ["x"] * 8,
                  "phonemes": phonemes, "durations": durations, "codes": codes}, data)
    run_dir = tmp_path / "run"
    assert train.main(["--data", str(data), "--out", str(run_dir), "--layout", "phoneme-lpc-frame", "--steps", "3",
                       "--batch-tokens", "400", "--init-from", str(SHIPPED), "--threads", "1", "--fold-prompt"]) == 0
    out = export.export(run_dir, tmp_path / "voice", decoder="mcep", decoder_dir=SHIPPED / "decoder", front_end=FRONT_END,
                        voice="tiny-frame")
    manifest = json.loads((out / "audio_pipeline.json").read_text())
    assert manifest["family"] == "phoneme-lpc-frame"
    assert manifest["layout_options"] == {"front_end": "lexicon", "prompt": "folded"}
    engine = TTSEngine(make_config(out, *FLAGS))
    engine.start()
    try:
        context = engine.create_context("Speak, trained voice.", temperature=0.0)
        run_to_completion(engine, [context])
        assert len(context.frames) == context.alignment.tokens > 10
    finally:
        engine.stop(0.0)


def test_validation_chooses_the_checkpoint_and_export_writes_that_one(tmp_path, capsys):
    """train.py --validation logs a clean-input validation loss every --validate-every steps and
    keeps the weights of the lowest one in best.pt; export --checkpoint best.pt writes those weights."""
    import re

    import torch
    from safetensors.torch import load_file

    from recipes.builtin_voice import export, train
    from frame_voice import SHIPPED

    rng = np.random.default_rng(1)
    data, held = write_frame_data(tmp_path / "train.npz", 8, rng), write_frame_data(tmp_path / "validation.npz", 4, rng)
    run_dir = tmp_path / "run"
    assert train.main(["--data", str(data), "--validation", str(held), "--validate-every", "2", "--out",
                       str(run_dir), "--layout", "phoneme-lpc-frame", "--steps", "6", "--batch-tokens", "400",
                       "--lr", "0.05", "--warmup", "1", "--init-from", str(SHIPPED), "--threads", "1"]) == 0
    logged = {int(step): float(loss) for step, loss in
              re.findall(r"step (\d+)  validation loss ([0-9.]+)", capsys.readouterr().out)}
    assert sorted(logged) == [2, 4, 6]
    best = torch.load(run_dir / "best.pt", weights_only=False)
    assert best["step"] == min(logged, key=logged.get)
    assert abs(best["validation_loss"] - logged[best["step"]]) < 1e-4
    snapshot = export.from_checkpoint(run_dir, data, "best.pt")
    assert snapshot.name == f"step-{best['step']}"
    written = load_file(snapshot / "model.safetensors")
    assert torch.equal(written["model.layers.0.mlp.up_proj.weight"],
                       best["model"]["model.layers.0.mlp.up_proj.weight"].half())


def write_frame_data(path, count, rng):
    """A frame-voice training set of ``count`` random six-phoneme utterances (the shipped inventory)."""
    import json

    from recipes.builtin_voice import dataset
    from frame_voice import SHIPPED

    inventory = [n[4:-1] for n in json.loads((SHIPPED / "tokenizer.json").read_text())["model"]["vocab"]
                 if n.startswith("<ph:")]
    durations = [rng.integers(1, 6, 6) for _ in range(count)]
    dataset.save({"inventory": inventory, "centroids": np.zeros((1024, 2)), "texts": ["x"] * count,
                  "phonemes": [rng.integers(0, len(inventory), 6) for _ in range(count)], "durations": durations,
                  "codes": [np.stack([rng.integers(0, 1024, d.sum())] * 2, 1) for d in durations]}, path)
    return path


def test_a_resumed_run_counts_the_minutes_trained_before(tmp_path, capsys):
    """--resume goes on from the checkpoint's step and the minutes already trained, so a run stopped
    by the end of a session keeps its learning-rate schedule: a run whose checkpoint has spent its
    whole time budget trains no further step."""
    import torch

    from recipes.builtin_voice import train
    from frame_voice import SHIPPED

    data = write_frame_data(tmp_path / "train.npz", 8, np.random.default_rng(2))
    run_dir = tmp_path / "run"
    common = ["--data", str(data), "--out", str(run_dir), "--layout", "phoneme-lpc-frame", "--batch-tokens", "400",
              "--warmup", "1", "--init-from", str(SHIPPED), "--threads", "1", "--save-every", "2"]
    assert train.main([*common, "--steps", "4"]) == 0
    state = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert state["step"] == 4 and state["seconds"] > 0
    state["seconds"] = 60.0  # as if a one-minute budget had been spent before the session ended
    torch.save(state, run_dir / "checkpoint.pt")
    capsys.readouterr()
    assert train.main([*common, "--steps", "100", "--minutes", "1", "--resume"]) == 0
    assert "resumed at step 4 (1.0 minutes trained)" in capsys.readouterr().out
    assert torch.load(run_dir / "checkpoint.pt", weights_only=False)["step"] == 4


def test_init_codec_starts_each_new_code_from_the_old_codecs_nearest(tmp_path, capsys):
    """train.py --init-codec OLD --codec NEW (a student of a new codec from a model of the old one):
    the tied embedding's envelope rows start in the new codec's order (input, output and depth
    readout alike), the prosody rows by the nearest levels, every other weight as loaded."""
    import torch
    from safetensors.torch import load_file

    from recipes.builtin_voice import train
    from recipes.builtin_voice.mcep_codec import Quantizer
    from frame_voice import SHIPPED

    old = Quantizer.load(SHIPPED / "decoder")
    order = np.random.default_rng(3).permutation(len(old.codebook))
    Quantizer(old.codebook[order], dict(old.config)).save(tmp_path / "codec")
    data = write_frame_data(tmp_path / "train.npz", 4, np.random.default_rng(4))
    run_dir = tmp_path / "run"
    assert train.main(["--data", str(data), "--out", str(run_dir), "--layout", "phoneme-lpc-frame", "--steps", "1",
                       "--batch-tokens", "400", "--lr", "0", "--warmup", "1", "--init-from", str(SHIPPED),
                       "--init-codec", str(SHIPPED / "decoder"), "--codec", str(tmp_path / "codec"),
                       "--threads", "1"]) == 0
    assert "1024 envelope and 1024 prosody rows of the old codec" in capsys.readouterr().out
    loaded = load_file(SHIPPED / "model.safetensors")["model.embed_tokens.weight"].float()
    trained = torch.load(run_dir / "checkpoint.pt", weights_only=False)["model"]
    rows = trained["model.embed_tokens.weight"]
    envelope, prosody = 256 + 2 * 1024, 256 + 3 * 1024
    torch.testing.assert_close(rows[envelope:envelope + 1024], loaded[envelope:envelope + 1024][torch.from_numpy(order)])
    torch.testing.assert_close(rows[prosody:prosody + 1024], loaded[prosody:prosody + 1024])
    torch.testing.assert_close(rows[:envelope], loaded[:envelope])
    assert torch.equal(trained["lm_head.weight"], rows)
    with pytest.raises(SystemExit, match="--init-codec needs"):
        train.main(["--data", str(data), "--out", str(run_dir), "--layout", "phoneme-lpc-frame",
                    "--init-codec", str(SHIPPED / "decoder")])
