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
def test_a_rows_packed_product_is_the_same_at_any_number_of_rows_from_two():
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
                    for start, rows in ((0, 2), (9, 3), (40, 4), (3, 7), (100, 64), (1, 200)):
                        assert torch.equal(linear(module, x[start:start + rows]), whole[start:start + rows]), \
                            (threads, module, rows)
    finally:
        torch.set_num_threads(before)


@onednn
def test_packed_products_equal_the_module_within_float_rounding_and_a_lone_row_is_the_module_itself():
    modules = layers((192, 576), (576, 192))
    pack_linears(modules)
    for module in modules:
        x = torch.randn(33, module.in_features)
        with torch.inference_mode():
            torch.testing.assert_close(linear(module, x), module(x), atol=1e-4, rtol=1e-5)
            assert torch.equal(linear(module, x[:1]), module(x[:1]))  # below PACKED_MIN_ROWS
    assert PACKED_MIN_ROWS == 2


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
def test_the_engine_packs_its_decoder_layers_and_false_leaves_them(tiny_model_dir):
    packed = TTSEngine(make_config(tiny_model_dir))
    plain = TTSEngine(make_config(tiny_model_dir, model={"packed_linears": False}))
    assert packed.model.packed_linears and not plain.model.packed_linears
    projections = [m for m in packed.model.backbone_layers().modules() if isinstance(m, nn.Linear)]
    assert projections and all(getattr(m, "packed_weight", None) is not None for m in projections)
    assert not any(hasattr(m, "packed_weight") for m in plain.model.backbone_layers().modules())
