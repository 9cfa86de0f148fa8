"""What the configuration's open values (None) become on the device the engine serves from.

``PipelineConfig.for_device`` applies these once, when the engine starts; everything below the
engine reads plain values. Each field's description names its CPU and CUDA values.

Why they differ: a GPU step costs about the same for one row as for hundreds (the weights are read
once per step), so CUDA batches are large, prompts ride along in decode steps instead of stalling
them, the next step is launched before the last one is read, and audio is decoded on a thread of its
own (the loop would otherwise wait for every chunk's kernels). On the CPU, steps cost per row, and
the decoder shares the loop's cores.
"""

DEVICE_DEFAULTS: dict[str, dict[str, object]] = {
    "cpu": {"max_batch_size": 32, "max_queue_size": 256, "enable_in_flight_batching": False,
            "enable_overlap_scheduler": False, "audio_decoder_thread": False, "deadline_scheduling": True,
            "rate_admission": True},
    # Deadline scheduling and admission by rate are measured on the CPU only: on CUDA they wait for a
    # GPU's measurements (a GPU's passes vary far less than a small CPU's, shared with the front end).
    "cuda": {"max_batch_size": 256, "max_queue_size": 256, "enable_in_flight_batching": True,
             "enable_overlap_scheduler": True, "audio_decoder_thread": True, "deadline_scheduling": False,
             "rate_admission": False},
}

#: Tokens per KV cache page when kv_cache_page_size is None: 16, 64 and 128 measured alike on the
#: CPU; 16 is FlashInfer's usual page on CUDA.
DEFAULT_PAGE_SIZE = {"cpu": 128, "cuda": 16}


def device_defaults(device_type: str) -> dict[str, object]:
    """The open values' defaults on a device of ``device_type`` (any non-CUDA device is served as the CPU)."""
    return DEVICE_DEFAULTS["cuda" if device_type == "cuda" else "cpu"]
