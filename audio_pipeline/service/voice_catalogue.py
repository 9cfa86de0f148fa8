"""The voices one model speaks: its presets (and the reference recordings some of them speak as),
the voices registered by cloning (service/voices.py's store), and the pronunciation lexicons of the
configuration. Encoding a recording needs the model's codec: a call into the engine core."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from audio_pipeline.errors import InvalidArgument, NotFound, echo
from audio_pipeline.layouts.voice_info import VoiceInfo
from audio_pipeline.service.voices import (RegisteredVoice, VoicePrompt, VoiceStore, check_reference_size,
                                           check_transcript, codes_file, read_reference_audio, read_voice_entry)

if TYPE_CHECKING:
    from audio_pipeline.config import AudioGenerationConfig
    from audio_pipeline.core.assembly import CoreFacts
    from audio_pipeline.layouts.base import Layout
    from audio_pipeline.layouts.manifest import ModelManifest

logger = logging.getLogger(__name__)


class CataloguedEngine(Protocol):
    """What the catalogue reads of its engine (service/engine.py's TTSEngine)."""

    config: "AudioGenerationConfig"
    manifest: "ModelManifest"
    model_dir: Path
    layout: "Layout"
    facts: "CoreFacts"
    decoder_name: str
    backend: Any
    sample_rate: int

    def encode(self, samples: Any) -> Any: ...

    def speaker_embedding(self, samples: Any) -> Any: ...


class VoiceCatalogue:
    """The voices of ``engine``'s model, read at start-up (a preset's reference, the registered
    voices' folder, the pronunciations file); ValueError naming what is wrong."""

    def __init__(self, engine: CataloguedEngine):
        self.engine = engine
        self.config = engine.config
        #: The registered voices (None when the decoder cannot encode audio, so no cloning).
        self.store = self._open_store()
        #: Pronunciation lexicons by voice name ("*": every voice), from the configuration's file.
        self.lexicons = self._lexicons()
        #: Preset voices spoken as a clone of a reference the model directory ships.
        self.preset_prompts = self._preset_prompts()

    def _lexicons(self) -> dict:
        from audio_pipeline.text.pronunciations import load_voice_lexicons

        if not self.config.pronunciations:
            return {}
        try:
            lexicons = load_voice_lexicons(self.config.pronunciations)
        except OSError as error:
            raise ValueError(f"pronunciations: {error}") from None
        except InvalidArgument as error:  # it names the file and the entry already
            raise ValueError(str(error)) from None
        logger.info("pronunciations from %s: %s", self.config.pronunciations,
                    ", ".join(f"{voice} ({len(lexicon.entries)} words)" for voice, lexicon in lexicons.items()))
        return lexicons

    def _open_store(self) -> VoiceStore | None:
        engine = self.engine
        if not engine.facts.supports_encoding:
            return None
        from audio_pipeline.builtin import builtin_cache_dir

        directory = Path(self.config.voices_dir) if self.config.voices_dir else builtin_cache_dir() / "voices"
        speaker = engine.speaker_embedding if engine.facts.speaker_sample_rate is not None else None
        store = VoiceStore(directory, engine.decoder_name, engine.sample_rate, engine.encode, speaker)
        skipped = store.load()
        if skipped:
            logger.warning("skipped unreadable registered voices in %s: %s", directory, ", ".join(skipped))
        return store

    def _preset_prompts(self) -> dict[str, VoicePrompt]:
        """The voice prompts of the preset voices whose reference the model directory ships, in
        ``voices/NAME/`` as registered voices are kept (voice.json's transcript, the decoder's
        codes or reference.flac). A layout that speaks only as a reference needs one for each preset
        voice: ValueError naming the voice otherwise."""
        engine = self.engine
        prompts = {}
        encode = engine.encode if self.store is not None else None  # the decoder can encode
        for voice in engine.manifest.voices:
            entry = engine.model_dir / "voices" / voice.name
            if (entry / "voice.json").is_file():
                meta, codes, _ = read_voice_entry(entry, engine.decoder_name, engine.sample_rate, encode)
                try:
                    engine.backend.check_codes(codes)
                except ValueError as exc:
                    raise ValueError(f"{entry}: the reference's codes: {exc}") from None
                speaker = self.store.speaker_of(entry) if self.store is not None else None
                prompts[voice.name] = VoicePrompt(meta["transcript"], codes, speaker)
            elif engine.layout.requires_reference:
                raise ValueError(f"model.model_path: preset voice {voice.name!r} of the {engine.manifest.family} "
                                 f"model needs its reference: {entry}/voice.json with the transcript, and "
                                 f"{codes_file(engine.decoder_name)} or reference.flac")
        return prompts

    @property
    def listed(self) -> list[VoiceInfo]:
        """Preset voices (default first), then registered ones."""
        manifest = self.engine.manifest
        presets = sorted(manifest.voices, key=lambda v: v.name != manifest.default_voice)
        return presets + [VoiceInfo(v.name, v.description, v.language) for v in self.registered()]

    def registered(self) -> list[RegisteredVoice]:
        return self.store.voices() if self.store is not None else []

    def register(self, name: str, audio: bytes, transcript: str, description: str = "") -> RegisteredVoice:
        """Clones a voice from a recording and its transcript and keeps it under ``name``.

        The cheap checks (sizes, name, a full store: config.limits) come before the recording is decoded.
        """
        store = self.cloning_store()
        limits = self.config.limits
        reserved = {v.name for v in self.engine.manifest.voices}
        check_reference_size(audio, limits.max_reference_audio_bytes)
        store.check_new(name, description, reserved, limits)
        samples = read_reference_audio(audio, self.engine.sample_rate, max_seconds=self.config.max_reference_seconds)
        transcript = check_transcript(transcript, limits.max_transcript_chars)
        return store.register(name, samples, transcript, description, reserved=reserved, limits=limits)

    def delete(self, name: str) -> None:
        if len(name) > self.config.limits.max_voice_name_chars:  # longer than any voice name: no lookup
            raise NotFound(f"no registered voice named {echo(name)}", field="name")
        if name in {v.name for v in self.engine.manifest.voices}:
            raise InvalidArgument(f"{echo(name)} is a preset voice of the model and cannot be deleted", field="name")
        self.cloning_store().delete(name)

    @property
    def can_clone(self) -> bool:
        """Whether a reference recording can give a voice here: the decoder encodes audio and the
        layout speaks as a reference (the built-in voices do not)."""
        return self.store is not None and self.engine.layout.clonable

    def cloning_store(self) -> VoiceStore:
        """The voice store; InvalidArgument naming ``reference`` when the decoder cannot encode audio."""
        if self.store is None:
            raise InvalidArgument("this server cannot clone voices: its model's audio codec cannot encode a "
                                  "recording", field="reference")
        return self.store
