"""The speech service under every front door: admission, validation, segmentation, encoded audio."""
