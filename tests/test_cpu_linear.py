"""model.packed_linears: decode steps' products on oneDNN-packed weights (CPU, float32)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from audio_pipeline.engine import TTSEngine
from audio_pipeline.models.cpu_linear import (PACKED_MIN_ROWS, linear, onednn_linear_available, pack_linears,
                                              use_packed_linears)
from conftest import make_config

CPU = torch.device("cpu")
onednn = pytest.mark.skipif(not onednn_linear_available(), reason="this torch has no oneDNN linear")


def layers(*shapes: tuple[int, int]) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(nn.Linear(k, n, bias=bool(i % 2)) for i, (k, n) in enumerate(shapes))


@onednn
def test_a_rows_packed_product_is_the_same_at_any_number_of_rows():
    # The built-in voice's shapes: attention (192 -> 192), MLP (192 -> 576 -> 192), a wider readout.
    modules = layers((192, 192), (192, 576), (576, 192), (192, 1024))
    assert pack_linears(modules) == 4
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


@onednn
def test_packed_products_equal_the_module_within_float_rounding():
    modules = layers((192, 576), (576, 192))
    pack_linears(modules)
    for module in modules:
        x = torch.randn(33, module.in_features)
        with torch.inference_mode():
            for rows in (1, 33):
                torch.testing.assert_close(linear(module, x[:rows]), module(x[:rows]), atol=1e-4, rtol=1e-5)
    assert PACKED_MIN_ROWS == 1


def test_auto_packs_only_a_float32_unquantized_model_on_the_cpu():
    modules = layers((8, 8))
    expected = onednn_linear_available()
    assert use_packed_linears(None, modules, torch.float32, CPU) is expected
    assert use_packed_linears(None, modules, torch.bfloat16, CPU) is False
    assert use_packed_linears(None, modules, torch.float32, CPU, quantized=True) is False
    assert use_packed_linears(None, modules, torch.float32, torch.device("cuda")) is False
    assert use_packed_linears(None, modules, torch.float32, CPU, compiled=True) is False
    assert use_packed_linears(False, modules, torch.float32, CPU) is False
    with pytest.raises(ValueError, match="model.packed_linears"):
        use_packed_linears(True, modules, torch.bfloat16, CPU)


@onednn
def test_the_engine_packs_its_decoder_layers_when_asked_and_leaves_them_by_default(tiny_model_dir):
    packed = TTSEngine(make_config(tiny_model_dir, model={"packed_linears": True}))
    plain = TTSEngine(make_config(tiny_model_dir))  # the default: off
    assert packed.model.packed_linears and not plain.model.packed_linears
    projections = [m for m in packed.model.backbone_layers().modules() if isinstance(m, nn.Linear)]
    assert projections and all(getattr(m, "packed_weight", None) is not None for m in projections)
    assert not any(hasattr(m, "packed_weight") for m in plain.model.backbone_layers().modules())


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
