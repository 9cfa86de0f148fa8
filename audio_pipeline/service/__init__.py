"""The speech service under every front door: admission, validation, voices, segmentation, encoded audio."""
