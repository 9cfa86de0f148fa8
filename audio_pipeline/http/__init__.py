"""The HTTP front door (ASGI): OpenAI-compatible speech beside gRPC, on the same engine."""
