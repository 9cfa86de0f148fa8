"""Decoder layers and depth-head blocks on the native decode kernels (models/native_layers.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from audio_pipeline.service.engine import TTSEngine
from audio_pipeline_kernels.native_decode import native_decode
from helpers import make_config, run_texts

pytestmark = pytest.mark.skipif(native_decode() is None, reason="the native decode kernels cannot be built here")


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    """The tiny Llama's engine with its defaults: packed, so its layers run natively."""
    return TTSEngine(make_config(tiny_model_dir))


def _prefill(engine, request_id: str, ids: list[int]):
    kv = engine.kv_cache
    kv.claim(request_id)
    kv.block_manager.alloc(request_id, len(ids) + 1)
    batch = kv.batch([request_id], [0], [len(ids)])
    engine.model.forward(torch.tensor(ids), torch.arange(len(ids)), batch)


def _step(engine, items, prompt_rows=()):
    """Hidden states of one step: ``items`` are (request id, start, ids)."""
    kv = engine.kv_cache
    batch = kv.batch([r for r, _, _ in items], [s for _, s, _ in items], [len(ids) for _, _, ids in items])
    batch = dataclasses.replace(batch, prompt_rows=prompt_rows)
    tokens = torch.tensor([t for _, _, ids in items for t in ids])
    positions = torch.cat([torch.arange(s, s + len(ids)) for _, s, ids in items])
    return engine.model.forward(tokens, positions, batch)


def test_every_decoder_layer_of_a_packed_llama_runs_natively(engine, tiny_model_dir):
    assert all(layer.native is not None for layer in engine.model.backbone_layers())
    plain = TTSEngine(make_config(tiny_model_dir, model={"packed_linears": False}))
    assert all(layer.native is None for layer in plain.model.backbone_layers())


def test_a_decode_rows_bits_are_the_same_in_a_step_with_a_prompt_beside_it(engine):
    # A step with prompt positions runs the layer's operations one by one (its products split by
    # position: bfloat16 prompt rows where the CPU has them); a decode row must come out with the bits
    # the fused calls give it, or a stream's speech would depend on others' arrivals.
    kv = engine.kv_cache
    vocab = engine.model.model.config.vocab_size
    first, second = torch.randint(0, vocab, (12,), generator=torch.Generator().manual_seed(0)).tolist(), \
        torch.randint(0, vocab, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    try:
        with torch.inference_mode():
            _prefill(engine, "a", first)
            kv.claim("b")
            kv.block_manager.alloc("b", len(second))
            alone = _step(engine, [("a", len(first), [5])])
            # What the fused call stored in the cache for the row (keys and values, every layer).
            slot = int(kv.batch(["a"], [len(first)], [1]).slot_mapping[0])
            stored = [cache.view(-1, *cache.shape[2:])[slot].clone() for cache in [*kv.cache.keys, *kv.cache.values]]
            for prompt_rows in (((1, 1 + len(second)),), ()):  # bfloat16 prompt rows (where native), float32
                mixed = _step(engine, [("a", len(first), [5]), ("b", 0, second)], prompt_rows)
                assert torch.equal(mixed[:1], alone), prompt_rows
                again = [cache.view(-1, *cache.shape[2:])[slot] for cache in [*kv.cache.keys, *kv.cache.values]]
                assert all(torch.equal(a, b) for a, b in zip(stored, again)), prompt_rows
    finally:
        kv.release("a")
        kv.release("b")


def test_native_layers_compute_what_the_torch_form_computes(engine):
    # The same packed products either way; the norms, rotation and SiLU round their own way.
    vocab = engine.model.model.config.vocab_size
    ids = torch.randint(0, vocab, (15,), generator=torch.Generator().manual_seed(2)).tolist()
    layers = engine.model.backbone_layers()
    native = [layer.native for layer in layers]
    kv = engine.kv_cache
    results = {}
    try:
        with torch.inference_mode():
            for name in ("native", "torch"):
                for layer, call in zip(layers, native):
                    layer.native = call if name == "native" else None
                _prefill(engine, name, ids[:-1])
                results[name] = (_step(engine, [(name, len(ids) - 1, ids[-1:])]),
                                 _step(engine, [(name, 0, ids)], ((0, len(ids)),)))
    finally:
        for layer, call in zip(layers, native):
            layer.native = call
        kv.release("native")
        kv.release("torch")
    for fused, plain in zip(results["native"], results["torch"]):
        torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def voice():
    """The default (frame) voice's engine, not started."""
    from audio_pipeline.config import DEFAULT_MODEL, AudioGenerationConfig

    return TTSEngine(AudioGenerationConfig.load(env={}, audio_flags=[], model={"device": "cpu",
                                                                                "model_path": DEFAULT_MODEL}))


def test_the_depth_head_and_its_blocks_natively_compute_what_the_torch_form_computes(voice):
    depth, embedding = voice.model.model.depth, voice.model.model.model.embed_tokens
    assert depth.native is not None and all(block.native is not None for block in depth.blocks)
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(5, voice.model.model.config.hidden_size, generator=generator)
    codes = torch.tensor([0, 17, 1023, 500, -2302])  # the last: a stop id below the codebook (id 2)
    with torch.inference_mode():
        for block in depth.blocks:
            native = block.native(x, block.norm)
            block.native, call = None, block.native
            try:
                torch.testing.assert_close(native, block(x), atol=1e-5, rtol=1e-5)
                assert torch.equal(call(x[2:3], block.norm), native[2:3])  # a row alone: the same bits
            finally:
                block.native = call
        native = depth(x, codes, embedding)
        depth.native, call = None, depth.native
        try:
            torch.testing.assert_close(native, depth(x, codes, embedding), atol=1e-4, rtol=1e-5)
        finally:
            depth.native = call
        assert torch.equal(depth(x[4:], codes[4:], embedding), native[4:])
        with pytest.raises(RuntimeError, match="out of the vocabulary") as refused:
            depth(x[:1], torch.tensor([10 ** 6]), embedding)
        # The kernel's check reads as its message alone, not a C++ backtrace.
        assert "Exception raised from" not in str(refused.value) and "frame #" not in str(refused.value)


def test_frame_embeddings_natively_equal_the_torch_form(voice):
    model = voice.model.model
    head = model.frame_head
    assert model.native_embed is not None
    base, size = int(head.fold["base"]), int(head.fold["sizes"][0]) * int(head.fold["sizes"][1])
    ids = torch.tensor([3, 300, base, base + 7, base + size - 1, 2400, 5])  # plain, folded and code ids
    frames = torch.tensor([[-1, -1, -1, -1], [5, 9, 300, -1], [-1, 2, -1, 1023], [0, 0, 0, 0],
                           [1023, -1, 7, 3], [-1, -1, -1, -1], [4, 4, -1, 4]])
    with torch.inference_mode():
        for inputs in ((ids, frames), (ids, None)):
            native = model.embed(*inputs)
            model.native_embed, call = None, model.native_embed
            try:
                torch.testing.assert_close(native, model.embed(*inputs), atol=1e-6, rtol=1e-6)
            finally:
                model.native_embed = call
        with pytest.raises(RuntimeError, match="out of the vocabulary"):
            model.embed(torch.tensor([-5]))


def test_without_the_native_kernels_the_layers_run_as_torch_operations_on_onednns_products(tiny_model_dir, monkeypatch):
    # Where no C++ compiler builds the extension, the engine packs for oneDNN and runs the torch form.
    from audio_pipeline.models.cpu_linear import OneDNNWeight, onednn_linear_available

    if not onednn_linear_available():
        pytest.skip("this torch has no oneDNN linear")
    monkeypatch.setattr(native_decode, "kernel", None)
    monkeypatch.setattr(native_decode, "tried", True)
    engine = TTSEngine(make_config(tiny_model_dir))
    layers = engine.model.backbone_layers()
    assert engine.model.packed_linears and all(layer.native is None for layer in layers)
    assert all(isinstance(layer.self_attn.qkv_proj.packed_weight, OneDNNWeight) for layer in layers)
    engine.start()
    try:
        [context] = run_texts(engine, ["Without the native kernels."], temperature=0.0)
        assert context.generated
    finally:
        engine.stop()
