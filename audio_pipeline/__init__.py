"""audio-pipeline: a text-to-speech serving engine (speech-token LM + streaming audio decoder over gRPC)."""

__version__ = "0.1.0"
