"""Randomly initialised models of real shapes, for benchmarks that need no download.

``write_random_model(path, "orpheus-3b")`` writes a model directory with Orpheus-3B's config (Llama
3.2 3B), the tokenizer layout of the Orpheus family and a random SNAC 24 kHz decoder, and a manifest
that says ``random_weights``: the engine then draws the language model's weights on the device when
it loads (nothing of its 3B parameters is written or read from disk). The speech is noise; the
shapes, and so the serving cost, are the real model's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from audio_pipeline.layouts import orpheus
from audio_pipeline.layouts.manifest import MANIFEST_NAME
from audio_pipeline.testing.tiny_models import TINY_LLAMA_CONFIG, write_tokenizer

#: Orpheus-3B (canopylabs' fine-tune of Llama 3.2 3B): its config.json's shape.
ORPHEUS_3B_CONFIG = {
    **TINY_LLAMA_CONFIG,
    "vocab_size": 156940,
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 28,
    "num_attention_heads": 24,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "tie_word_embeddings": True,
}

#: Shapes by name: the real model, and a tiny one for trying the benchmark on a CPU.
RANDOM_SHAPES = {"orpheus-3b": ORPHEUS_3B_CONFIG, "orpheus-tiny": TINY_LLAMA_CONFIG}

#: Qwen3-TTS-12Hz-0.6B: the talker (a Qwen3 0.6B's shape), its code predictor and its speech
#: tokenizer's decoder, as third-party descriptions give them (no published config.json could be
#: read here: the sizes are the ones the serving cost depends on, not checked against the hub).
QWEN3_TTS_SHAPES = {
    "qwen3-tts-0.6b": {
        "talker": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, text_hidden_size=2048, text_vocab_size=151936,
                       max_position_embeddings=32768),
        "code_predictor": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=5, num_attention_heads=16,
                               num_key_value_heads=8, head_dim=128),
        "codebook_size": 2048,
        "decoder": dict(num_quantizers=16, codebook_size=2048, codebook_dim=512, latent_dim=1024, hidden_size=512,
                        intermediate_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16,
                        head_dim=64, upsampling_ratios=[2, 2], upsample_rates=[8, 5, 4, 3], decoder_dim=1536),
    },
    "qwen3-tts-tiny": {
        "talker": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, text_hidden_size=32, text_vocab_size=512,
                       max_position_embeddings=4096),
        "code_predictor": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=1, head_dim=16),
        "codebook_size": 64,
        "decoder": dict(num_quantizers=16, codebook_size=64, codebook_dim=16, latent_dim=16, hidden_size=16,
                        intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                        head_dim=8, upsampling_ratios=[2, 2], upsample_rates=[8, 5, 4, 3], decoder_dim=32),
    },
    # The real head size (128: FlashInfer's kernels, CUDA graphs) at two small layers: the GPU tests'.
    "qwen3-tts-small": {
        "talker": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=128, text_hidden_size=64, text_vocab_size=512,
                       max_position_embeddings=4096),
        "code_predictor": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
                               num_key_value_heads=1, head_dim=128),
        "codebook_size": 64,
        "decoder": dict(num_quantizers=16, codebook_size=64, codebook_dim=16, latent_dim=16, hidden_size=16,
                        intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                        head_dim=8, upsampling_ratios=[2, 2], upsample_rates=[8, 5, 4, 3], decoder_dim=32),
    },
}
# Qwen3-TTS-12Hz-1.7B: a Qwen3 1.7B's talker (hidden 2048) with the 0.6B's code predictor (hidden
# 1024, fed through the 2048 -> 1024 projection the checkpoint has where the widths differ) and
# speech tokenizer, as published configs give them (also not checked against the hub here).
QWEN3_TTS_SHAPES["qwen3-tts-1.7b"] = {
    **QWEN3_TTS_SHAPES["qwen3-tts-0.6b"],
    "talker": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                   num_key_value_heads=8, head_dim=128, text_hidden_size=2048, text_vocab_size=151936,
                   max_position_embeddings=32768),
}

#: Qwen3-TTS-12Hz CustomVoice's codec control ids and a few preset speakers (talker vocabulary
#: = the codebook, then 1024 control ids), relative to the codebook size.
QWEN3_TTS_CODEC = {"codec_pad_id": 100, "codec_bos_id": 101, "codec_eos_token_id": 102, "codec_think_id": 106,
                   "codec_nothink_id": 107, "codec_think_bos_id": 108, "codec_think_eos_id": 109}
QWEN3_TTS_LANGUAGES = {"english": 2, "chinese": 7}
QWEN3_TTS_SPEAKERS = {"serena": 1018, "ryan": 1013, "vivian": 1017}


def write_random_qwen3_tts(path: Path, shape: str, *, seed: int = 0) -> Path:
    """A Qwen3-TTS CustomVoice directory of ``shape`` (QWEN3_TTS_SHAPES) whose talker weights are
    drawn at load, with a byte-level text tokenizer carrying the prompt's special tokens and a
    random speech tokenizer of the shape's decoder."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from audio_pipeline.testing.random_decoders import save_random_qwen3_tts_12hz_checkpoint

    spec = QWEN3_TTS_SHAPES[shape]
    codebook = spec["codebook_size"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={symbol: i for i, symbol in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>"]
    tokenizer.add_special_tokens(specials)
    # The prompt's role words are one token each, as in Qwen's vocabulary (the layout slices by count).
    tokenizer.add_tokens([AddedToken(word, normalized=False) for word in ("assistant", "user")])
    tokenizer.save(str(path / "tokenizer.json"))
    vocab = tokenizer.get_vocab()
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "Qwen2Tokenizer",
                                                            "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    talker = {**spec["talker"], "vocab_size": codebook + 1024, "num_code_groups": 16, "rms_norm_eps": 1e-6,
              "rope_theta": 1000000, "hidden_act": "silu", "attention_bias": False,
              **{key: codebook + value for key, value in QWEN3_TTS_CODEC.items()},
              "codec_language_id": {key: codebook + value for key, value in QWEN3_TTS_LANGUAGES.items()},
              "spk_id": {key: codebook + value for key, value in QWEN3_TTS_SPEAKERS.items()},
              "spk_is_dialect": {key: False for key in QWEN3_TTS_SPEAKERS},
              "code_predictor_config": {**spec["code_predictor"], "vocab_size": codebook, "rms_norm_eps": 1e-6,
                                        "rope_theta": 1000000, "hidden_act": "silu", "attention_bias": False,
                                        "max_position_embeddings": 64, "num_code_groups": 16}}
    (path / "config.json").write_text(json.dumps({
        "model_type": "qwen3_tts", "tts_model_type": "custom_voice", "tts_model_size": shape.rsplit("-", 1)[-1],
        "tts_bos_token_id": vocab["<tts_text_bos>"], "tts_eos_token_id": vocab["<tts_text_eod>"],
        "tts_pad_token_id": vocab["<tts_pad>"], "talker_config": talker}, indent=2))
    save_random_qwen3_tts_12hz_checkpoint(path / "speech_tokenizer", seed=seed, **spec["decoder"])
    (path / MANIFEST_NAME).write_text(json.dumps({
        "family": "qwen3-tts", "description": f"random {shape} (noise, real shapes)", "random_weights": True}, indent=2))
    return path


def _kyutai_lm(dim: int, heads: int, layers: int, context: int, text_card: int, card: int, n_q: int,
               depth_dim: int, depth_heads: int, depth_layers: int, schedule: list[int], voice_dim: int) -> dict:
    """A Kyutai TTS config.json's language model (the published layout's keys)."""
    return {
        "dim": dim, "text_card": text_card, "existing_text_padding_id": 3, "n_q": n_q, "dep_q": n_q, "card": card,
        "num_heads": heads, "num_layers": layers, "hidden_scale": 4.125, "causal": True, "layer_scale": None,
        "context": context, "max_period": 10000, "gating": "silu", "norm": "rms_norm_f32",
        "positional_embedding": "rope", "depformer_dim": depth_dim, "depformer_dim_feedforward": int(4.125 * depth_dim),
        "depformer_num_heads": depth_heads, "depformer_num_layers": depth_layers, "depformer_layer_scale": None,
        "depformer_multi_linear": True, "depformer_context": n_q, "depformer_max_period": 10000,
        "depformer_gating": "silu", "depformer_pos_emb": "none", "depformer_weights_per_step": True,
        "depformer_weights_per_step_schedule": schedule, "depformer_low_rank_embeddings": 128,
        "delays": [0, 0] + [2] * (n_q - 1), "demux_second_stream": True, "cross_attention": True,
        "conditioners": {
            "speaker_wavs": {"type": "tensor", "tensor": {"dim": voice_dim}},
            "control": {"type": "lut", "lut": {"n_bins": 4, "dim": 16, "tokenizer": "noop", "possible_values": ["ok"]}},
            "cfg": {"type": "lut", "lut": {"n_bins": 8, "dim": 16, "tokenizer": "noop",
                                           "possible_values": ["1.0", "1.5", "2.0", "2.5", "3.0", "3.5", "4.0"]}}},
        "fuser": {"sum": ["control", "cfg"], "cross": ["speaker_wavs"], "prepend": [], "cross_attention_pos_emb": True,
                  "cross_attention_pos_emb_scale": 1.0},
    }


#: Kyutai TTS shapes. 1.6b: what Kyutai's model card and the reference package say (a backbone of
#: about 1B and a depth transformer of about 600M with per-step weights shared in part, 32
#: codebooks of 2048, 12.5 Hz, the audio 16 frames behind the text, acoustic delay 2) filled in
#: where they do not: width 2048 x 16 layers x 16 heads, depth 1024 x 4 layers with 12 weight sets,
#: a 500-frame window, an 8000-piece text vocabulary, 512-wide voice embeddings (not verified:
#: the published config.json is not read here).
KYUTAI_TTS_SHAPES = {
    "kyutai-tts-1.6b": dict(dim=2048, heads=16, layers=16, context=500, text_card=8000, card=2048, n_q=32,
                            depth_dim=1024, depth_heads=16, depth_layers=4,
                            schedule=[*range(8), *[8] * 8, *[9] * 8, *[10] * 4, *[11] * 4], voice_dim=512),
    "kyutai-tts-tiny": dict(dim=64, heads=4, layers=2, context=32, text_card=384, card=64, n_q=8, depth_dim=32,
                            depth_heads=2, depth_layers=2, schedule=[0, 1, 2, 3, 4, 4, 5, 5], voice_dim=24),
}


def write_random_kyutai_tts(path: Path, shape: str, *, seed: int = 0) -> Path:
    """A Kyutai TTS directory of ``shape`` (KYUTAI_TTS_SHAPES) laid out as published, whose language
    model is drawn at load: config.json, a SentencePiece tokenizer trained here, one voice file,
    and a random Mimi of the published codec's shape (or the tiny one) in transformers' layout."""
    import sentencepiece

    from audio_pipeline.decoders.mimi_moshi import PUBLISHED_CONFIG, transformers_config
    from audio_pipeline.testing.random_decoders import save_random_mimi_checkpoint

    spec = KYUTAI_TTS_SHAPES[shape]
    corpus = path / "corpus.txt"
    corpus.write_text("\n".join(["Hello world, this is a random model of a real shape speaking.",
                                  "The quick brown fox jumps over the lazy dog by the river.",
                                  "Bonjour tout le monde, ceci est un essai."] * 8) + "\n")
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(path / "tokenizer"), vocab_size=320, model_type="bpe", unk_id=0,
        bos_id=1, eos_id=2, pad_id=3, byte_fallback=True, character_coverage=1.0, num_threads=1, minloglevel=2)
    corpus.unlink()
    (path / "tokenizer.vocab").unlink()
    config = {"moshi_name": "model.safetensors", "tokenizer_name": "tokenizer.model",
              "model_id": {"sig": "00000000", "epoch": 0}, "tts_config": {"audio_delay": 1.28, "second_stream_ahead": 2},
              **_kyutai_lm(**spec)}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    voice = path / "voices" / "random" / "speaker.wav.00000000@0.safetensors"
    voice.parent.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)
    save_file({"speaker_wavs": torch.randn(1, spec["voice_dim"], 10, generator=generator)}, str(voice))
    mimi = (transformers_config(PUBLISHED_CONFIG, path) if shape == "kyutai-tts-1.6b"
            else {"codebook_size": spec["card"], "num_quantizers": spec["n_q"]})
    mimi.pop("model_type", None)
    save_random_mimi_checkpoint(path / "mimi", seed=seed, **mimi)
    (path / MANIFEST_NAME).write_text(json.dumps({
        "family": "kyutai-tts", "description": f"random {shape} (noise, real shapes)", "random_weights": True,
        "audio_decoder": "mimi", "audio_decoder_weights": "mimi"}, indent=2))
    return path


def write_random_model(path: str | Path, shape: str, *, seed: int = 0) -> Path:
    """A model directory of ``shape`` (one of RANDOM_SHAPES or QWEN3_TTS_SHAPES) whose LM weights
    are drawn at load."""
    from audio_pipeline.testing.random_decoders import TINY_SNAC_CONFIG, save_random_snac_checkpoint

    if shape in QWEN3_TTS_SHAPES or shape in KYUTAI_TTS_SHAPES:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        write = write_random_qwen3_tts if shape in QWEN3_TTS_SHAPES else write_random_kyutai_tts
        return write(path, shape, seed=seed)
    if shape not in RANDOM_SHAPES:
        known = ", ".join([*RANDOM_SHAPES, *QWEN3_TTS_SHAPES, *KYUTAI_TTS_SHAPES])
        raise ValueError(f"--random-model: unknown shape {shape!r}; known: {known}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = RANDOM_SHAPES[shape]
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(path, config["vocab_size"])
    # The real model's decoder is SNAC 24 kHz at its published size; the tiny shape gets the tiny one.
    save_random_snac_checkpoint(path / "snac", seed=seed, **({} if shape == "orpheus-3b" else TINY_SNAC_CONFIG))
    (path / MANIFEST_NAME).write_text(json.dumps({
        "family": "orpheus", "description": f"random {shape} (noise, real shapes)", "random_weights": True,
        "voices": [{"name": v, "description": f"Orpheus preset voice {v}"} for v in orpheus.ORPHEUS_VOICES],
        "default_voice": orpheus.ORPHEUS_VOICES[0], "audio_decoder": "snac", "audio_decoder_weights": "snac",
    }, indent=2))
    return path
