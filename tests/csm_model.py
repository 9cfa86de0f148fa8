"""Tiny random Sesame CSM checkpoints for tests, written with transformers' own classes.

``write_tiny_csm(path)`` writes what ``CsmForConditionalGeneration.save_pretrained`` writes (config.json,
generation_config.json, model.safetensors with the backbone, the depth decoder and a random Mimi codec
under ``codec_model.``) and a byte-level tokenizer holding CSM's special tokens.

Token ids of the tiny model: bytes 0..255 (byte-level alphabet, no merges), then
``<|begin_of_text|>`` 256 (bos), ``<|end_of_text|>`` 257 (eos), ``<|AUDIO|>`` 258 (audio_token_id and,
as in sesame/csm-1b, pad_token_id), ``<|audio_eos|>`` 259 (audio_eos_token_id); text_vocab_size 300.
The tokenizer adds no special tokens itself (no post-processor): ``tokenizer(text).input_ids`` is the
text's bytes with or without ``add_special_tokens``.

Audio: 8 codebooks of 16 codes (``vocab_size`` = ``codebook_size`` = 16); the all-zero frame
(``codebook_eos_token_id`` 0) ends generation.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

BOS, EOS, AUDIO, AUDIO_EOS = 256, 257, 258, 259
SPECIAL_TOKENS = {"<|begin_of_text|>": BOS, "<|end_of_text|>": EOS, "<|AUDIO|>": AUDIO, "<|audio_eos|>": AUDIO_EOS}

TINY_MIMI = dict(model_type="mimi", hidden_size=32, num_filters=4, num_hidden_layers=1, intermediate_size=64,
                 num_attention_heads=2, num_key_value_heads=2, codebook_size=16, codebook_dim=16, num_quantizers=8,
                 vector_quantization_hidden_dimension=16, upsample_groups=32, sliding_window=16,
                 max_position_embeddings=64)

TINY_CSM = dict(num_codebooks=8, vocab_size=16, text_vocab_size=300, hidden_size=32, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                pad_token_id=AUDIO, bos_token_id=BOS, eos_token_id=EOS, audio_token_id=AUDIO,
                audio_eos_token_id=AUDIO_EOS, codebook_pad_token_id=15, codebook_eos_token_id=0,
                depth_decoder_config=dict(num_codebooks=8, backbone_hidden_size=32, vocab_size=16, hidden_size=16,
                                          intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                                          num_key_value_heads=1, max_position_embeddings=9),
                codec_config=TINY_MIMI)


def tiny_csm_config(**overrides):
    """The tiny CsmConfig; ``depth_decoder_config`` overrides merge into the tiny depth decoder's."""
    from transformers import CsmConfig

    fields = {**TINY_CSM, **overrides}
    if "depth_decoder_config" in overrides and isinstance(overrides["depth_decoder_config"], dict):
        fields["depth_decoder_config"] = {**TINY_CSM["depth_decoder_config"], **overrides["depth_decoder_config"]}
    return CsmConfig(**fields)


def write_csm_tokenizer(path: Path, model_max_length: int = 1024) -> None:
    """A byte-level BPE tokenizer (no merges) with CSM's special tokens at the ids in SPECIAL_TOKENS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    vocab.update(SPECIAL_TOKENS)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>", "pad_token": "<|AUDIO|>", "add_bos_token": False, "add_eos_token": False,
        "model_max_length": model_max_length}, indent=2))


def write_tiny_csm(path: str | Path, *, seed: int = 0, **overrides) -> Path:
    """Writes a random CsmForConditionalGeneration (``save_pretrained``) and its tokenizer to ``path``.

    Weights are drawn under a fixed seed, wider than transformers' init (std 0.02 would leave the
    codes' logits nearly tied): embeddings and heads N(0, 0.5), other matrices N(0, 0.2), norms
    1 + N(0, 0.1). ``overrides`` are CsmConfig fields (see tiny_csm_config).
    """
    from transformers import CsmForConditionalGeneration

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = tiny_csm_config(**overrides)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = CsmForConditionalGeneration(config)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.startswith("codec_model."):
                    continue
                if "norm" in name:
                    parameter.copy_(1.0 + 0.1 * torch.randn_like(parameter))
                elif "embed" in name or "head" in name:
                    parameter.normal_(0.0, 0.5)
                else:
                    parameter.normal_(0.0, 0.2)
    model.save_pretrained(str(path))
    write_csm_tokenizer(path, config.max_position_embeddings)
    return path


def hf_generate_frames(path: str | Path, prompt_ids: list[int], max_frames: int) -> list[list[int]]:
    """Greedy frames (backbone and depth decoder argmax) of transformers' generate, as lists of
    num_codebooks codes.

    Only generated frames come back (not the prompt), at most ``max_frames`` of them
    (``max_new_tokens`` counts frames). Generation stops after a frame whose first num_codebooks-1
    codes all equal codebook_eos_token_id (the all-zero frame for CSM); that frame is included, last.
    """
    from transformers import CsmForConditionalGeneration

    model = CsmForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    with torch.no_grad():
        frames = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                depth_decoder_do_sample=False, max_new_tokens=max_frames)
    return frames[0].tolist()
