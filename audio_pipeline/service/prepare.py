"""Request preparation: a request's text, voice, reference and settings checked once against the
model, and the context of each piece of its text built for the engine, which then only admits and
runs it. The speech service prepares every request here; in-process use (``TTSEngine.create_context``)
goes through the same code. Each check is written once, here."""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from audio_pipeline.core.request import TTSContext
from audio_pipeline.core.sampling_params import SamplingParams
from audio_pipeline.errors import InvalidArgument, NotFound, echo
from audio_pipeline.text.ipa import ipa_units
from audio_pipeline.text.lexicon import Overrides
from audio_pipeline.text.normalize import NormalizedText, normalize
from audio_pipeline.text.pronunciations import Lexicon, respell
from audio_pipeline.text.ssml import is_ssml
from audio_pipeline.text.timings import word_timings
from audio_pipeline.service.voices import VoicePrompt, check_reference_size, check_transcript, read_reference_audio

if TYPE_CHECKING:
    import numpy as np
    import torch

    from audio_pipeline.config import AudioGenerationConfig
    from audio_pipeline.core.assembly import CoreFacts
    from audio_pipeline.layouts.base import Layout
    from audio_pipeline.layouts.manifest import ModelManifest
    from audio_pipeline.service.voice_catalogue import VoiceCatalogue
    from audio_pipeline.text.languages import SpokenLanguages


class PreparingEngine(Protocol):
    """What preparation reads of the engine it prepares for (service/engine.py's TTSEngine): its
    configuration, layout, tokenizer, the engine core's facts and voices (the voice catalogue)."""

    config: "AudioGenerationConfig"
    manifest: "ModelManifest"
    layout: "Layout"
    tokenizer: Any
    facts: "CoreFacts"
    languages: "SpokenLanguages"
    sampling_defaults: SamplingParams
    voice_catalogue: "VoiceCatalogue"

    @property
    def sample_rate(self) -> int: ...

    @property
    def samples_per_frame(self) -> int: ...

    @property
    def max_seq_len(self) -> int: ...

    def encode(self, samples: "np.ndarray") -> "torch.Tensor": ...

    def speaker_embedding(self, samples: "np.ndarray") -> "torch.Tensor | None": ...


#: The range of a request's speed (OpenAI's).
MIN_SPEED, MAX_SPEED = 0.25, 4.0


@dataclass(frozen=True)
class RequestSettings:
    """A request's settings, checked once against the model, for each segment of its text."""

    #: The preset voice (None with a reference recording or a registered voice's prompt).
    voice: str | None
    reference: VoicePrompt | None
    normalize_text: bool
    #: The speed the model speaks at (1.0 where the stream is time-stretched instead).
    speed: float
    sampling: SamplingParams
    #: max_tokens was asked for (else a layout that knows the speech's length fits it to the text).
    explicit_max_tokens: bool
    #: A style beside the voice, for a layout that takes_instructions (else None).
    instructions: str | None = None
    #: The language asked for, as the model declares it (engine.languages), or "auto"; None: not
    #: asked (the model's setting). A layout that takes_language gets it.
    language: str | None = None
    #: Pronunciations (the voice's lexicon with the request's entries over it), worked out once
    #: for every segment: word -> respelling, and (word, the voice's units) where the layout
    #: takes_pronunciations.
    respellings: dict = dataclasses.field(default_factory=dict)
    phoneme_units: tuple = ()
    #: A dialogue's other voice, for a layout with ``speaker_turns`` (SSML <voice> names it;
    #: service/segment_voices.py).
    other_voice: str | None = None


class RequestPreparer:
    """Prepares requests for ``engine`` (its configuration, model, layout, tokenizer, decoder and
    voices); holds nothing of its own, so any number may serve one engine."""

    def __init__(self, engine: PreparingEngine):
        self.engine = engine

    def create_context(self, text: str, *, voice: str | None = None, request_id: str | None = None,
                       reference: VoicePrompt | None = None, normalize_text: bool | None = None,
                       speed: float | None = None, instructions: str | None = None, language: str | None = None,
                       pronunciations: Lexicon | None = None, **sampling_overrides: Any) -> TTSContext:
        """A validated context of a whole text (in-process use: the speech service validates a
        request once and builds its segments with :meth:`segment_context`); InvalidArgument or
        NotFound naming the field otherwise."""
        self.check_text(text)
        if is_ssml(text):  # its markup would be read out as words here
            raise InvalidArgument("SSML is read by the speech service (the servers, `audio-pipeline synthesize`, "
                                  "SpeechService.open); one context takes plain text", field="text")
        if request_id is not None:
            self.check_request_id(request_id)
        if speed is not None:
            self.check_speed(speed)
        settings = self.resolve_settings(voice=voice, reference=reference, normalize_text=normalize_text,
                                         speed=speed, instructions=instructions, language=language,
                                         pronunciations=pronunciations, **sampling_overrides)
        return self.segment_context(text, settings, request_id or uuid.uuid4().hex)

    def check_request_id(self, value: str, field: str = "request_id") -> None:
        """InvalidArgument naming ``field`` when ``value`` (a request id or a client's label for one)
        is longer than limits.max_request_id_chars."""
        limit = self.engine.config.limits.max_request_id_chars
        if len(value) > limit:
            raise InvalidArgument(f"longer than {limit} characters", field=field)

    def check_text(self, text: str) -> None:
        """InvalidArgument unless ``text`` is a request text this server takes (non-blank, within
        ``sampling.max_text_chars``)."""
        if not text or not text.strip():
            raise InvalidArgument("must not be empty", field="text")
        limit = self.engine.config.sampling.max_text_chars
        if len(text) > limit:
            raise InvalidArgument(f"{len(text)} characters, over the limit of {limit}", field="text")

    @staticmethod
    def check_speed(speed: float) -> None:
        """InvalidArgument naming ``speed`` outside MIN_SPEED..MAX_SPEED."""
        if not MIN_SPEED <= float(speed) <= MAX_SPEED:
            raise InvalidArgument(f"{float(speed):g} is out of range: {MIN_SPEED} to {MAX_SPEED}", field="speed")

    def resolve_settings(self, *, voice: str | None = None, reference: VoicePrompt | None = None,
                         normalize_text: bool | None = None, speed: float | None = None,
                         instructions: str | None = None, language: str | None = None,
                         pronunciations: Lexicon | None = None, **sampling_overrides: Any) -> RequestSettings:
        """A request's settings checked against this model (the voice exists, the language is one
        it speaks, the sampling values and stop ids are valid, it speaks at ``speed``), for every
        segment of its text.
        The speed's range is the caller's to check (:meth:`check_speed`). ``instructions`` describe
        the voice to a model whose voices are descriptions (Maya1); other models ignore them."""
        limits = self.engine.config.limits
        if language:  # one the model speaks, in any usual spelling (text/languages.py), or auto
            if len(language) > limits.max_voice_name_chars:
                raise InvalidArgument(f"{len(language)} characters, over the limit of {limits.max_voice_name_chars}",
                                      field="language")
            language = self.engine.languages.resolve(language)
        if self.engine.layout.described_voices:
            voice = self._voice_description(voice, instructions)
            instructions = None
        elif not self.engine.layout.takes_instructions:
            instructions = None
        elif instructions and len(instructions) > limits.max_description_chars:
            raise InvalidArgument(f"{len(instructions)} characters, over the limit of {limits.max_description_chars} "
                                  "(limits.max_description_chars)", field="instructions")
        elif voice and len(voice) > limits.max_voice_name_chars:
            raise InvalidArgument(f"{len(voice)} characters, over the limit of {limits.max_voice_name_chars}",
                                  field="voice")
        stop_ids = sampling_overrides.get("stop_token_ids") or ()
        if len(stop_ids) > limits.max_stop_token_ids:
            raise InvalidArgument(f"{len(stop_ids)} ids, over the limit of {limits.max_stop_token_ids}",
                                  field="sampling.stop_token_ids")
        vocab = self.engine.facts.vocab_size
        if any(not 0 <= t < vocab for t in stop_ids):
            bad = next(t for t in stop_ids if not 0 <= t < vocab)
            raise InvalidArgument(f"{bad} is not a token id of this model (0 to {vocab - 1})",
                                  field="sampling.stop_token_ids")
        if reference is not None and voice:
            raise InvalidArgument("give either a voice name or a reference recording, not both", field="voice")
        catalogue = self.engine.voice_catalogue
        registered = catalogue.store.get(voice) if voice and catalogue.store is not None else None
        if reference is None and registered:
            reference = registered.prompt
        elif reference is None and not self.engine.layout.described_voices:
            voice = self.engine.layout.preset_name(voice or self.engine.manifest.default_voice)
            names = [v.name for v in catalogue.listed]
            if voice is not None and voice not in names:
                raise NotFound(f"unknown voice {echo(voice)}; available: {', '.join(names)}", field="voice")
            reference = catalogue.preset_prompts.get(voice)
        if reference is None and self.engine.layout.requires_reference:
            raise InvalidArgument("this model speaks only in the voice of a reference recording and has no default "
                                  "voice: give a reference with its transcript, or a registered voice", field="reference")
        sampling = self.engine.sampling_defaults.with_overrides(
            max_tokens_limit=self.engine.config.sampling.max_tokens_limit,
            tokens_per_frame=self.engine.layout.tokens_per_frame, **sampling_overrides)
        speed = 1.0 if speed is None else float(speed)
        if speed != 1.0 and not self.engine.layout.supports_speed:
            raise InvalidArgument("this model speaks at one speed: only 1.0 is supported", field="speed")
        lexicons = self.engine.voice_catalogue.lexicons
        lexicon = lexicons.get("*", Lexicon()).merged(lexicons.get(voice or "", Lexicon())).merged(
            pronunciations or Lexicon())
        return RequestSettings(
            voice=voice, reference=reference, speed=speed, sampling=sampling, respellings=lexicon.respellings(),
            phoneme_units=lexicon.phoneme_units() if self.engine.layout.takes_pronunciations else (),
            normalize_text=self.engine.config.normalize_text if normalize_text is None else normalize_text,
            explicit_max_tokens=sampling_overrides.get("max_tokens") is not None,
            instructions=instructions.strip() or None if instructions else None, language=language or None)

    def check_rates(self, settings: RequestSettings, rates) -> None:
        """InvalidArgument naming ``text`` unless every SSML <prosody> rate (a multiple of the
        request's speed) can be spoken: the model speaks at any speed (else a request's speed
        time-stretches the whole stream), and rate x speed stays within MIN_SPEED..MAX_SPEED.
        Checked up front, before any audio."""
        changed = [rate for rate in rates if rate != 1.0]
        if not changed:
            return
        if not self.engine.layout.supports_speed:
            raise InvalidArgument("SSML <prosody rate>: this model speaks at one speed; a request's speed "
                                  "time-stretches the whole stream instead", field="text")
        for rate in changed:
            if not MIN_SPEED <= settings.speed * rate <= MAX_SPEED:
                raise InvalidArgument(f"SSML <prosody rate> times the request's speed is {settings.speed * rate:g}, "
                                      f"out of range: {MIN_SPEED} to {MAX_SPEED}", field="text")

    def _voice_description(self, voice: str | None, instructions: str | None) -> str:
        """The description a described-voice model speaks with: the instructions where given, else
        the voice (a preset's name stands for its description; any other text is the description),
        else the default voice's."""
        limit = self.engine.config.limits.max_description_chars
        for text, field in ((instructions, "instructions"), (voice, "voice")):
            if text and len(text) > limit:
                raise InvalidArgument(f"{len(text)} characters, over the limit of {limit} "
                                      "(limits.max_description_chars)", field=field)
        presets = {v.name: v.description for v in self.engine.manifest.voices}
        if instructions and instructions.strip():
            return instructions
        chosen = voice or self.engine.manifest.default_voice or ""
        return presets.get(chosen, chosen)

    def segment_context(self, text: str, settings: RequestSettings, request_id: str,
                        stream_id: str | None = None, *, normalized: NormalizedText | None = None,
                        rate: float = 1.0, phonemes: tuple[tuple[int, int, str], ...] = (),
                        continuation: bool = False, speaker: int = 0, after: int | None = None) -> TTSContext:
        """The context of one piece of a request's text (already checked) with its settings; what
        depends on the text (its prompt's length, the speech it needs) is checked here.
        ``stream_id``: the client request the piece belongs to (default: the piece is the request);
        ``continuation``: a later piece of it; ``speaker``: who says it in a dialogue (0 the
        request's voice, 1 ``settings.other_voice``), after words of speaker ``after`` (a text
        stream's piece that joins an engine request already reading words: the speaker of the piece
        before; None: the piece starts an engine request).
        An SSML segment brings its words already read out (``normalized``), its ``rate`` (times the
        request's speed) and its ``<phoneme>`` spans."""
        # Every layout gets words, never "$5" or "9:15"; the spans map them back for word timings.
        if normalized is None:
            normalized = normalize(text) if settings.normalize_text else NormalizedText(text, text)
        layout = self.engine.layout
        normalized, phonemes = respell(normalized, settings.respellings, phonemes)
        speed = settings.speed * rate  # checked with check_rates
        extra = {"instructions": settings.instructions} if layout.takes_instructions else {}
        if layout.takes_language:
            extra["language"] = settings.language
        if layout.speaker_turns:
            extra["other_voice"] = settings.other_voice
        aligned = {}
        if layout.takes_pronunciations and (phonemes or settings.phoneme_units):
            aligned["overrides"] = Overrides(settings.phoneme_units,
                                             tuple((a, b, ipa_units(ipa, field="text")) for a, b, ipa in phonemes))
        prompt = layout.build_prompt(self.engine.tokenizer, normalized.spoken, settings.voice, settings.reference,
                                     speed=speed, **extra, **aligned)
        aligned_words = layout.word_frames(normalized.spoken, speed=speed, **aligned)
        words = (word_timings(normalized, aligned_words, self.engine.samples_per_frame)
                 if aligned_words is not None else None)
        alignment = layout.alignment(prompt)
        sampling = self._fit_budget(alignment, settings.sampling, explicit=settings.explicit_max_tokens)
        if layout.text_stream and not settings.explicit_max_tokens:
            # The text ends the speech (its rule bounds how long its words take): the request may run
            # as long as the model can, and the service starts another before its words could not fit.
            sampling = dataclasses.replace(sampling, max_tokens=(self.engine.max_seq_len - len(prompt))
                                           * layout.tokens_per_frame)
        if not self.engine.config.enable_chunked_prefill and len(prompt) > self.engine.config.max_batch_input_tokens:
            raise InvalidArgument(f"the prompt is {len(prompt)} tokens, over max_batch_input_tokens "
                                  f"({self.engine.config.max_batch_input_tokens}) and enable_chunked_prefill is off", field="text")
        budget = sampling.max_tokens - sampling.max_tokens % self.engine.layout.tokens_per_frame
        if len(prompt) + budget > self.engine.max_seq_len:
            raise InvalidArgument(f"the prompt ({len(prompt)} tokens) plus max_tokens ({budget}) exceeds the "
                                  f"maximum sequence length {self.engine.max_seq_len}", field="text")
        reference = settings.reference
        return TTSContext(request_id=request_id, stream_id=stream_id or request_id, continuation=continuation,
                          prompt_ids=prompt, sampling=sampling,
                          layout=self.engine.layout, voice=settings.voice, alignment=alignment, words=words,
                          prompt_speech_codes=reference.codes if reference is not None else None,
                          prompt_frames=self.engine.layout.prompt_frames(prompt, reference),
                          text_track=layout.text_track(prompt), text_rule=layout.text_rule(normalized.spoken, prompt,
                                                                                speaker=speaker, after=after,
                                                                                written=normalized.source_of))

    def _fit_budget(self, alignment, sampling: SamplingParams, *, explicit: bool) -> SamplingParams:
        """For a layout whose alignment fixes the length of the speech (phoneme-lpc), the request's
        default max_tokens becomes exactly what the text needs; an explicit max_tokens is kept."""
        if alignment is None or explicit:
            return sampling
        needed = alignment.tokens + self.engine.layout.tokens_per_frame  # the speech, then end-of-speech's frame slot
        limit = self.engine.config.sampling.max_tokens_limit
        if needed > limit:
            raise InvalidArgument(f"the text needs {needed} speech tokens, over the server limit "
                                  f"sampling.max_tokens_limit={limit}: split the text", field="text")
        return dataclasses.replace(sampling, max_tokens=needed)

    def reference_prompt(self, audio: bytes, transcript: str) -> VoicePrompt:
        """A one-request voice prompt from a recording and its transcript."""
        self.engine.voice_catalogue.cloning_store()
        check_reference_size(audio, self.engine.config.limits.max_reference_audio_bytes)
        samples = read_reference_audio(audio, self.engine.sample_rate, max_seconds=self.engine.config.max_reference_seconds)
        transcript = check_transcript(transcript, self.engine.config.limits.max_transcript_chars)
        return VoicePrompt(transcript, self.engine.encode(samples), self.engine.speaker_embedding(samples))

