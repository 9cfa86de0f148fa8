"""The optional `audio_pipeline.json` beside a model: its family, voices and audio decoder."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from audio_pipeline.layouts import orpheus
from audio_pipeline.layouts.voice_info import VoiceInfo

MANIFEST_NAME = "audio_pipeline.json"
#: Model families (``family`` in the manifest) the engine has a speech-token layout for.
FAMILIES = ("orpheus", "maya1", "phoneme-lpc", "phoneme-lpc-frame", "neutts", "csm")
#: Text front ends a phoneme-lpc(-frame) model may name (``front_end``).
FRONT_ENDS = ("espeak", "lexicon")
#: Streaming settings a manifest may name (``streaming``), used where the configuration sets none.
STREAMING_KEYS = ("chunk_size", "buffer", "block_causal", "prepend_prompt_speech_tokens")
#: Streaming defaults of families whose manifest names none. SNAC decodes 28 tokens (4 frames)
#: first for early audio, then larger chunks that cost less per token. NeuCodec is not causal:
#: every chunk is decoded after a second of left context (50 frames), the voice's reference codes
#: where the speech has less (rolling), from 15 frames (0.3 s) first, then 25 and 50; the chunk's
#: last frames are decoded without the frames after them, where streamed audio differs most from
#: the whole utterance decoded at once.
FAMILY_STREAMING = {"orpheus": {"chunk_size": [28, 56, 112]}, "maya1": {"chunk_size": [28, 56, 112]},
                    "neutts": {"chunk_size": [15, 25, 50], "buffer": 50, "prepend_prompt_speech_tokens": "rolling"},
                    # Mimi is causal and keeps its streaming state: each chunk's frames are decoded as
                    # they come (block-causal), the first after 2 frames (160 ms of audio), then 4, 8.
                    # Counted in codes: 32 per frame for CSM-1B.
                    "csm": {"chunk_size": [64, 128, 256], "block_causal": True}}
#: The audio decoder of families whose checkpoint carries its own, and where its weights are
#: (relative to the model directory): CSM's Mimi codec is in the checkpoint (``codec_model.*``).
FAMILY_DECODERS = {"csm": ("mimi", ".")}
#: Sampling defaults of families whose reference implementation samples otherwise than the
#: configuration's defaults: NeuTTS draws from the 50 most likely codes at temperature 1, with
#: no nucleus and no repetition penalty; CSM as below.
FAMILY_SAMPLING = {"neutts": {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0},
                   # Sesame's generator: temperature 0.9 over the 50 likeliest codes, backbone and depth
                   # decoder alike (here each request's settings act on both).
                   "csm": {"temperature": 0.9, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0}}


@dataclass(frozen=True)
class ModelManifest:
    """What the engine needs to know about a model beyond its Hugging Face files."""

    family: str = "orpheus"
    description: str = ""
    voices: tuple[VoiceInfo, ...] = field(default_factory=tuple)
    default_voice: str | None = None
    audio_decoder: str | None = None
    #: Decoder weights, relative to the model directory.
    audio_decoder_weights: str | None = None
    #: Streaming defaults for this model (chunk_size, buffer, block_causal); the configuration wins.
    streaming: dict = field(default_factory=dict)
    #: The phoneme-lpc family's text front end: "espeak" (eSpeak NG's phonemes and durations) or
    #: "lexicon" (the model directory's lexicon.txt.gz and prosody.json).
    front_end: str = "espeak"
    #: The directory holds no language model checkpoint: its weights are drawn at load (a random
    #: model of a real shape, for benchmarks; testing/random_models.py).
    random_weights: bool = False

    @classmethod
    def read(cls, model_dir: Path) -> "ModelManifest":
        """The manifest of ``model_dir``; Orpheus defaults (its preset voices) when there is none."""
        path = model_dir / MANIFEST_NAME
        if not path.is_file():
            if detected_family(model_dir) == "csm":
                from audio_pipeline.layouts.csm import DEFAULT_SPEAKERS

                decoder, weights = FAMILY_DECODERS["csm"]
                return cls(family="csm", voices=tuple(VoiceInfo(v, f"CSM speaker {v}") for v in DEFAULT_SPEAKERS),
                           default_voice=DEFAULT_SPEAKERS[0], audio_decoder=decoder, audio_decoder_weights=weights)
            if detected_family(model_dir) == "maya1":
                from audio_pipeline.layouts.maya1 import PRESET_VOICES

                return cls(family="maya1", voices=PRESET_VOICES, default_voice=PRESET_VOICES[0].name)
            return cls(voices=tuple(VoiceInfo(v, f"Orpheus preset voice {v}") for v in orpheus.ORPHEUS_VOICES),
                       default_voice=orpheus.ORPHEUS_VOICES[0])
        try:
            data = json.loads(path.read_text())
            voices = tuple(VoiceInfo(**v) for v in data.pop("voices", []))
            manifest = cls(voices=voices, **data)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path}: invalid model manifest: {exc}") from exc
        unknown = set(manifest.streaming) - set(STREAMING_KEYS)
        if unknown:
            raise ValueError(f"{path}: unknown streaming settings {sorted(unknown)} "
                             f"(known: {', '.join(STREAMING_KEYS)})")
        if manifest.front_end not in FRONT_ENDS:
            raise ValueError(f"{path}: unknown front_end {manifest.front_end!r} (known: {', '.join(FRONT_ENDS)})")
        if manifest.family not in FAMILIES:
            raise ValueError(f"{path}: unsupported model family {manifest.family!r} (supported: {', '.join(FAMILIES)})")
        names = [v.name for v in manifest.voices]
        if manifest.default_voice is not None and manifest.default_voice not in names:
            raise ValueError(f"{path}: default_voice {manifest.default_voice!r} is not one of its voices {names}")
        return manifest

    def make_layout(self, model_dir: Path, tokenizer=None) -> "orpheus.OrpheusLayout":
        """The speech-token layout of this model's family (prompt format, token ids <-> codes);
        ``tokenizer`` is the model's own (read from ``model_dir`` where a family needs it and none
        is given).

        A layout provides: ``tokens_per_frame``, ``codebook_size``, ``end_of_speech``,
        ``min_vocab_size``, ``token_range(position)``, ``token_to_code``, ``tokens_to_codes``,
        ``codes_to_tokens`` and ``build_prompt(tokenizer, text, voice)``. It may also provide
        ``requires_reference`` (every request speaks as a reference recording) and
        ``check_decoder(decoder)`` (ValueError for a decoder that does not speak its codes).
        """
        if self.family == "neutts":
            from audio_pipeline.layouts.neutts import NeuTTSLayout

            if tokenizer is None:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(model_dir)
            return NeuTTSLayout.from_tokenizer(tokenizer, model_dir)
        if self.family == "csm":
            from transformers import AutoConfig, AutoTokenizer

            from audio_pipeline.layouts.csm import CsmLayout

            return CsmLayout.from_config(tokenizer or AutoTokenizer.from_pretrained(model_dir),
                                         AutoConfig.from_pretrained(model_dir))
        if self.family == "maya1":
            from audio_pipeline.layouts.maya1 import Maya1Layout

            return Maya1Layout()
        if self.family in ("phoneme-lpc", "phoneme-lpc-frame"):
            from audio_pipeline.layouts.phoneme_lpc import PhonemeLPCLayout
            from audio_pipeline.layouts.phoneme_lpc_frame import PhonemeLPCFrameLayout

            layout = PhonemeLPCFrameLayout if self.family == "phoneme-lpc-frame" else PhonemeLPCLayout
            if self.front_end == "lexicon":
                from audio_pipeline.text.lexicon import LexiconFrontEnd

                return layout(front_end=LexiconFrontEnd.load(model_dir))
            return layout()
        return orpheus.OrpheusLayout()


def detected_family(model_dir: Path) -> str:
    """The family of a checkpoint that comes without a manifest: CSM where its config.json's
    ``model_type`` is ``csm``; Maya1 where its config.json names a Maya1 checkpoint
    (``_name_or_path``, as transformers writes it) or its directory is named so; else Orpheus."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    if isinstance(config, dict) and config.get("model_type") == "csm":
        return "csm"
    names = [str(config.get("_name_or_path", "")) if isinstance(config, dict) else "", Path(model_dir).name]
    return "maya1" if any("maya1" in name.lower() for name in names) else "orpheus"


def _declared(model_path: str) -> dict:
    """The manifest of the model at ``model_path`` (a directory or ``builtin:NAME``) as written, read
    without loading or writing anything; {} when there is none or it cannot be read (the engine
    reports that properly when it loads the model)."""
    if model_path.startswith("builtin:"):
        from audio_pipeline.builtin import SHIPPED_MODELS, shipped_model_dir

        name = model_path.removeprefix("builtin:")
        if name not in SHIPPED_MODELS:  # the test models written on first use are Orpheus-layout
            return {}
        try:
            directory = shipped_model_dir(name)
        except FileNotFoundError:
            return {}
    else:
        directory = Path(model_path).expanduser()
    try:
        data = json.loads((directory / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def declared_audio_decoder(model_path: str) -> str | None:
    """The audio decoder named by the manifest of the model at ``model_path``, or None."""
    decoder = _declared(model_path).get("audio_decoder")
    if isinstance(decoder, str) and decoder:
        return decoder
    family = declared_family(model_path)
    return FAMILY_DECODERS[family][0] if family in FAMILY_DECODERS else None


def declared_family(model_path: str) -> str:
    """The family of the model at ``model_path``: its manifest's, else what its files say."""
    family = _declared(model_path).get("family")
    if isinstance(family, str) and family:
        return family
    return detected_family(Path(model_path).expanduser()) if not model_path.startswith("builtin:") else "orpheus"


def declared_sampling(model_path: str) -> dict:
    """The sampling defaults of the model at ``model_path``: its family's, else none."""
    return dict(FAMILY_SAMPLING.get(declared_family(model_path), {}))


def declared_streaming(model_path: str) -> dict:
    """The streaming defaults of the model at ``model_path``: its manifest's ``streaming``, else
    its family's (Orpheus-layout models stream from 28 tokens), else none."""
    data = _declared(model_path)
    streaming = data.get("streaming")
    if isinstance(streaming, dict):
        return {k: v for k, v in streaming.items() if k in STREAMING_KEYS}
    return dict(FAMILY_STREAMING.get(declared_family(model_path), {}))
