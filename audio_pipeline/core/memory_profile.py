"""How much device memory the KV cache may take: what is left once the weights, the decoder and the
largest step the engine can run (with its activations) have had theirs.

On CUDA the engine runs that largest step once before it sizes the cache: a prefill of
``max_batch_input_tokens`` tokens spread over ``max_batch_size`` sequences, their candidate logits, and
the decoder's largest batched call (``max_batch_size`` windows of the largest chunk), on a temporary
cache just big enough for it. The peak of that pass above what was allocated before is the
activation reserve. On the CPU the cache is sized from the free host memory as before (its
activations are small next to the system's memory), so nothing is profiled there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from audio_pipeline.core.kv_cache.paged import PagedKVCacheManager

if TYPE_CHECKING:
    from audio_pipeline.models.llama_model import LlamaPipelineModel


def largest_step_peak_bytes(model: "LlamaPipelineModel", decoder: Any, *, max_step_tokens: int, max_rows: int,
                            decode_window: int, candidates: int) -> int:
    """Peak bytes of the largest step and decoder call above what is allocated now (CUDA); 0 elsewhere."""
    device = model.devices[0]
    if device.type != "cuda":
        return 0
    params = model.kv_params
    rows = max(1, min(max_rows, max_step_tokens))
    per_row = -(-max_step_tokens // rows)
    blocks = rows * -(-per_row // params.page_size)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    manager = PagedKVCacheManager(params, device, blocks, enable_prefix_caching=False,
                                  attention_kernel=model.kv_cache_config.attention_kernel,
                                  num_heads=model.huggingface_config.num_attention_heads, model_dtype=model.dtype,
                                  prefill_backend=model.kv_cache_config.prefill_backend)
    cache_bytes = torch.cuda.memory_allocated(device) - before
    torch.cuda.reset_peak_memory_stats(device)
    try:
        _largest_step(model, decoder, manager, max_step_tokens=max_step_tokens, rows=rows, per_row=per_row,
                      max_rows=max_rows, decode_window=decode_window, candidates=candidates)
        torch.cuda.synchronize(device)
        return max(0, torch.cuda.max_memory_allocated(device) - before - cache_bytes)
    finally:
        # Everything the pass held must be gone before the cache is sized from the free memory.
        del manager
        torch.cuda.empty_cache()


@torch.inference_mode()
def _largest_step(model, decoder, manager, *, max_step_tokens: int, rows: int, per_row: int, max_rows: int,
                  decode_window: int, candidates: int) -> None:
    """The largest prefill step on ``manager``'s temporary cache, its candidate logits, and the
    decoder's largest call (its locals die with it)."""
    device = manager.device
    ids = [f"profile-{i}" for i in range(rows)]
    lengths = [min(per_row, max_step_tokens - i * per_row) for i in range(rows)]
    ids, lengths = [i for i, n in zip(ids, lengths) if n > 0], [n for n in lengths if n > 0]
    for request_id, length in zip(ids, lengths):
        manager.claim(request_id)
        manager.block_manager.alloc(request_id, length)
    batch = manager.batch(ids, [0] * len(ids), lengths)
    tokens = torch.zeros(sum(lengths), dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])
    hidden = model.forward(tokens, positions, batch)
    last = hidden[torch.cumsum(torch.tensor(lengths, device=device), 0) - 1]
    (last @ model.model.lm_head.weight[:candidates].T).float()
    del hidden, last, batch
    frame = decoder.tokens_per_frame
    window = max(frame, decode_window - decode_window % frame)
    # Eagerly: the reserve covers an eager call of every row at once (a window no graph serves);
    # a decoder's captured calls (snac_graphs.py) take less, in a pool of their own made later.
    graphs = decoder.graphs
    if graphs is not None:
        decoder.graphs = None
    try:
        decoder.decode_batch([torch.zeros(window, dtype=torch.long, device=device) for _ in range(max_rows)])
    finally:
        if graphs is not None:
            decoder.graphs = graphs
