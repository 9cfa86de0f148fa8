"""Generated gRPC code for proto/audio_pipeline/v1 (scripts/generate_proto.py)."""
