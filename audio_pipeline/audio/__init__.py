"""Audio out: streaming encoders for every format the front doors offer."""
