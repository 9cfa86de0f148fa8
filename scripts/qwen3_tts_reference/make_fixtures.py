#!/usr/bin/env python
"""Golden fixtures for the Qwen3-TTS family, made with the reference package.

Run with the reference environment's interpreter (see build_env.sh):

    /work/qwen3tts-ref-venv/bin/python scripts/qwen3_tts_reference/make_fixtures.py

It builds TINY random checkpoints of the three Qwen3-TTS 12 Hz model types
(CustomVoice, VoiceDesign, Base) laid out like published checkpoints, loads them
back through the reference package (`qwen_tts.Qwen3TTSModel.from_pretrained`,
`qwen_tts.Qwen3TTSTokenizer.from_pretrained`) and records what the reference
computes: prompt embeddings, first-step talker logits, greedy frames,
code-predictor outputs, speech-tokenizer encode/decode and the speaker
x-vector.  Everything lands in tests/fixtures/qwen3_tts/ with a manifest.json.

This script only calls the reference; it does not re-implement it.  Hooks
(wrappers around `generate` methods and a forward pre-hook) are used to read
the tensors the reference passes between its own components.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import warnings
from importlib import metadata
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "tests" / "fixtures" / "qwen3_tts"

# ---------------------------------------------------------------------------
# Seeds and sizes (all recorded in manifest.json)
# ---------------------------------------------------------------------------
SEEDS = {
    "speech_tokenizer_weights": 1234,
    "custom_voice_weights": 2001,
    "voice_design_weights": 2002,
    "base_weights": 2003,
    "reference_waveform": 7,
    "decode_codes_40": 40,
    "decode_codes_330": 330,
}
CODEBOOK_SIZE = 64                      # real checkpoints: 2048
CONTROL_SHIFT = CODEBOOK_SIZE - 2048    # maps the real control ids into the tiny vocab
TALKER_VOCAB = CODEBOOK_SIZE + 1024     # real: 2048 + 1024 = 3072
NUM_CODE_GROUPS = 16
MAX_NEW_TOKENS = 17                     # -> at most 16 frames (the last sampled token has no sub-codes)
N_CP_FRAMES = 3                         # code-predictor logits are kept for the first frames only
N_STEP_LOGITS = 2                       # raw/processed talker logits kept for the first steps
SAMPLE_RATE = 24000
# Speech-tokenizer decoder init tweaks (see build_speech_tokenizer).
RESIDUAL_BRANCH_SCALE = float(os.environ.get("QWEN3TTS_RESIDUAL_BRANCH_SCALE", "0.25"))
OUTPUT_CONV_SCALE = float(os.environ.get("QWEN3TTS_OUTPUT_CONV_SCALE", "0.1"))
# The eos row of codec_head is scaled so that greedy decoding of some cases
# stops on eos inside the frame budget (the rest run to max_new_tokens).
EOS_ROW_SCALE = float(os.environ.get("QWEN3TTS_EOS_ROW_SCALE", "1.5"))
REF_SECONDS = 1.5

# Real (Qwen3-TTS-12Hz-*) codec control ids, shifted by CONTROL_SHIFT below.
REAL_CODEC_IDS = {
    "codec_pad_id": 2148,
    "codec_bos_id": 2149,
    "codec_eos_token_id": 2150,
    "codec_think_id": 2154,
    "codec_nothink_id": 2155,
    "codec_think_bos_id": 2156,
    "codec_think_eos_id": 2157,
}
REAL_LANGUAGE_IDS = {
    "chinese": 2055, "english": 2050, "german": 2053, "italian": 2070,
    "portuguese": 2071, "spanish": 2054, "japanese": 2058, "korean": 2064,
    "french": 2061, "russian": 2069, "beijing_dialect": 2074, "sichuan_dialect": 2062,
}
REAL_SPEAKER_IDS = {
    "serena": 3066, "vivian": 3065, "uncle_fu": 3010, "ryan": 3061, "aiden": 2861,
    "ono_anna": 2873, "sohee": 2864, "eric": 2875, "dylan": 2878,
}
SPEAKER_DIALECT = {name: False for name in REAL_SPEAKER_IDS}
SPEAKER_DIALECT.update({"eric": "sichuan_dialect", "dylan": "beijing_dialect"})

# Text-tokenizer special tokens, in the real tokenizer's relative order
# (real ids: <|endoftext|> 151643, <|im_start|> 151644, <|im_end|> 151645,
#  <tts_pad> 151671, <tts_text_bos> 151672, <tts_text_eod> 151673, <tts_text_bos_single> 151674).
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>", "<tts_text_bos_single>",
]
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEXT_BPE_VOCAB = 384  # byte alphabet (256) + merges


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------
class Writer:
    """Writes fixture files and remembers them for the manifest."""

    def __init__(self, root: Path):
        self.root = root
        self.entries: dict[str, dict] = {}

    def rel(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix()

    def npy(self, relpath: str, array, desc: str, call: str):
        arr = np.asarray(array)
        if arr.dtype == np.float64:
            arr = arr.astype(np.float32)
        path = self.root / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, arr, allow_pickle=False)
        self.entries[relpath] = {
            "kind": "npy", "shape": list(arr.shape), "dtype": str(arr.dtype),
            "description": desc, "call": call,
        }

    def json(self, relpath: str, obj, desc: str, call: str = ""):
        path = self.root / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
        self.entries[relpath] = {"kind": "json", "description": desc, "call": call}

    def note(self, relpath: str, desc: str, call: str = "", **extra):
        self.entries[relpath] = {"kind": Path(relpath).suffix.lstrip(".") or "file",
                                 "description": desc, "call": call, **extra}


def t2np(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.is_floating_point():
        t = t.to(torch.float32)
    return t.numpy()


def versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for name in ["qwen-tts", "transformers", "torch", "torchaudio", "tokenizers", "safetensors",
                 "accelerate", "numpy", "librosa", "soundfile", "huggingface-hub"]:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def fill_(gen: torch.Generator, param: torch.Tensor, std: float, mean: float = 0.0):
    with torch.no_grad():
        param.copy_(torch.randn(param.shape, generator=gen) * std + mean)


def init_module_weights(module: torch.nn.Module, seed: int):
    """Deterministic, well-scaled random init (independent of HF's _init_weights).

    Linear/conv weights ~ N(0, 1/fan_in); embeddings ~ N(0, 0.5^2); norm weights
    ~ 1 + N(0, 0.1^2); biases ~ N(0, 0.05^2); learnable scales ~ 0.1 + N(0, 0.02^2).
    """
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
        leaf = name.rsplit(".", 1)[-1]
        parent = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
        cls = type(parent).__name__
        if leaf == "bias":
            fill_(gen, p, 0.05)
        elif cls.endswith("RMSNorm") or isinstance(parent, torch.nn.LayerNorm):
            fill_(gen, p, 0.1, 1.0)
        elif isinstance(parent, torch.nn.Embedding):
            fill_(gen, p, 0.5)
        elif isinstance(parent, (torch.nn.Linear, torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
            if isinstance(parent, torch.nn.ConvTranspose1d):  # (in, out, k): each output sees ~in*k/stride taps
                fan_in = p.shape[0] * p.shape[2] / parent.stride[0]
            else:
                fan_in = int(np.prod(p.shape[1:]))
            fill_(gen, p, 1.0 / math.sqrt(max(1, fan_in)))
        elif cls == "SnakeBeta":  # alpha / beta are log-scale
            fill_(gen, p, 0.1)
        elif leaf in ("scale", "gamma"):  # layer scales, ConvNeXt gamma
            fill_(gen, p, 0.02, 0.1)
        elif leaf == "embedding_sum":  # EuclideanCodebook (decoder RVQ)
            fill_(gen, p, 1.0)
        elif leaf == "cluster_usage":
            with torch.no_grad():
                p.copy_(torch.rand(p.shape, generator=gen) * 1.5 + 0.5)
        else:
            raise RuntimeError(f"no init rule for parameter {name} ({cls})")
    # Mimi codebooks are buffers, not parameters.
    for name, b in sorted(module.named_buffers(), key=lambda kv: kv[0]):
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "embed_sum":
            fill_(gen, b, 1.0)
        elif leaf == "cluster_usage":
            with torch.no_grad():
                b.copy_(torch.rand(b.shape, generator=gen) * 1.5 + 0.5)
        elif leaf == "initialized":
            with torch.no_grad():
                b.fill_(1.0)


# ---------------------------------------------------------------------------
# text tokenizer
# ---------------------------------------------------------------------------
TEXT_CORPUS_LINES = [
    "Hello world. This is a tiny test of the speech synthesis engine.",
    "The quick brown fox jumps over the lazy dog, again and again.",
    "A warm, low voice that speaks slowly and clearly.",
    "Speak with a cheerful tone, please.",
    "Today the weather is sunny and the sky is blue.",
    "你好，欢迎使用语音合成。今天天气很好。",
    "我们一起去公园散步吧。",
    "Numbers like 1, 2, 3 and 2026 are read one digit at a time.",
]


def build_text_tokenizer(out_dir: Path):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2TokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    corpus = []
    for _ in range(8):
        corpus.extend(TEXT_CORPUS_LINES)
        corpus.extend(["assistant", "user", "system", "assistant\n", "user\n"] * 4)
    trainer = trainers.BpeTrainer(
        vocab_size=TEXT_BPE_VOCAB, min_frequency=1, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[],
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])

    fast = Qwen2TokenizerFast(
        tokenizer_object=tok,
        unk_token=None, bos_token=None,
        eos_token="<|im_end|>", pad_token="<|endoftext|>",
        errors="replace", add_prefix_space=False, clean_up_tokenization_spaces=False,
        model_max_length=32768, split_special_tokens=False,
    )
    fast.save_pretrained(str(out_dir))
    # Also write the slow-tokenizer files (vocab.json / merges.txt) like a published checkpoint.
    tok.model.save(str(out_dir))
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "Qwen2Tokenizer"
    cfg.pop("tokenizer_file", None)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    ids = {t: fast.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    ids["assistant"] = fast.convert_tokens_to_ids("assistant")
    ids["user"] = fast.convert_tokens_to_ids("user")
    for word in ("assistant", "user"):
        enc = fast(f"<|im_start|>{word}\n", add_special_tokens=False)["input_ids"]
        assert len(enc) == 3, (word, enc)  # the reference slices input_ids[:, :3]
    enc = fast("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert len(enc) == 5, enc  # the reference slices input_ids[:, 3:-5]
    return ids, len(fast)


# ---------------------------------------------------------------------------
# configs
# ---------------------------------------------------------------------------
def speech_tokenizer_config() -> dict:
    return {
        "architectures": ["Qwen3TTSTokenizerV2Model"],
        "model_type": "qwen3_tts_tokenizer_12hz",
        "encoder_valid_num_quantizers": 16,
        "input_sample_rate": SAMPLE_RATE,
        "output_sample_rate": SAMPLE_RATE,
        "encode_downsample_rate": 1920,   # encoder keeps the real 8*6*5*4*2 hop
        "decode_upsample_rate": 192,      # tiny decoder: prod([4,3,2,2] + [2,2]) (real: 1920)
        "encoder_config": {
            "model_type": "mimi",
            "sampling_rate": SAMPLE_RATE,
            "frame_rate": 12.5,
            "audio_channels": 1,
            "hidden_size": 16,
            "num_filters": 2,
            "num_residual_layers": 1,
            "upsampling_ratios": [8, 6, 5, 4],
            "kernel_size": 7,
            "last_kernel_size": 3,
            "residual_kernel_size": 3,
            "dilation_growth_rate": 2,
            "use_causal_conv": True,
            "pad_mode": "constant",
            "compress": 2,
            "trim_right_ratio": 1.0,
            "codebook_size": CODEBOOK_SIZE,
            "codebook_dim": 8,
            "vector_quantization_hidden_dimension": 8,
            "num_quantizers": 18,
            "num_semantic_quantizers": 1,
            "upsample_groups": 16,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "intermediate_size": 32,
            "hidden_act": "gelu",
            "max_position_embeddings": 8000,
            "sliding_window": 250,
            "rope_theta": 10000.0,
            "norm_eps": 1e-5,
            "layer_scale_initial_scale": 0.01,
            "use_cache": False,
            "use_streaming": False,
        },
        "decoder_config": {
            "codebook_size": CODEBOOK_SIZE,
            "semantic_codebook_size": 2 * CODEBOOK_SIZE,  # present in real configs, unused by the reference code
            "num_semantic_quantizers": 1,
            "vector_quantization_hidden_dimension": 16,
            "codebook_dim": 16,
            "latent_dim": 16,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "max_position_embeddings": 8000,
            "rope_theta": 10000,
            "rms_norm_eps": 1e-5,
            "sliding_window": 72,
            "layer_scale_initial_scale": 0.01,
            "num_quantizers": 16,
            "upsample_rates": [4, 3, 2, 2],
            "upsampling_ratios": [2, 2],
            "decoder_dim": 32,
        },
    }


def tts_config(model_type: str, text_ids: dict, text_vocab_size: int) -> dict:
    codec_ids = {k: v + CONTROL_SHIFT for k, v in REAL_CODEC_IDS.items()}
    languages = {k: v + CONTROL_SHIFT for k, v in REAL_LANGUAGE_IDS.items()}
    if model_type == "custom_voice":
        spk_id = {k: v + CONTROL_SHIFT for k, v in REAL_SPEAKER_IDS.items()}
        spk_is_dialect = dict(SPEAKER_DIALECT)
    else:
        spk_id, spk_is_dialect = {}, {}
    talker = {
        "model_type": "qwen3_tts_talker",
        "vocab_size": TALKER_VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "rope_scaling": {"interleaved": True, "mrope_section": [2, 1, 1], "rope_type": "default", "type": "default"},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "num_code_groups": NUM_CODE_GROUPS,
        "text_hidden_size": 24,
        "text_vocab_size": text_vocab_size,
        "position_id_per_seconds": 13,
        **codec_ids,
        "codec_language_id": languages,
        "spk_id": spk_id,
        "spk_is_dialect": spk_is_dialect,
        "code_predictor_config": {
            "model_type": "qwen3_tts_talker_code_predictor",
            "vocab_size": CODEBOOK_SIZE,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 8,
            "hidden_act": "silu",
            "max_position_embeddings": 64,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000,
            "attention_bias": False,
            "use_sliding_window": False,
            "num_code_groups": NUM_CODE_GROUPS,
        },
    }
    speaker_encoder = {
        "mel_dim": 128, "enc_dim": 32,
        "enc_channels": [16, 16, 16, 16, 48], "enc_kernel_sizes": [5, 3, 3, 3, 1],
        "enc_dilations": [1, 2, 3, 4, 1], "enc_attention_channels": 8,
        "enc_res2net_scale": 4, "enc_se_channels": 8, "sample_rate": SAMPLE_RATE,
    }
    return {
        "architectures": ["Qwen3TTSForConditionalGeneration"],
        "model_type": "qwen3_tts",
        "tokenizer_type": "qwen3_tts_tokenizer_12hz",
        "tts_model_size": "1b7",
        "tts_model_type": model_type,
        "im_start_token_id": text_ids["<|im_start|>"],
        "im_end_token_id": text_ids["<|im_end|>"],
        "assistant_token_id": text_ids["assistant"],
        "tts_pad_token_id": text_ids["<tts_pad>"],
        "tts_bos_token_id": text_ids["<tts_text_bos>"],
        "tts_eos_token_id": text_ids["<tts_text_eod>"],
        "talker_config": talker,
        "speaker_encoder_config": speaker_encoder,
    }


GENERATION_CONFIG = {
    "do_sample": True, "repetition_penalty": 1.05, "temperature": 0.9, "top_p": 1.0, "top_k": 50,
    "subtalker_dosample": True, "subtalker_temperature": 0.9, "subtalker_top_p": 1.0,
    "subtalker_top_k": 50, "max_new_tokens": 8192,
}


# ---------------------------------------------------------------------------
# building the tiny checkpoints
# ---------------------------------------------------------------------------
def write_config(path: Path, cfg_dict: dict, dtype: str):
    import transformers
    cfg = dict(cfg_dict, torch_dtype=dtype, transformers_version=transformers.__version__)
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def build_speech_tokenizer(out_dir: Path):
    from transformers import EncodecFeatureExtractor
    from qwen_tts.core import Qwen3TTSTokenizerV2Config, Qwen3TTSTokenizerV2Model

    cfg_dict = speech_tokenizer_config()
    config = Qwen3TTSTokenizerV2Config(**{k: v for k, v in cfg_dict.items() if k not in ("architectures", "model_type")})
    torch.manual_seed(SEEDS["speech_tokenizer_weights"])
    model = Qwen3TTSTokenizerV2Model(config).eval()
    init_module_weights(model, SEEDS["speech_tokenizer_weights"])
    # Keep activations O(1) through the residual stacks and the output mostly inside
    # the final clamp(-1, 1), so that the fixtures are sensitive to errors.
    with torch.no_grad():
        for mod in model.decoder.modules():
            if type(mod).__name__ == "Qwen3TTSTokenizerV2DecoderDecoderResidualUnit":
                mod.conv2.conv.weight.mul_(RESIDUAL_BRANCH_SCALE)
        model.decoder.decoder[-1].conv.weight.mul_(OUTPUT_CONV_SCALE)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    write_config(out_dir / "config.json", cfg_dict, "float32")
    EncodecFeatureExtractor(feature_size=1, sampling_rate=SAMPLE_RATE, padding_value=0.0,
                            chunk_length_s=None, overlap=None, return_attention_mask=True,
                            padding_side="right").save_pretrained(str(out_dir))


def build_tts_checkpoint(model_type: str, out_dir: Path, text_dir: Path, st_dir: Path,
                         text_ids: dict, text_vocab_size: int, link_speech_tokenizer_to: str | None = None):
    from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSForConditionalGeneration

    cfg_dict = tts_config(model_type, text_ids, text_vocab_size)
    config = Qwen3TTSConfig(**{k: v for k, v in cfg_dict.items() if k not in ("architectures", "model_type")})
    seed = SEEDS[f"{model_type}_weights"]
    torch.manual_seed(seed)
    model = Qwen3TTSForConditionalGeneration(config).eval()
    init_module_weights(model, seed)
    with torch.no_grad():
        model.talker.codec_head.weight[config.talker_config.codec_eos_token_id].mul_(EOS_ROW_SCALE)
    # Published checkpoints store bf16 weights; round once here so that the
    # fp32 computation below runs on exactly the stored values.
    model = model.to(torch.bfloat16)
    model.config.architectures = ["Qwen3TTSForConditionalGeneration"]
    model.save_pretrained(str(out_dir), safe_serialization=True)
    # HF's own serialisation of this config does not load back (the speaker-encoder
    # sub-config rejects the generic keys), so write it the way published checkpoints do.
    write_config(out_dir / "config.json", cfg_dict, "bfloat16")
    # drop transformers' own generation_config.json and write the published-style one
    (out_dir / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2, sort_keys=True) + "\n")
    for f in sorted(text_dir.iterdir()):
        shutil.copy2(f, out_dir / f.name)
    if link_speech_tokenizer_to is None:
        shutil.copytree(st_dir, out_dir / "speech_tokenizer")
    else:
        # The three model types ship the same speech tokenizer; keep one copy (size budget).
        os.symlink(link_speech_tokenizer_to, out_dir / "speech_tokenizer", target_is_directory=True)


# ---------------------------------------------------------------------------
# capture hooks
# ---------------------------------------------------------------------------
class Capture:
    """Wraps the reference's generate methods to record what flows through them."""

    def __init__(self, tts):
        self.tts = tts
        self.model = tts.model
        self.reset()
        self._orig = {}

    def reset(self):
        self.top_kwargs = None
        self.top_result = None
        self.talker_kwargs = None
        self.talker_out = None
        self.cp_calls = []
        self.talker_inputs = []

    def __enter__(self):
        m = self.model
        cap = self
        self._orig["top"] = m.generate
        self._orig["talker"] = m.talker.generate
        self._orig["cp"] = m.talker.code_predictor.generate

        def top_generate(*args, **kwargs):
            cap.top_kwargs = kwargs
            res = cap._orig["top"](*args, **kwargs)
            cap.top_result = res
            return res

        def talker_generate(*args, **kwargs):
            cap.talker_kwargs = {k: v for k, v in kwargs.items()}
            kwargs = dict(kwargs, output_logits=True, output_scores=True)
            out = cap._orig["talker"](*args, **kwargs)
            cap.talker_out = out
            return out

        def cp_generate(*args, **kwargs):
            call = {"inputs_embeds": kwargs["inputs_embeds"].detach().clone(),
                    "kwargs": {k: v for k, v in kwargs.items() if k != "inputs_embeds"}}
            kwargs = dict(kwargs, output_logits=True, output_scores=True)
            out = cap._orig["cp"](*args, **kwargs)
            call["sequences"] = out.sequences.detach().clone()
            call["logits"] = torch.stack([x.detach().clone() for x in out.logits], dim=1)
            call["scores"] = torch.stack([x.detach().clone() for x in out.scores], dim=1)
            cap.cp_calls.append(call)
            return out

        def pre_hook(module, args, kwargs):
            emb = kwargs.get("inputs_embeds")
            pos = kwargs.get("position_ids")
            cap.talker_inputs.append((emb.detach().clone(), None if pos is None else pos.detach().clone()))

        m.generate = top_generate
        m.talker.generate = talker_generate
        m.talker.code_predictor.generate = cp_generate
        self._hook = m.talker.model.register_forward_pre_hook(pre_hook, with_kwargs=True)
        return self

    def __exit__(self, *exc):
        m = self.model
        m.generate = self._orig["top"]
        m.talker.generate = self._orig["talker"]
        m.talker.code_predictor.generate = self._orig["cp"]
        self._hook.remove()
        return False


def greedy_kwargs():
    return dict(do_sample=False, subtalker_dosample=False, max_new_tokens=MAX_NEW_TOKENS)


# ---------------------------------------------------------------------------
# cases
# ---------------------------------------------------------------------------
CASES = [
    # name, model_type, wrapper method, kwargs (besides the greedy ones), description
    ("custom_voice_serena_en_nonstreaming", "custom_voice", "generate_custom_voice",
     dict(text="Hello world. This is a tiny test.", speaker="Serena", language="English", non_streaming_mode=True),
     "CustomVoice preset speaker, explicit language (think + language id), non-streaming text (the wrapper's default)."),
    ("custom_voice_serena_en_streaming", "custom_voice", "generate_custom_voice",
     dict(text="Hello world. This is a tiny test.", speaker="Serena", language="English", non_streaming_mode=False),
     "CustomVoice preset speaker, streaming text feeding (first text token in the prompt, rest fed one per frame)."),
    ("custom_voice_ryan_auto_nonstreaming", "custom_voice", "generate_custom_voice",
     dict(text="The quick brown fox jumps.", speaker="Ryan", language="Auto", non_streaming_mode=True),
     "CustomVoice, language Auto with a non-dialect speaker: nothink prefix, no language id."),
    ("custom_voice_eric_dialect_chinese", "custom_voice", "generate_custom_voice",
     dict(text="你好，欢迎使用语音合成。", speaker="Eric", language="Chinese", non_streaming_mode=True),
     "CustomVoice dialect speaker (eric -> sichuan_dialect): language Chinese is replaced by the dialect's language id."),
    ("custom_voice_dylan_dialect_auto_streaming", "custom_voice", "generate_custom_voice",
     dict(text="我们一起去公园散步吧。", speaker="Dylan", language="Auto", non_streaming_mode=False),
     "CustomVoice dialect speaker with language Auto (dylan -> beijing_dialect id), streaming text."),
    ("custom_voice_ryan_instruct", "custom_voice", "generate_custom_voice",
     dict(text="Today the weather is sunny.", speaker="Ryan", language="English",
          instruct="Speak with a cheerful tone, please.", non_streaming_mode=True),
     "CustomVoice with an instruction (1b7 models only): instruction text track prepended."),
    ("voice_design_nonstreaming", "voice_design", "generate_voice_design",
     dict(text="Hello world. This is a tiny test.", instruct="A warm, low voice that speaks slowly.",
          language="English", non_streaming_mode=True),
     "VoiceDesign: instruction + no speaker, non-streaming text (the wrapper's default)."),
    ("voice_design_streaming", "voice_design", "generate_voice_design",
     dict(text="Hello world. This is a tiny test.", instruct="A warm, low voice that speaks slowly.",
          language="English", non_streaming_mode=False),
     "VoiceDesign, streaming text."),
    ("base_xvector_streaming", "base", "generate_voice_clone",
     dict(text="Hello world. This is a tiny test.", language="English", x_vector_only_mode=True,
          non_streaming_mode=False),
     "Base, x-vector-only cloning (speaker embedding in the codec track), streaming text (the wrapper's default)."),
    ("base_xvector_nonstreaming", "base", "generate_voice_clone",
     dict(text="Hello world. This is a tiny test.", language="English", x_vector_only_mode=True,
          non_streaming_mode=True),
     "Base, x-vector-only cloning, non-streaming text."),
    ("base_icl_streaming_short_text", "base", "generate_voice_clone",
     dict(text="Hi.", language="English", ref_text="Speak with a cheerful tone.",
          x_vector_only_mode=False, non_streaming_mode=False),
     "Base in-context cloning (x-vector + reference codes + transcript), streaming, text track shorter than the codec track (padded with tts_pad)."),
    ("base_icl_streaming_long_text", "base", "generate_voice_clone",
     dict(text="The quick brown fox jumps over the lazy dog, again and again. Today the weather is sunny and the sky is blue.",
          language="English", ref_text="Numbers like 1, 2, 3.", x_vector_only_mode=False, non_streaming_mode=False),
     "Base in-context cloning, streaming, text track longer than the codec track (the rest is fed one per frame)."),
    ("base_icl_nonstreaming", "base", "generate_voice_clone",
     dict(text="Hello world. This is a tiny test.", language="English", ref_text="Speak with a cheerful tone.",
          x_vector_only_mode=False, non_streaming_mode=True),
     "Base in-context cloning, non-streaming text."),
]


# the wrapper's final waveform is kept for these cases only (size budget)
WAV_CASES = {"custom_voice_serena_en_nonstreaming", "voice_design_nonstreaming", "base_xvector_streaming",
             "base_icl_streaming_short_text", "base_icl_nonstreaming"}


def reference_waveform() -> np.ndarray:
    """1.5 s synthetic 'voiced' signal at 24 kHz, quantised to 16-bit PCM values."""
    rng = np.random.default_rng(SEEDS["reference_waveform"])
    n = int(REF_SECONDS * SAMPLE_RATE)
    t = np.arange(n) / SAMPLE_RATE
    f0 = 140.0 + 30.0 * np.sin(2 * np.pi * 1.3 * t)
    phase = 2 * np.pi * np.cumsum(f0) / SAMPLE_RATE
    sig = sum((0.5 / k) * np.sin(k * phase) for k in range(1, 9))
    env = 0.5 * (1 - np.cos(2 * np.pi * np.minimum(t / 0.1, 1.0) / 2)) * np.exp(-0.3 * t)
    sig = 0.6 * env * sig + 0.01 * rng.standard_normal(n)
    pcm = np.clip(np.round(sig * 32767), -32768, 32767).astype(np.int16)
    return pcm


def run_case(w: Writer, tts, name, model_type, method, kwargs, desc, ref_wav_path: Path):
    cdir = f"cases/{name}"
    kw = dict(kwargs)
    if method == "generate_voice_clone":
        kw["ref_audio"] = str(ref_wav_path)
    full_call = (f"Qwen3TTSModel.from_pretrained('models/{model_type}', dtype=torch.float32, "
            f"attn_implementation='eager').{method}(" +
            ", ".join(f"{k}={v!r}" for k, v in {**kwargs, **({'ref_audio': 'reference_24k.wav'} if method == 'generate_voice_clone' else {}), **greedy_kwargs()}.items()) + ")")
    call = f"see manifest cases.{name}.call"
    with Capture(tts) as cap:
        wavs, sr = getattr(tts, method)(**kw, **greedy_kwargs())
    top = cap.top_kwargs
    codes_list, hidden_list = cap.top_result
    codes = codes_list[0]
    talker_out = cap.talker_out
    sequences = talker_out.sequences[0]
    eos = tts.model.config.talker_config.codec_eos_token_id

    info = {
        "name": name, "model": f"models/{model_type}", "description": desc,
        "method": method, "call": full_call,
        "inputs": {k: v for k, v in kwargs.items()},
        "num_frames": int(codes.shape[0]),
        "talker_tokens_generated": int(sequences.shape[0]),
        "stopped_on_eos": bool((sequences == eos).any().item()),
        "prompt_length": int(cap.talker_kwargs["inputs_embeds"].shape[1]),
        "trailing_text_length": int(cap.talker_kwargs["trailing_text_hidden"].shape[1]),
        "generate_kwargs_seen_by_Qwen3TTSForConditionalGeneration.generate": {
            k: v for k, v in top.items()
            if k in ("do_sample", "top_k", "top_p", "temperature", "repetition_penalty", "subtalker_dosample",
                     "subtalker_top_k", "subtalker_top_p", "subtalker_temperature", "max_new_tokens",
                     "non_streaming_mode", "languages", "speakers")},
        "talker_generation_config": {
            k: (v.tolist() if isinstance(v, torch.Tensor) else v)
            for k, v in tts.model.talker.generation_config.to_diff_dict().items()},
    }
    # --- token ids
    w.npy(f"{cdir}/input_ids.npy", t2np(top["input_ids"][0][0]),
          "text token ids of '<|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>assistant\\n'", call)
    if top.get("instruct_ids") and top["instruct_ids"][0] is not None:
        w.npy(f"{cdir}/instruct_ids.npy", t2np(top["instruct_ids"][0][0]),
              "text token ids of '<|im_start|>user\\n{instruct}<|im_end|>\\n'", call)
    if top.get("ref_ids") and top["ref_ids"][0] is not None:
        w.npy(f"{cdir}/ref_ids.npy", t2np(top["ref_ids"][0][0]),
              "text token ids of '<|im_start|>assistant\\n{ref_text}<|im_end|>\\n'", call)
    vcp = top.get("voice_clone_prompt")
    if vcp is not None:
        w.npy(f"{cdir}/ref_spk_embedding.npy", t2np(vcp["ref_spk_embedding"][0]),
              "x-vector placed in the codec track (speaker encoder output of the reference wav)", call)
        if vcp["ref_code"][0] is not None:
            w.npy(f"{cdir}/ref_code.npy", t2np(vcp["ref_code"][0]),
                  "reference codes (frames, 16) from the speech tokenizer's encode of the reference wav", call)
        info["voice_clone_prompt"] = {"x_vector_only_mode": vcp["x_vector_only_mode"][0], "icl_mode": vcp["icl_mode"][0]}
    # --- prompt
    w.npy(f"{cdir}/prompt_embeds.npy", t2np(cap.talker_kwargs["inputs_embeds"][0]),
          "talker prompt input embeddings (positions, talker hidden) passed to talker.generate", call)
    w.npy(f"{cdir}/trailing_text_hidden.npy", t2np(cap.talker_kwargs["trailing_text_hidden"][0]),
          "text-track embeddings added to generated frames 0,1,2,... (after these run out: tts_pad_embed)", call)
    w.npy(f"{cdir}/tts_pad_embed.npy", t2np(cap.talker_kwargs["tts_pad_embed"].reshape(-1)),
          "text_projection(text_embedding(tts_pad_token_id))", call)
    # --- talker logits
    raw = torch.stack(talker_out.logits, dim=1)[0]      # (steps, vocab) raw codec_head logits
    proc = torch.stack(talker_out.scores, dim=1)[0]     # after repetition penalty / min-length / suppression
    w.npy(f"{cdir}/talker_logits_first_step.npy", t2np(raw[0]),
          "raw talker logits (codec_head) at the last prompt position (step 0)", call)
    w.npy(f"{cdir}/talker_logits_steps.npy", t2np(raw[:N_STEP_LOGITS]),
          f"raw talker logits for the first {N_STEP_LOGITS} steps", call)
    w.npy(f"{cdir}/talker_scores_steps.npy", t2np(proc[:N_STEP_LOGITS]),
          f"processed talker scores (repetition penalty 1.05, min_new_tokens 2, suppression) for the first {N_STEP_LOGITS} steps; -inf where suppressed", call)
    w.npy(f"{cdir}/talker_sequence.npy", t2np(sequences),
          "first-codebook tokens sampled by talker.generate, one per step (the last has no sub-codes; eos if it stopped)", call)
    # --- frames
    w.npy(f"{cdir}/codes.npy", t2np(codes), "greedy frames (frames, 16) returned by Qwen3TTSForConditionalGeneration.generate", call)
    w.npy(f"{cdir}/talker_hidden_per_frame.npy", t2np(hidden_list[0]),
          "talker last hidden state (after final norm) that produced each frame's codebook-0 token (input to the code predictor)", call)
    step_inputs = [e for e, _ in cap.talker_inputs[1:1 + N_CP_FRAMES]]
    if step_inputs:
        w.npy(f"{cdir}/talker_step_inputs.npy", t2np(torch.cat(step_inputs, dim=1)[0]),
              f"talker input embedding at decode steps 1..{len(step_inputs)} (sum of the 16 codebook embeddings of frame i + text-track embedding)", call)
    # --- code predictor
    k = min(N_CP_FRAMES, len(cap.cp_calls))
    if k:
        w.npy(f"{cdir}/code_predictor_inputs.npy", t2np(torch.cat([c["inputs_embeds"] for c in cap.cp_calls[:k]], 0)),
              "code-predictor prefill inputs per frame: [talker hidden state, talker codec_embedding(codebook-0 token)] (frames, 2, talker hidden)", call)
        w.npy(f"{cdir}/code_predictor_logits.npy", t2np(torch.cat([c["logits"] for c in cap.cp_calls[:k]], 0)),
              "code-predictor raw logits per frame and step (frames, 15, codebook size): step j predicts codebook j+1 with lm_head[j]", call)
        w.npy(f"{cdir}/code_predictor_tokens.npy", t2np(torch.cat([c["sequences"] for c in cap.cp_calls[:k]], 0)),
              "code-predictor greedy tokens (codebooks 1..15) per frame", call)
    if name in WAV_CASES:
        w.npy(f"{cdir}/wav.npy", np.asarray(wavs[0], dtype=np.float32),
              "the wrapper's returned waveform (speech tokenizer decode of the frames; Base-ICL: reference part cut off)", call)
    w.json(f"{cdir}/case.json", info, "what the case ran and summary facts", call)
    return info


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()

    from qwen_tts import Qwen3TTSModel, Qwen3TTSTokenizer
    from qwen_tts.core.models.modeling_qwen3_tts import mel_spectrogram

    out: Path = args.out.resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    w = Writer(out)

    # 1. text tokenizer + speech tokenizer (shared by all three model types)
    stage = Path(tempfile.mkdtemp(prefix="qwen3tts_stage_"))
    text_dir = stage / "text"
    text_dir.mkdir()
    text_ids, text_len = build_text_tokenizer(text_dir)
    text_vocab_size = int(math.ceil((text_len + 8) / 16) * 16)
    st_dir = stage / "speech_tokenizer"
    build_speech_tokenizer(st_dir)

    # 2. the three checkpoints
    for mt in ("base", "custom_voice", "voice_design"):
        mdir = out / "models" / mt
        build_tts_checkpoint(mt, mdir, text_dir, st_dir, text_ids, text_vocab_size,
                             None if mt == "base" else "../base/speech_tokenizer")
        if mt != "base":
            w.note(f"models/{mt}/speech_tokenizer", "symlink to ../base/speech_tokenizer (same speech tokenizer)",
                   "os.symlink", kind="symlink")
        for f in sorted(Path(r) / n for r, _, names in os.walk(mdir) for n in names):  # symlinks not followed
            if f.is_file():
                w.note(w.rel(f), f"tiny random {mt} checkpoint file (published layout)",
                       "make_fixtures.build_tts_checkpoint", sha256=hashlib.sha256(f.read_bytes()).hexdigest())
    shutil.rmtree(stage)

    # 3. the reference waveform
    pcm = reference_waveform()
    ref_wav = out / "reference_24k.wav"
    sf.write(str(ref_wav), pcm, SAMPLE_RATE, subtype="PCM_16")
    w.note("reference_24k.wav", f"{REF_SECONDS} s synthetic harmonic signal, 24 kHz mono PCM_16 (seed {SEEDS['reference_waveform']})",
           "make_fixtures.reference_waveform", sha256=hashlib.sha256(ref_wav.read_bytes()).hexdigest(),
           samples=int(pcm.shape[0]))
    ref_audio = pcm.astype(np.float32) / 32768.0  # exactly what soundfile/librosa read back

    # 4. speech tokenizer fixtures
    st = Qwen3TTSTokenizer.from_pretrained(str(out / "models" / "base" / "speech_tokenizer"), dtype=torch.float32)
    st.model.eval()
    enc = st.encode(str(ref_wav))
    w.npy("speech_tokenizer/encode_reference_codes.npy", t2np(enc.audio_codes[0]),
          "Qwen3TTSTokenizer.encode(reference_24k.wav).audio_codes[0]: (frames, 16), frames = ceil(36000/1920) = 19",
          "Qwen3TTSTokenizer.from_pretrained('models/base/speech_tokenizer', dtype=torch.float32).encode('reference_24k.wav')")
    with torch.inference_mode():
        mimi_all = st.model.encoder.encode(torch.from_numpy(ref_audio)[None, None, :], return_dict=True).audio_codes
    w.npy("speech_tokenizer/encode_reference_codes_all_quantizers.npy", t2np(mimi_all[0]),
          "raw Mimi encoder codes for all 18 quantizers (quantizers, frames) before the reference keeps the first 16 and trims frames",
          "st.model.encoder.encode(wav[None, None], return_dict=True).audio_codes[0]")
    for n in (40, 330):
        gen = torch.Generator().manual_seed(SEEDS[f"decode_codes_{n}"])
        codes = torch.randint(0, CODEBOOK_SIZE, (n, 16), generator=gen)
        with torch.inference_mode():
            full = st.model.decoder(codes.T[None]).reshape(-1)
            dec, sr = st.decode({"audio_codes": codes})
        w.npy(f"speech_tokenizer/decode_codes_{n}.npy", t2np(codes), f"random code frames ({n}, 16), seed {SEEDS[f'decode_codes_{n}']}",
              f"torch.randint(0, {CODEBOOK_SIZE}, ({n}, 16), generator=torch.Generator().manual_seed({SEEDS[f'decode_codes_{n}']}))")
        w.npy(f"speech_tokenizer/decoder_forward_{n}.npy", t2np(full),
              f"whole-sequence decoder forward (no chunking): {n} * 192 samples, clamped to [-1, 1]",
              f"st.model.decoder(codes.T[None]).reshape(-1)")
        w.npy(f"speech_tokenizer/decode_{n}.npy", np.asarray(dec[0], dtype=np.float32),
              f"reference decode(): chunked_decode(chunk_size=300, left_context_size=25), trimmed to {n} * decode_upsample_rate samples",
              "Qwen3TTSTokenizer.decode({'audio_codes': codes})[0][0]")

    # 5. models + generation cases
    infos = []
    loaded = {}
    for name, mt, method, kwargs, desc in CASES:
        if mt not in loaded:
            loaded.clear()
            tts = Qwen3TTSModel.from_pretrained(str(out / "models" / mt), dtype=torch.float32,
                                                attn_implementation="eager")
            tts.model.eval()
            loaded[mt] = tts
            if mt == "base":
                with torch.inference_mode():
                    mel = mel_spectrogram(torch.from_numpy(ref_audio).unsqueeze(0), n_fft=1024, num_mels=128,
                                          sampling_rate=24000, hop_size=256, win_size=1024, fmin=0, fmax=12000)
                    xvec = tts.model.extract_speaker_embedding(ref_audio, 24000)
                w.npy("speaker_encoder/reference_mel.npy", t2np(mel[0]),
                      "log-mel (128, frames) the speaker encoder sees (n_fft 1024, hop 256, win 1024, fmin 0, fmax 12000, slaney)",
                      "qwen_tts.core.models.modeling_qwen3_tts.mel_spectrogram(wav[None], 1024, 128, 24000, 256, 1024, 0, 12000)")
                w.npy("speaker_encoder/reference_xvector.npy", t2np(xvec),
                      "speaker-encoder x-vector (enc_dim,) of reference_24k.wav",
                      "Qwen3TTSModel.from_pretrained('models/base', dtype=torch.float32).model.extract_speaker_embedding(wav, 24000)")
        infos.append(run_case(w, loaded[mt], name, mt, method, kwargs, desc, ref_wav))
        print(f"{name}: frames={infos[-1]['num_frames']} eos={infos[-1]['stopped_on_eos']} prompt={infos[-1]['prompt_length']}")

    # 6. checkpoint key listing (handy for the re-implementation)
    from safetensors import safe_open
    keys = {}
    for rel in ["models/base/model.safetensors", "models/custom_voice/model.safetensors",
                "models/base/speech_tokenizer/model.safetensors"]:
        with safe_open(str(out / rel), "pt") as f:
            keys[rel] = {k: [list(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()] for k in sorted(f.keys())}
    kpath = out / "checkpoint_keys.json"
    kpath.write_text("{\n" + ",\n".join(
        f"  {json.dumps(rel)}: {{\n" + ",\n".join(f"    {json.dumps(k)}: {json.dumps(v)}" for k, v in d.items()) + "\n  }"
        for rel, d in keys.items()) + "\n}\n")
    w.note("checkpoint_keys.json", "every tensor name, [shape, dtype] in the tiny checkpoints",
           "safetensors.safe_open(...).keys()")

    manifest = {
        "about": "Golden fixtures from the Qwen3-TTS reference package (qwen-tts 0.1.1) on tiny random checkpoints. "
                 "Rebuild with scripts/qwen3_tts_reference/build_env.sh then make_fixtures.py (see its README).",
        "versions": versions(),
        "seeds": SEEDS,
        "settings": {
            "codebook_size": CODEBOOK_SIZE, "talker_vocab_size": TALKER_VOCAB,
            "control_id_shift_from_real": CONTROL_SHIFT, "max_new_tokens": MAX_NEW_TOKENS,
            "greedy": greedy_kwargs(), "dtype": "float32 compute; main-model weights stored bf16, speech tokenizer fp32",
            "attn_implementation": "eager (talker/code predictor); speech tokenizer default (sdpa)",
            "torch_threads": 1, "text_vocab_size": text_vocab_size, "text_token_ids": text_ids,
        },
        "cases": {i["name"]: {k: i[k] for k in ("model", "method", "call", "description", "num_frames", "stopped_on_eos",
                                                "prompt_length", "trailing_text_length", "inputs")} for i in infos},
        "files": dict(sorted(w.entries.items())),
    }
    for rel, entry in manifest["files"].items():
        if "sha256" not in entry and entry.get("kind") != "symlink":
            entry["sha256"] = hashlib.sha256((out / rel).read_bytes()).hexdigest()
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=False, ensure_ascii=False) + "\n")
    for r, _, names in os.walk(out):
        for n in names:
            if not os.path.islink(os.path.join(r, n)):
                os.chmod(os.path.join(r, n), 0o644)
    total = sum(os.path.getsize(os.path.join(r, n)) for r, _, names in os.walk(out) for n in names)
    print(f"wrote {len(manifest['files']) + 1} files, {total / 1e6:.2f} MB, to {out}")


if __name__ == "__main__":
    main()
