"""What tests and benchmarks build: a tiny random Orpheus-layout model, models of real shapes with
random weights and random audio decoder checkpoints (directories written on the spot:
tiny_models, random_models, random_decoders), and the server on a background thread.

The serving runtime does not import this package; the one exception is ``builtin:tiny-orpheus``,
which writes its model with tiny_models on first use (tests/test_layout_boundaries.py checks both).
"""
