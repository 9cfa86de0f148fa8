"""The teacher's own vocoder parameters, for a codec that needs no analysis of its audio.

Festival's ``cmu_us_slt_arctic_hts`` voice is an HTS voice: its engine generates, from each
utterance's full-context labels, a 45-value mel-cepstrum (all-pass constant 0.45, at 32 kHz) and
log F0 every 5 ms, and filters pulses or noise through it (no aperiodicity stream). The codec
(mcep_codec.py) analyses the teacher's audio with WORLD instead, and that analysis is where most
of its loss lies (NOTES.md, "Where the codec loses"). Here the parameters come from the engine:
Festival writes each utterance's labels with their times (a redefinition of its ``HTS`` synth
type adds ``("-od" FILE)`` to ``hts_output_params``; its own build ignores ``-om`` and ``-of``),
and Debian's ``hts_engine`` (package ``htsengine``) generates the mel-cepstra and log F0 from
them with the labels' durations (``-vp``).

:func:`frame_parameters` turns them into the codec's analysis form (mcep_codec.Analyzer's:
c0..c_order on its warped axis at 16 kHz, band aperiodicities, F0 per frame), so the codec's
quantizer and the mcep decoder take them unchanged.

    apt-get install festival festvox-us-slt-hts htsengine          # recipe only
    python -m recipes.builtin_voice.teacher_parameters evaluate --split validation --count 60
    python -m recipes.builtin_voice.teacher_parameters fit --count 1600 --out /tmp/tp-codec-1600
    python -m recipes.builtin_voice.teacher_parameters equalize --decoder /tmp/tp-codec-1600   # its envelope_offset
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from recipes.builtin_voice.teacher import VOICE, _scheme_string

VOICE_FILE = Path("/usr/share/festival/voices/us/cmu_us_slt_arctic_hts/hts/cmu_us_slt_arctic_hts.htsvoice")
#: The voice file's stream layout ([GLOBAL] and [STREAM] of the .htsvoice).
TEACHER_RATE, TEACHER_PERIOD_MS, TEACHER_ORDER, TEACHER_ALPHA = 32000, 5, 45, 0.45
#: hts_engine writes 16-bit sample units; the codec works in [-1, 1].
SAMPLE_SCALE = 32768.0
#: Aperiodicity given for every band: the teacher never mixes noise into a voiced frame.
PERIODIC_DB = -60.0
UNVOICED = -1e9  # hts_engine's log F0 of an unvoiced frame is -1e10

# The stock HTS synth type with one more output: the labels with their times, to ``tp_label``.
_SYNTH_TYPE = """(defvar tp_label "/dev/null")
(defSynthType HTS
  (let ()
    (apply_hooks hts_synth_pre_hooks utt)
    (set! featstring_list (hts_dump_feats_string_list utt hts_feats_list))
    (set! hts_output_params (list (list "-labelstring" featstring_list) (list "-od" tp_label)))
    (HTS_Synthesize utt)
    (apply_hooks hts_synth_post_hooks utt)
    utt))"""


def _tool(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} is not installed (apt-get install {package})")
    return path


def generate(texts: list[tuple[int, str]], out_dir: Path, *, audio: bool = True) -> dict[int, dict[str, Path]]:
    """For each ``(index, text)``: Festival's audio and labels, and hts_engine's mel-cepstra, log F0
    and audio from those labels (files NNNNN.{wav,lab,mcp,lf0,hts.wav} in ``out_dir``; made once).
    ``audio=False`` skips hts_engine's audio (a dataset needs only the parameters)."""
    festival = _tool("festival", "festival festvox-us-slt-hts")
    engine = _tool("hts_engine", "htsengine")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {index: {kind: out_dir / f"{index:05d}.{kind}" for kind in ("wav", "lab", "mcp", "lf0", "hts.wav")}
             for index, _ in texts}
    missing = [(index, text) for index, text in texts if not paths[index]["lf0"].exists()]
    if missing:
        lines = [f"(voice_{VOICE})", _SYNTH_TYPE]
        for index, text in missing:
            lines += [f"(set! tp_label {_scheme_string(str(paths[index]['lab']))})",
                      f"(set! utt (Utterance Text {_scheme_string(text)}))", "(utt.synth utt)",
                      f"(utt.save.wave utt {_scheme_string(str(paths[index]['wav']))} 'riff)"]
        with tempfile.NamedTemporaryFile("w", suffix=".scm", delete=False) as script:
            script.write("\n".join(lines) + "\n")
        try:
            done = subprocess.run([festival, "-b", script.name], capture_output=True, text=True, timeout=3600)
        finally:
            Path(script.name).unlink()
        if done.returncode != 0:
            raise RuntimeError(f"festival failed (exit {done.returncode}): {done.stderr[-500:]}")
        for index, _ in missing:
            files = paths[index]
            wave = ["-ow", str(files["hts.wav"])] if audio else []
            subprocess.run([engine, "-m", str(VOICE_FILE), "-vp", "-b", "0.0", "-u", "0.5", "-om", str(files["mcp"]),
                            "-of", str(files["lf0"]), *wave, str(files["lab"])],
                           check=True, capture_output=True, timeout=600)
    return paths


def teacher_log_amplitude(mcep: np.ndarray, frequencies: np.ndarray) -> np.ndarray:
    """[frames, len(frequencies)]: the natural log amplitude of the teacher's filter (its
    mel-cepstra, [frames, 45]) at ``frequencies`` in Hz, in [-1, 1] sample units."""
    w = 2 * np.pi * np.asarray(frequencies) / TEACHER_RATE
    warped = w + 2 * np.arctan(TEACHER_ALPHA * np.sin(w) / (1 - TEACHER_ALPHA * np.cos(w)))
    return mcep @ np.cos(np.outer(warped, np.arange(mcep.shape[1]))).T - np.log(SAMPLE_SCALE)


def frame_parameters(mcep: np.ndarray, lf0: np.ndarray, frame_ms: int = 20) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(cepstrum c0..c_order, band aperiodicities in dB, F0 in Hz, 0 unvoiced) per ``frame_ms``
    frame, from the teacher's 5 ms parameters (each frame takes the step at its centre), in the
    codec's analysis form (mcep_codec.Analyzer) at 16 kHz."""
    from recipes.builtin_voice.mcep_codec import RATE, Analyzer

    analyzer = Analyzer()
    step = frame_ms // TEACHER_PERIOD_MS
    index = np.arange(step // 2, len(mcep), step)
    frequencies = np.linspace(0, RATE / 2, analyzer.fft // 2 + 1)
    # The teacher's white excitation at 32 kHz has half its power below 8 kHz: what a 16 kHz
    # recording of it keeps.
    log_amplitude = teacher_log_amplitude(mcep[index], frequencies) + 0.5 * np.log(0.5)
    f0 = np.where(lf0[index] > UNVOICED, np.exp(np.minimum(lf0[index], 10.0)), 0.0)
    return log_amplitude @ analyzer.projection.T, np.full((len(index), analyzer.bands), PERIODIC_DB), f0


def read_parameters(files: dict[str, Path]) -> tuple[np.ndarray, np.ndarray]:
    """hts_engine's (mel-cepstra [steps, 45], log F0 [steps]) for one utterance."""
    mcep = np.fromfile(files["mcp"], dtype=np.float32).reshape(-1, TEACHER_ORDER).astype(np.float64)
    return mcep, np.fromfile(files["lf0"], dtype=np.float32).astype(np.float64)


def exact_synthesis(cepstrum: np.ndarray, bands: np.ndarray, f0: np.ndarray, frame_ms: int = 20) -> np.ndarray:
    """The mcep decoder's audio of frame parameters with no quantization: the frames themselves as
    the codebook, F0 and gain in 1,024 levels over the utterance's own range."""
    import torch

    from audio_pipeline.decoders.mcep import DEFAULT_CONFIG, MCEPDecoder

    levels = 1024
    voiced = f0 > 0
    gain_range = [float(cepstrum[:, 0].min()) - 1e-6, float(cepstrum[:, 0].max()) + 1e-6]
    log_f0 = np.log(f0[voiced]) if voiced.any() else np.zeros(1)
    f0_range = [float(log_f0.min()) - 1e-6, float(log_f0.max()) + 1e-6]
    config = {**DEFAULT_CONFIG, "hop": 16 * frame_ms, "f0_levels": levels, "gain_levels": levels,
              "gain_range": gain_range, "log_f0_range": f0_range}
    decoder = MCEPDecoder(config, np.concatenate([cepstrum[:, 1:], bands], 1))

    def level(values, bounds):
        return np.clip(np.round((values - bounds[0]) / (bounds[1] - bounds[0]) * (levels - 1)), 0, levels - 1)

    f0_code = np.where(voiced, 1 + level(np.log(np.where(voiced, f0, 1.0)), f0_range), 0).astype(np.int64)
    frames = np.zeros((len(f0), 4), dtype=np.int64)
    frames[:, 2] = np.arange(len(f0))
    frames[:, 3] = f0_code * levels + level(cepstrum[:, 0], gain_range).astype(np.int64)
    return decoder.decode(torch.from_numpy(frames.reshape(-1))).numpy()


def equalization(utterances: list[dict[str, Path]]) -> np.ndarray:
    """[order]: the mean of WORLD's mel-cepstrum (c1..) of the teacher's audio minus that of the
    mcep decoder's audio from the same parameters (20 ms frames, unquantized; the same timing, so
    frame by frame), over each utterance's loud frames (within 5 nepers of its loudest)."""
    import soundfile as sf

    from audio_pipeline.decoders.mcep import DEFAULT_CONFIG
    from recipes.builtin_voice.distortion import cepstra

    differences = []
    for files in utterances:
        samples, rate = sf.read(files["wav"])
        teacher = cepstra(samples, rate)
        parameters = frame_parameters(*read_parameters(files))
        decoded = cepstra(exact_synthesis(*parameters), 16000)
        frames = min(len(teacher), len(decoded))
        teacher, decoded = teacher[:frames], decoded[:frames]
        loud = teacher[:, 0] > teacher[:, 0].max() - 5
        differences.append(teacher[loud] - decoded[loud])
    return np.concatenate(differences).mean(0)[1:int(DEFAULT_CONFIG["order"]) + 1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    evaluate_command = commands.add_parser(
        "evaluate", help="intelligibility of the teacher, of hts_engine's regeneration of it, and of the mcep "
                         "decoder on the teacher's own parameters (unquantized) at 20 and 5 ms frames")
    evaluate_command.add_argument("--split", default="validation", choices=["held-out", "validation", "test"])
    evaluate_command.add_argument("--count", type=int, default=60)
    evaluate_command.add_argument("--work", help="where the files go (default /tmp/teacher-parameters/SPLIT)")
    evaluate_command.add_argument("--decoder", action="append", default=[],
                                  help="also the round trip through this codec (a directory written by fit): the "
                                       "teacher's parameters quantized, then decoded (repeatable: one line each)")
    fit_command = commands.add_parser("fit", help="fit the codec's codebook and levels on the teacher's parameters "
                                                  "of training-split texts")
    fit_command.add_argument("--count", type=int, default=400, help="training-split utterances to fit on")
    fit_command.add_argument("--size", type=int, default=1024, help="codebook entries")
    fit_command.add_argument("--work", default="/tmp/teacher-parameters/train", help="where the files go")
    fit_command.add_argument("--out", required=True, help="the decoder directory to write")
    equalize_command = commands.add_parser(
        "equalize", help="measure the mean difference between WORLD's mel-cepstrum of the teacher's audio and of "
                         "the mcep decoder's audio from the same parameters (training-split texts), and write it as "
                         "the decoder directory's envelope_offset")
    equalize_command.add_argument("--decoder", required=True, help="the decoder directory (written by fit) to update")
    equalize_command.add_argument("--count", type=int, default=30, help="training-split utterances to measure on")
    equalize_command.add_argument("--work", default="/tmp/teacher-parameters/train", help="where the files go")
    args = parser.parse_args(argv)

    from recipes.builtin_voice.mcep_codec import Quantizer

    if args.command == "equalize":
        from audio_pipeline.text.normalize import normalize
        from recipes.builtin_voice.corpus import v4_corpus

        texts = [normalize(text).spoken for text, split in v4_corpus() if split == "train"][:args.count]
        paths = generate(list(enumerate(texts)), Path(args.work))
        offset = equalization([paths[index] for index in range(len(texts))])
        config_path = Path(args.decoder) / "config.json"
        config = json.loads(config_path.read_text())
        config["envelope_offset"] = [float(v) for v in offset]
        config_path.write_text(json.dumps(config, indent=2))
        print(f"envelope_offset from {len(texts)} utterances, c1..c8 {np.round(offset[:8], 3).tolist()} -> {config_path}")
        return 0

    if args.command == "fit":
        import time

        from audio_pipeline.text.normalize import normalize
        from recipes.builtin_voice.corpus import v4_corpus

        started = time.monotonic()
        texts = [normalize(text).spoken for text, split in v4_corpus() if split == "train"][:args.count]
        paths = generate(list(enumerate(texts)), Path(args.work))
        analyses = [frame_parameters(*read_parameters(paths[index])) for index in range(len(texts))]
        Quantizer.fit(analyses, args.size).save(args.out)
        print(f"fitted on {len(texts)} utterances ({sum(len(f) for _, _, f in analyses)} frames) in "
              f"{time.monotonic() - started:.0f} s -> {args.out}")
        return 0

    import soundfile as sf

    from recipes.builtin_voice.corpus import evaluation_texts
    from recipes.builtin_voice.evaluate import evaluate

    texts = evaluation_texts(args.split, args.count)
    paths = generate(list(enumerate(texts)), Path(args.work or f"/tmp/teacher-parameters/{args.split}"))
    index_of = {text: index for index, text in enumerate(texts)}

    def recorded(kind):
        def synthesize(text):
            samples, rate = sf.read(paths[index_of[text]][kind])
            return samples.astype(np.float32), rate
        return synthesize

    def decoded(frame_ms):
        def synthesize(text):
            parameters = frame_parameters(*read_parameters(paths[index_of[text]]), frame_ms)
            return exact_synthesis(*parameters, frame_ms), 16000
        return synthesize

    runs = [("teacher (Festival)", recorded("wav")),
            ("teacher's parameters through hts_engine", recorded("hts.wav")),
            ("teacher's parameters, mcep decoder, 20 ms frames, unquantized", decoded(20)),
            ("teacher's parameters, mcep decoder, 5 ms frames, unquantized", decoded(5))]
    from audio_pipeline.decoders import load_audio_decoder
    from recipes.builtin_voice.mcep_codec import coded_frames

    def quantized(directory):
        decoder, quantizer = load_audio_decoder("mcep", directory), Quantizer.load(directory)

        def synthesize(text):
            parameters = frame_parameters(*read_parameters(paths[index_of[text]]))
            return decoder.decode(coded_frames(quantizer, parameters)).numpy(), decoder.sample_rate
        return synthesize

    runs += [(f"codec round trip (teacher's parameters quantized by {directory}, mcep decoder)", quantized(directory))
             for directory in args.decoder]
    for label, synthesize in runs:
        with tempfile.NamedTemporaryFile(suffix=".jsgf") as grammar:
            result = evaluate(texts, synthesize, grammar.name)
        print(f"{label}: closed set {result['identified']}/{result['sentences']}, WER {100 * result['wer']:.1f} %",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
