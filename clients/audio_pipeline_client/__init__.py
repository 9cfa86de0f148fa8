"""Python client of the audio-pipeline text-to-speech service (gRPC): TTSClient, AsyncTTSClient, tts-client CLI."""

from audio_pipeline_client.async_client import AsyncTTSClient
from audio_pipeline_client.client import TTSClient
from audio_pipeline_client.protocol import FLUSH
from audio_pipeline_client.timings import timings_json, timings_webvtt
from audio_pipeline_client.types import AudioStreamChunk, SynthesisResult, TTSError, Usage, Voice, WordTiming

__all__ = ["FLUSH", "AsyncTTSClient", "AudioStreamChunk", "SynthesisResult", "TTSClient", "TTSError", "Usage", "Voice",
           "WordTiming", "timings_json", "timings_webvtt"]
