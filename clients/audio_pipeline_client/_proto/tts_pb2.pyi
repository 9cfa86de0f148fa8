from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AudioEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AUDIO_ENCODING_UNSPECIFIED: _ClassVar[AudioEncoding]
    AUDIO_ENCODING_PCM16: _ClassVar[AudioEncoding]
    AUDIO_ENCODING_FLOAT32: _ClassVar[AudioEncoding]
    AUDIO_ENCODING_WAV: _ClassVar[AudioEncoding]
    AUDIO_ENCODING_MP3: _ClassVar[AudioEncoding]
    AUDIO_ENCODING_OPUS: _ClassVar[AudioEncoding]
    AUDIO_ENCODING_AAC: _ClassVar[AudioEncoding]
    AUDIO_ENCODING_FLAC: _ClassVar[AudioEncoding]
    AUDIO_ENCODING_MULAW: _ClassVar[AudioEncoding]
    AUDIO_ENCODING_ALAW: _ClassVar[AudioEncoding]

class TimingPrecision(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIMING_PRECISION_UNSPECIFIED: _ClassVar[TimingPrecision]
    TIMING_PRECISION_WORD: _ClassVar[TimingPrecision]
    TIMING_PRECISION_SEGMENT: _ClassVar[TimingPrecision]

class StopReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STOP_REASON_UNSPECIFIED: _ClassVar[StopReason]
    STOP_REASON_END_OF_SPEECH: _ClassVar[StopReason]
    STOP_REASON_MAX_TOKENS: _ClassVar[StopReason]
AUDIO_ENCODING_UNSPECIFIED: AudioEncoding
AUDIO_ENCODING_PCM16: AudioEncoding
AUDIO_ENCODING_FLOAT32: AudioEncoding
AUDIO_ENCODING_WAV: AudioEncoding
AUDIO_ENCODING_MP3: AudioEncoding
AUDIO_ENCODING_OPUS: AudioEncoding
AUDIO_ENCODING_AAC: AudioEncoding
AUDIO_ENCODING_FLAC: AudioEncoding
AUDIO_ENCODING_MULAW: AudioEncoding
AUDIO_ENCODING_ALAW: AudioEncoding
TIMING_PRECISION_UNSPECIFIED: TimingPrecision
TIMING_PRECISION_WORD: TimingPrecision
TIMING_PRECISION_SEGMENT: TimingPrecision
STOP_REASON_UNSPECIFIED: StopReason
STOP_REASON_END_OF_SPEECH: StopReason
STOP_REASON_MAX_TOKENS: StopReason

class VoiceReference(_message.Message):
    __slots__ = ("audio", "transcript")
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    TRANSCRIPT_FIELD_NUMBER: _ClassVar[int]
    audio: bytes
    transcript: str
    def __init__(self, audio: _Optional[bytes] = ..., transcript: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "repetition_penalty", "max_tokens", "min_tokens", "seed", "min_p", "frequency_penalty", "presence_penalty", "stop_token_ids")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float
    max_tokens: int
    min_tokens: int
    seed: int
    min_p: float
    frequency_penalty: float
    presence_penalty: float
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., min_p: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SynthesizeRequest(_message.Message):
    __slots__ = ("text", "voice", "sampling", "encoding", "sample_rate", "request_id", "reference", "normalize_text", "speed", "language", "instructions", "ssml", "pronunciations")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    VOICE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_TEXT_FIELD_NUMBER: _ClassVar[int]
    SPEED_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTIONS_FIELD_NUMBER: _ClassVar[int]
    SSML_FIELD_NUMBER: _ClassVar[int]
    PRONUNCIATIONS_FIELD_NUMBER: _ClassVar[int]
    text: str
    voice: str
    sampling: SamplingParams
    encoding: AudioEncoding
    sample_rate: int
    request_id: str
    reference: VoiceReference
    normalize_text: bool
    speed: float
    language: str
    instructions: str
    ssml: bool
    pronunciations: _containers.RepeatedCompositeFieldContainer[Pronunciation]
    def __init__(self, text: _Optional[str] = ..., voice: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., encoding: _Optional[_Union[AudioEncoding, str]] = ..., sample_rate: _Optional[int] = ..., request_id: _Optional[str] = ..., reference: _Optional[_Union[VoiceReference, _Mapping]] = ..., normalize_text: _Optional[bool] = ..., speed: _Optional[float] = ..., language: _Optional[str] = ..., instructions: _Optional[str] = ..., ssml: _Optional[bool] = ..., pronunciations: _Optional[_Iterable[_Union[Pronunciation, _Mapping]]] = ...) -> None: ...

class Pronunciation(_message.Message):
    __slots__ = ("word", "phonemes", "respelling")
    WORD_FIELD_NUMBER: _ClassVar[int]
    PHONEMES_FIELD_NUMBER: _ClassVar[int]
    RESPELLING_FIELD_NUMBER: _ClassVar[int]
    word: str
    phonemes: str
    respelling: str
    def __init__(self, word: _Optional[str] = ..., phonemes: _Optional[str] = ..., respelling: _Optional[str] = ...) -> None: ...

class StreamSettings(_message.Message):
    __slots__ = ("voice", "sampling", "encoding", "sample_rate", "request_id", "normalize_text", "speed", "language", "instructions", "pronunciations")
    VOICE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_TEXT_FIELD_NUMBER: _ClassVar[int]
    SPEED_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTIONS_FIELD_NUMBER: _ClassVar[int]
    PRONUNCIATIONS_FIELD_NUMBER: _ClassVar[int]
    voice: str
    sampling: SamplingParams
    encoding: AudioEncoding
    sample_rate: int
    request_id: str
    normalize_text: bool
    speed: float
    language: str
    instructions: str
    pronunciations: _containers.RepeatedCompositeFieldContainer[Pronunciation]
    def __init__(self, voice: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., encoding: _Optional[_Union[AudioEncoding, str]] = ..., sample_rate: _Optional[int] = ..., request_id: _Optional[str] = ..., normalize_text: _Optional[bool] = ..., speed: _Optional[float] = ..., language: _Optional[str] = ..., instructions: _Optional[str] = ..., pronunciations: _Optional[_Iterable[_Union[Pronunciation, _Mapping]]] = ...) -> None: ...

class Flush(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EndOfInput(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TextInput(_message.Message):
    __slots__ = ("settings", "text", "flush", "end_of_input")
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FLUSH_FIELD_NUMBER: _ClassVar[int]
    END_OF_INPUT_FIELD_NUMBER: _ClassVar[int]
    settings: StreamSettings
    text: str
    flush: Flush
    end_of_input: EndOfInput
    def __init__(self, settings: _Optional[_Union[StreamSettings, _Mapping]] = ..., text: _Optional[str] = ..., flush: _Optional[_Union[Flush, _Mapping]] = ..., end_of_input: _Optional[_Union[EndOfInput, _Mapping]] = ...) -> None: ...

class AudioFormat(_message.Message):
    __slots__ = ("sample_rate", "encoding", "channels")
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    sample_rate: int
    encoding: AudioEncoding
    channels: int
    def __init__(self, sample_rate: _Optional[int] = ..., encoding: _Optional[_Union[AudioEncoding, str]] = ..., channels: _Optional[int] = ...) -> None: ...

class AudioFrames(_message.Message):
    __slots__ = ("data", "chunk_index", "num_samples", "words")
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    WORDS_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    chunk_index: int
    num_samples: int
    words: _containers.RepeatedCompositeFieldContainer[WordTiming]
    def __init__(self, data: _Optional[bytes] = ..., chunk_index: _Optional[int] = ..., num_samples: _Optional[int] = ..., words: _Optional[_Iterable[_Union[WordTiming, _Mapping]]] = ...) -> None: ...

class WordTiming(_message.Message):
    __slots__ = ("text", "text_start", "text_end", "start_sample", "end_sample", "spoken", "precision")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TEXT_START_FIELD_NUMBER: _ClassVar[int]
    TEXT_END_FIELD_NUMBER: _ClassVar[int]
    START_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    END_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SPOKEN_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    text: str
    text_start: int
    text_end: int
    start_sample: int
    end_sample: int
    spoken: str
    precision: TimingPrecision
    def __init__(self, text: _Optional[str] = ..., text_start: _Optional[int] = ..., text_end: _Optional[int] = ..., start_sample: _Optional[int] = ..., end_sample: _Optional[int] = ..., spoken: _Optional[str] = ..., precision: _Optional[_Union[TimingPrecision, str]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "generated_tokens", "audio_seconds", "time_to_first_audio_seconds", "generation_seconds")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AUDIO_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_AUDIO_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    generated_tokens: int
    audio_seconds: float
    time_to_first_audio_seconds: float
    generation_seconds: float
    def __init__(self, prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., audio_seconds: _Optional[float] = ..., time_to_first_audio_seconds: _Optional[float] = ..., generation_seconds: _Optional[float] = ...) -> None: ...

class SynthesisComplete(_message.Message):
    __slots__ = ("usage", "stop_reason")
    USAGE_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    usage: Usage
    stop_reason: StopReason
    def __init__(self, usage: _Optional[_Union[Usage, _Mapping]] = ..., stop_reason: _Optional[_Union[StopReason, str]] = ...) -> None: ...

class AudioChunk(_message.Message):
    __slots__ = ("request_id", "format", "audio", "complete")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    format: AudioFormat
    audio: AudioFrames
    complete: SynthesisComplete
    def __init__(self, request_id: _Optional[str] = ..., format: _Optional[_Union[AudioFormat, _Mapping]] = ..., audio: _Optional[_Union[AudioFrames, _Mapping]] = ..., complete: _Optional[_Union[SynthesisComplete, _Mapping]] = ...) -> None: ...

class ListVoicesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Voice(_message.Message):
    __slots__ = ("name", "description", "language", "is_default", "registered")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    IS_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    language: str
    is_default: bool
    registered: bool
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., language: _Optional[str] = ..., is_default: _Optional[bool] = ..., registered: _Optional[bool] = ...) -> None: ...

class RegisterVoiceRequest(_message.Message):
    __slots__ = ("name", "reference", "description")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    name: str
    reference: VoiceReference
    description: str
    def __init__(self, name: _Optional[str] = ..., reference: _Optional[_Union[VoiceReference, _Mapping]] = ..., description: _Optional[str] = ...) -> None: ...

class DeleteVoiceRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteVoiceResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListVoicesResponse(_message.Message):
    __slots__ = ("voices",)
    VOICES_FIELD_NUMBER: _ClassVar[int]
    voices: _containers.RepeatedCompositeFieldContainer[Voice]
    def __init__(self, voices: _Optional[_Iterable[_Union[Voice, _Mapping]]] = ...) -> None: ...
