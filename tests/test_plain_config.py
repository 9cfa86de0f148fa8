"""The project's own voices load without transformers (checkpoints/plain_config.py): the same model,
the same vocabulary, and a server that never imports transformers' or torch's heavy machinery."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from audio_pipeline.checkpoints.loading import resolve_model_dir
from audio_pipeline.models.llama import rope_inverse_frequencies
from audio_pipeline.checkpoints.plain_config import PlainLlamaConfig, VocabularyTokenizer

VOICES = ["builtin:slt-en-v4", "builtin:slt-en-v5", "builtin:slt-en-frame", "builtin:slt-en", "builtin:lpc-en"]
#: Every config field this project's Llama code reads.
FIELDS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size", "max_position_embeddings",
          "tie_word_embeddings", "attention_bias", "mlp_bias", "hidden_act")


@pytest.mark.parametrize("voice", VOICES)
def test_the_plain_config_reads_what_transformers_reads(voice):
    from transformers import AutoConfig, AutoTokenizer

    directory = resolve_model_dir(voice)
    plain, reference = PlainLlamaConfig.read(directory), AutoConfig.from_pretrained(directory)
    for name in FIELDS:
        assert getattr(plain, name) == getattr(reference, name), name
    assert getattr(plain, "frame_head", None) == getattr(reference, "frame_head", None)
    ours, theirs = rope_inverse_frequencies(plain, plain.head_dim), rope_inverse_frequencies(reference, plain.head_dim)
    assert torch.equal(ours[0], theirs[0]) and ours[1] == theirs[1]
    tokenizer, fast = VocabularyTokenizer(directory), AutoTokenizer.from_pretrained(directory)
    assert tokenizer.get_vocab() == fast.get_vocab() and len(tokenizer) == len(fast)


def test_absent_fields_take_transformers_llama_defaults(tmp_path):
    from transformers import LlamaConfig

    fields = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "vocab_size": 300}
    (tmp_path / "config.json").write_text(json.dumps(fields))
    plain, reference = PlainLlamaConfig.read(tmp_path), LlamaConfig(**fields)
    for name in FIELDS:
        assert getattr(plain, name) == getattr(reference, name), name
    ours, theirs = rope_inverse_frequencies(plain, 16), rope_inverse_frequencies(reference, 16)
    assert torch.equal(ours[0], theirs[0])
    del fields["vocab_size"]
    with pytest.raises(ValueError, match="vocab_size"):
        PlainLlamaConfig(fields)


def test_the_default_voice_serves_without_transformers_sympy_or_dynamo():
    # What keeps an idle server small: these would cost it some 100 MiB (docs/performance.md, Memory).
    script = """
import sys
from audio_pipeline.config import AudioGenerationConfig
from audio_pipeline.service.engine import TTSEngine
engine = TTSEngine(AudioGenerationConfig.load(env={}, audio_flags=[], model={"device": "cpu"}))
engine.start()
engine.warmup()
assert engine.synthesize("Hello there.").samples.size
engine.stop()
heavy = ("transformers", "sympy", "torch.distributed.tensor", "torch._dynamo")  # (import torch has some of distributed)
print(sorted({h for h in heavy for m in sys.modules if m == h or m.startswith(h + ".")}))
"""
    root = Path(__file__).resolve().parents[1]
    env_path = [str(root), str(root / "kernels"), str(root / "clients")]
    result = subprocess.run([sys.executable, "-c", f"import sys; sys.path[:0] = {env_path!r}\n" + script],
                            capture_output=True, text=True, timeout=300, cwd=root)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"
