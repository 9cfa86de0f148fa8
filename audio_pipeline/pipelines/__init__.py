"""Pipelines: speech-token generation steps and the audio generation engine around them."""
