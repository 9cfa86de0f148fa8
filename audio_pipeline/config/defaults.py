"""Values the engine uses where the configuration leaves a limit open (None)."""

#: Requests decoded together when max_batch_size is None.
DEFAULT_MAX_BATCH_SIZE = 32
#: Requests that may wait for a batch slot when max_queue_size_tg is None.
DEFAULT_MAX_QUEUE_SIZE = 256
