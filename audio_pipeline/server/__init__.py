"""The gRPC server: servicer, audio output conversion, metrics, health, reflection, entry point."""
