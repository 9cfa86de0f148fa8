"""model.packed_linears: decode steps' products on packed, row-stable weights (CPU, float32): the
native kernel's, or oneDNN's where it cannot be built."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from audio_pipeline.service.engine import TTSEngine
from audio_pipeline.models.cpu_linear import (OneDNNWeight, PackedWeight, linear, onednn_linear_available,
                                              pack_linears, pack_weight, packing_available, use_packed_linears)
from audio_pipeline_kernels.native_decode import NativeWeight, build_native_decode, native_decode
from helpers import make_config, run_to_completion

CPU = torch.device("cpu")
onednn = pytest.mark.skipif(not onednn_linear_available(), reason="this torch has no oneDNN linear")


@pytest.fixture(params=["native", "onednn"])
def kernel(request, monkeypatch):
    """Which packing serves the test: the native kernel, or oneDNN's (as where no compiler builds it)."""
    if request.param == "native":
        if native_decode() is None:
            pytest.skip("the native linear kernel cannot be built here")
    else:
        if not onednn_linear_available():
            pytest.skip("this torch has no oneDNN linear")
        monkeypatch.setattr(native_decode, "kernel", None)
        monkeypatch.setattr(native_decode, "tried", True)
    return request.param


def layers(*shapes: tuple[int, int]) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(nn.Linear(k, n, bias=bool(i % 2)) for i, (k, n) in enumerate(shapes))


def test_a_rows_packed_product_is_the_same_at_any_number_of_rows(kernel):
    # The built-in voice's shapes: attention (192 -> 192), MLP (192 -> 576 -> 192), a wider readout;
    # one whose columns do not fill the last panel (100), with a bias; and one wide enough that a
    # few rows' product splits its columns over threads (many rows split by rows).
    modules = layers((192, 192), (192, 576), (576, 192), (192, 1024), (48, 100), (256, 8192))
    assert pack_linears(modules) == 6
    expected = NativeWeight if kernel == "native" else OneDNNWeight
    assert all(isinstance(m.packed_weight, expected) for m in modules)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for module in modules:
                x = torch.randn(300, module.in_features)
                with torch.inference_mode():
                    whole = linear(module, x)
                    for start, rows in ((0, 1), (5, 1), (0, 2), (9, 3), (40, 4), (3, 7), (100, 64), (1, 200)):
                        assert torch.equal(linear(module, x[start:start + rows]), whole[start:start + rows]), \
                            (threads, module, rows)
    finally:
        torch.set_num_threads(before)


def test_packed_products_equal_the_module_within_float_rounding(kernel):
    modules = layers((192, 576), (576, 192), (40, 70))
    pack_linears(modules)
    for module in modules:
        x = torch.randn(33, module.in_features)
        with torch.inference_mode():
            for rows in (1, 2, 6, 7, 33):
                torch.testing.assert_close(linear(module, x[:rows]), module(x[:rows]), atol=1e-4, rtol=1e-5)
            # Rows of a wider tensor (a strided view) and no rows at all.
            wide = torch.cat([x, torch.randn(33, 5)], dim=1)[:, :module.in_features]
            torch.testing.assert_close(linear(module, wide), module(x), atol=1e-4, rtol=1e-5)
            assert linear(module, x[:0]).shape == (0, module.out_features)


def test_the_native_kernels_portable_loops_give_the_vector_forms_bits():
    # One fused multiply-add chain per element, whatever the instruction set: a build for baseline
    # x86-64 (the portable loops, narrower panels) gives this machine's AVX bits exactly.
    import platform

    if native_decode() is None or platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("needs the native kernel on x86-64")
    portable = build_native_decode(["-march=x86-64"])
    assert portable.panel_width() < native_decode().panel_width()
    torch.manual_seed(2)
    weight, bias, x = torch.randn(200, 96), torch.randn(200), torch.randn(13, 96)
    with torch.inference_mode():
        assert torch.equal(NativeWeight(portable, weight, bias)(x), NativeWeight(native_decode(), weight, bias)(x))


def test_auto_packs_only_a_float32_unquantized_model_on_the_cpu():
    modules = layers((8, 8))
    expected = packing_available()
    assert use_packed_linears(None, modules, torch.float32, CPU) is expected
    assert use_packed_linears(None, modules, torch.bfloat16, CPU) is False
    assert use_packed_linears(None, modules, torch.float32, CPU, quantized=True) is False
    assert use_packed_linears(None, modules, torch.float32, torch.device("cuda")) is False
    assert use_packed_linears(None, modules, torch.float32, CPU, compiled=True) is False
    assert use_packed_linears(False, modules, torch.float32, CPU) is False
    with pytest.raises(ValueError, match="model.packed_linears"):
        use_packed_linears(True, modules, torch.bfloat16, CPU)


def test_the_engine_packs_its_decoder_layers_by_default_and_leaves_them_when_asked(tiny_model_dir):
    if not packing_available():
        pytest.skip("no packing kernel here")
    packed = TTSEngine(make_config(tiny_model_dir))  # the default: auto, on for a float32 model on the CPU
    plain = TTSEngine(make_config(tiny_model_dir, model={"packed_linears": False}))
    assert packed.model.packed_linears and not plain.model.packed_linears
    projections = [m for m in packed.model.backbone_layers().modules() if isinstance(m, nn.Linear)]
    assert projections and all(isinstance(getattr(m, "packed_weight", None), PackedWeight) for m in projections)
    assert not any(hasattr(m, "packed_weight") for m in plain.model.backbone_layers().modules())
    # Packed, the query/key/value and gate/up projections run as one product each (fewer calls).
    assert all(layer.self_attn.qkv_proj is not None and layer.mlp.gate_up_proj is not None
               for layer in packed.model.backbone_layers())
    assert all(layer.self_attn.qkv_proj is None for layer in plain.model.backbone_layers())


def test_fused_products_are_the_separate_products_bits(kernel):
    # Fusing q/k/v and gate/up on the CPU must not change a bit of what packing alone gives.
    torch.manual_seed(1)
    for widths in ((192, 192, 192), (576, 576), (384, 384), (16, 16, 16)):
        weights = [torch.randn(n, widths[0] if len(widths) == 3 else 192) for n in widths]
        separate, fused = [pack_weight(w) for w in weights], pack_weight(torch.cat(weights))
        for rows in (1, 2, 5, 32):
            x = torch.randn(rows, weights[0].shape[1])
            with torch.inference_mode():
                assert torch.equal(fused(x), torch.cat([p(x) for p in separate], dim=1)), (widths, rows)


@onednn
def test_a_lone_row_takes_the_padded_product_unless_the_probe_finds_the_same_kernel(monkeypatch):
    monkeypatch.setattr(native_decode, "kernel", None)  # oneDNN's packing, as without a compiler
    monkeypatch.setattr(native_decode, "tried", True)
    weight = torch.randn(64, 48)
    exact = pack_weight(weight)
    padded = OneDNNWeight(exact.weight, None, lone_exact=False)
    calls = []
    x = torch.randn(5, 48)
    with torch.inference_mode():
        together = exact(x)
        original = torch.ops.mkldnn._linear_pointwise
        try:
            torch.ops.mkldnn._linear_pointwise = lambda rows, *rest: calls.append(rows.shape[0]) or original(rows, *rest)
            alone = [exact(x[i:i + 1]) if exact.lone_exact else None for i in range(5)]
            lone = padded(x[:1])
        finally:
            torch.ops.mkldnn._linear_pointwise = original
    assert torch.equal(lone, together[:1])
    assert calls[-1] == 2  # the lone row went in with a padding row
    if exact.lone_exact:
        assert calls[:5] == [1] * 5 and torch.equal(torch.cat(alone), together)


def test_products_run_at_a_few_row_counts_whatever_rows_come():
    # oneDNN keeps a compiled kernel per shape (~0.6 MiB each): row counts are bucketed so a
    # long-running server meets at most 10 per weight, and the real rows come back unchanged.
    from audio_pipeline.models.cpu_linear import CHUNK_ROWS, bucket_rows, in_buckets

    seen = set()

    def product(rows: torch.Tensor) -> torch.Tensor:
        seen.add(rows.shape[0])
        return rows * 2 + 1

    for count in [1, 2, 3, 5, 17, 63, 64, 65, 200, 256, 257, 1000, 1024, 1025, 4099]:
        x = torch.randn(count, 6)
        assert torch.equal(in_buckets(product, x), x * 2 + 1)
    assert seen <= {2, 4, 8, 16, 32, 64, 128, 256, 512, 1024} and max(seen) == CHUNK_ROWS == 1024
    assert [bucket_rows(n) for n in (1, 2, 3, 4, 5, 100)] == [2, 2, 4, 4, 8, 128]


def _speak_together(engine, texts, seeds):
    """Each text's (tokens, frames), all submitted at once, sampled with its seed."""
    contexts = [engine.create_context(t, temperature=0.9, top_p=0.95, seed=s) for t, s in zip(texts, seeds)]
    run_to_completion(engine, contexts)
    return [(list(c.generated), [list(f) for f in c.frames]) for c in contexts]


@pytest.fixture(scope="module")
def voice():
    """The default voice's engine with its default settings (started)."""
    from audio_pipeline.config import DEFAULT_MODEL, AudioGenerationConfig

    engine = TTSEngine(AudioGenerationConfig.load(env={}, audio_flags=[], model={"device": "cpu",
                                                                                  "model_path": DEFAULT_MODEL}))
    engine.start()
    yield engine
    engine.stop()


def test_a_rows_candidate_and_depth_logits_are_the_same_bits_in_any_batch(voice):
    # The sampling phase's products (the candidate logits' range of the output projection, the depth
    # head's blocks and readout) run packed like the layers', so a row's logits never depend on the
    # rows beside it (the BLAS rounds a lone row, 2-3 and 4+ rows three ways).
    model = voice.model
    if not model.packed_linears:
        pytest.skip("no packing kernel here")
    assert model.model.depth.packed_readout is not None
    torch.manual_seed(3)
    hidden = torch.randn(7, model.model.config.hidden_size)
    codes = torch.randint(0, 1024, (7,))
    start, width = model.model.frame_head.code_offsets[model.model.frame_head.token_column], 1024
    extra = torch.full((7, 1), 2)
    with torch.inference_mode():
        def candidates(rows):
            return model.compute_candidate_logits(hidden[rows], [(0, len(rows), start)], torch.arange(len(rows)),
                                                  extra[rows], width)

        def depth(rows):
            return model.model.depth(hidden[rows], codes[rows], model.model.model.embed_tokens)

        for compute in (candidates, depth):
            together = compute(list(range(7)))
            for rows in ([0], [3], [1, 2], [4, 5, 6], [0, 1, 2, 3, 4]):
                assert torch.equal(compute(rows), together[rows]), (compute.__name__, rows)


def test_the_default_voices_seeded_speech_is_the_same_alone_and_beside_others(voice):
    # What a seed promises: the same speech whatever else shares the steps.
    if not voice.model.packed_linears:
        pytest.skip("no packing kernel here")
    texts = ["Good morning, Anna.", "The museum opens at nine.", "Please call Stella.", "Thank you, Bob!"]
    alone = [_speak_together(voice, [text], [seed])[0] for seed, text in enumerate(texts)]
    together = _speak_together(voice, texts, list(range(len(texts))))
    assert all(frames for _, frames in alone)
    assert together == alone
