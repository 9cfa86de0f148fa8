#!/usr/bin/env python
"""Golden fixtures for the Kyutai TTS family (delayed streams modeling), made with the reference
package ``moshi`` 0.2.13.

Run with the reference environment's interpreter (see build_env.sh):

    /work/kyutai-ref-venv/bin/python scripts/kyutai_tts_reference/make_fixtures.py

It writes a TINY random model laid out like the published ``kyutai/tts-1.6b-en_fr`` repository
(``config.json`` with ``tts_config`` and ``model_id``, the language model's and Mimi's weights as
safetensors, a SentencePiece text tokenizer trained here, and ``voices/`` holding speaker
embedding files named as in the published voice repository), in two variants: one trained "with
CFG distillation" (a ``cfg`` condition) and one without (guidance doubles the batch). It then
loads them back through the package (``loaders.CheckpointInfo``,
``TTSModel.from_checkpoint_info``) and records what the reference computes for several cases:
greedy frames, the sampled and fed text tokens, end steps, consumption times and transcripts,
per-step text and depth logits, and the audio as ``TTSModel.simple_generate`` makes it.

This script only calls the reference; it contains none of its code. The per-step logits are read
by wrapping the package's own ``sample_token`` (which receives every logit tensor the generation
samples from), and greedy decoding is asked of the package's ``LMGen`` (``use_sampling=False``).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import shutil
import sys
import tempfile
from importlib import metadata
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "tests" / "fixtures" / "kyutai_tts"

SEEDS = {"lm_distilled": 3001, "lm_plain": 3002, "mimi": 3003, "voices": 3004}
TEXT_VOCAB = 384                 # published: 8000
CARD = 64                        # audio codebook size; published: 2048
N_Q = 8                          # audio codebooks; published: 32
AUDIO_DELAY_S = 0.48             # 6 frames at 12.5 Hz; published 1.28 s (16 frames)
CONTEXT = 32                     # the backbone's attention window; published: unverified
VOICE_DIM, VOICE_FRAMES = 24, 10  # a voice file's speaker_wavs: [1, VOICE_DIM, VOICE_FRAMES]
MODEL_ID = {"sig": "d5a1c0de", "epoch": 7}
N_TEXT_LOGIT_STEPS = 12          # text logits kept for the first steps of each case
N_DEPTH_LOGIT_STEPS = 2          # depth logits kept for the first steps that run the depth transformer
# A random model's greedy text head picks the same id at every step (its hidden states are
# dominated by the constant condition vectors), so the state machine would only ever force words.
# tune_text_head rewrites the head's new-word and pad rows from the model's own hidden states:
# both large along their mean (above every other id) and split along their main varying direction,
# so that the model asks for some words itself and pads before others.
TEXT_HEAD_COMMON_LOGIT = 3.5
TEXT_HEAD_SPLIT_LOGIT = 2.5

TEXT_CORPUS = [
    "Hello world, this is a tiny test of streaming speech.",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Bonjour tout le monde, ceci est un petit essai de parole.",
    "Streaming text arrives word by word while the voice keeps speaking.",
    "How are you today? I am fine, thank you very much for asking.",
    "Numbers like one, two and three are read aloud in order.",
    "Le renard brun saute par dessus le chien paresseux.",
    "A long sentence keeps the model busy past its attention window, on and on, until the end.",
]


def lm_config(distilled: bool) -> dict:
    """The language model's configuration in the published layout (keys of moshi's LMModel and
    loaders), at a tiny size."""
    conditioners = {
        "speaker_wavs": {"type": "tensor", "tensor": {"dim": VOICE_DIM}},
        "control": {"type": "lut", "lut": {"n_bins": 4, "dim": 16, "tokenizer": "noop",
                                           "possible_values": ["ok"]}},
    }
    summed = ["control"]
    if distilled:
        conditioners["cfg"] = {"type": "lut", "lut": {
            "n_bins": 8, "dim": 16, "tokenizer": "noop",
            "possible_values": ["1.0", "1.5", "2.0", "2.5", "3.0", "3.5", "4.0"]}}
        summed.append("cfg")
    return {
        "moshi_name": "dsm_tts_tiny.safetensors",
        "mimi_name": "mimi_tiny.safetensors",
        "mimi_config_name": "mimi_config.json",
        "tokenizer_name": f"tokenizer_spm_{TEXT_VOCAB}_en_fr.model",
        "model_id": dict(MODEL_ID),
        "tts_config": {"audio_delay": AUDIO_DELAY_S, "second_stream_ahead": 2},
        "dim": 64,
        "text_card": TEXT_VOCAB,
        "existing_text_padding_id": 3,
        "n_q": N_Q,
        "dep_q": N_Q,
        "card": CARD,
        "num_heads": 4,
        "num_layers": 2,
        "hidden_scale": 4.125,
        "causal": True,
        "layer_scale": None,
        "context": CONTEXT,
        "max_period": 10000,
        "gating": "silu",
        "norm": "rms_norm_f32",
        "positional_embedding": "rope",
        "depformer_dim": 32,
        "depformer_dim_feedforward": 96,
        "depformer_num_heads": 2,
        "depformer_num_layers": 2,
        "depformer_layer_scale": None,
        "depformer_multi_linear": True,
        "depformer_context": N_Q,
        "depformer_max_period": 10000,
        "depformer_gating": "silu",
        "depformer_pos_emb": "none",
        "depformer_weights_per_step": True,
        "depformer_weights_per_step_schedule": [0, 1, 2, 3, 4, 4, 5, 5],
        "depformer_low_rank_embeddings": 16,
        "delays": [0, 0] + [2] * (N_Q - 1),
        "demux_second_stream": True,
        "cross_attention": True,
        "conditioners": conditioners,
        "fuser": {"sum": summed, "cross": ["speaker_wavs"], "prepend": [],
                  "cross_attention_pos_emb": True, "cross_attention_pos_emb_scale": 1.0},
    }


MIMI_CONFIG = {
    "sample_rate": 24000,
    "channels": 1,
    "frame_rate": 12.5,
    "seanet": {"channels": 1, "dimension": 32, "causal": True, "n_filters": 4, "n_residual_layers": 1,
               "activation": "ELU", "compress": 2, "dilation_base": 2, "disable_norm_outer_blocks": 0,
               "kernel_size": 7, "residual_kernel_size": 3, "last_kernel_size": 3, "norm": "none",
               "pad_mode": "constant", "ratios": [8, 6, 5, 4], "true_skip": True},
    "quantizer": {"dimension": 16, "n_q": N_Q, "bins": CARD, "input_dimension": 32, "output_dimension": 32},
    "transformer": {"d_model": 32, "num_heads": 2, "num_layers": 2, "causal": True, "layer_scale": 0.01,
                    "context": 250, "conv_layout": True, "max_period": 10000, "gating": "none",
                    "norm": "layer_norm", "positional_embedding": "rope", "dim_feedforward": 64,
                    "input_dimension": 32, "output_dimensions": [32]},
}

VOICES = ["expresso/ex03-ex01_happy_001_channel1_334s", "vctk/p225_023"]


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------

class Writer:
    def __init__(self, root: Path):
        self.root = root
        self.manifest: dict = {"files": {}}

    def _record(self, rel: str, desc: str, call: str, **extra):
        data = (self.root / rel).read_bytes()
        self.manifest["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "desc": desc,
                                       "call": call, **extra}

    def npy(self, rel: str, array: np.ndarray, desc: str, call: str = ""):
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, array, allow_pickle=False)
        self._record(rel, desc, call, shape=list(array.shape), dtype=str(array.dtype))

    def json(self, rel: str, obj, desc: str, call: str = ""):
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")
        self._record(rel, desc, call)

    def note(self, rel: str, desc: str, call: str = ""):
        self._record(rel, desc, call)


def versions() -> dict:
    return {name: metadata.version(name) for name in ("moshi", "torch", "sentencepiece", "safetensors", "numpy")}


# ---------------------------------------------------------------------------------------------
# The tiny checkpoint
# ---------------------------------------------------------------------------------------------

def train_tokenizer(out: Path) -> Path:
    import sentencepiece as spm

    corpus = out / "corpus.txt"
    corpus.write_text("\n".join(TEXT_CORPUS * 4) + "\n")
    prefix = out / f"tokenizer_spm_{TEXT_VOCAB}_en_fr"
    # Ids 0-3 are the model's special text tokens (new word 0, main speaker 1, other speaker 2,
    # pad 3), so the tokenizer's own specials sit there and a word's pieces start at 4; unknown
    # characters fall back to bytes.
    # Relative names: the model file records its trainer's arguments, and a temporary folder's name
    # would make it differ from run to run.
    here = Path.cwd()
    os.chdir(out)
    try:
        spm.SentencePieceTrainer.train(
            input=corpus.name, model_prefix=prefix.name, vocab_size=TEXT_VOCAB, model_type="bpe",
            unk_id=0, bos_id=1, eos_id=2, pad_id=3, byte_fallback=True, character_coverage=1.0,
            num_threads=1, minloglevel=2, shuffle_input_sentence=False)
    finally:
        os.chdir(here)
    corpus.unlink()
    (out / f"{prefix.name}.vocab").unlink()
    return prefix.with_suffix(".model")


def perturb_norms(module: torch.nn.Module, gen: torch.Generator) -> None:
    """Norm scales drawn around 1 (the package initialises them to exactly 1, which would hide a
    scale read from the wrong place)."""
    for name, param in module.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "alpha" or (leaf == "weight" and ".norm" in name and param.dim() == 1):
            param.data = 1.0 + 0.1 * torch.randn(param.shape, generator=gen)
        elif leaf == "bias" and ".norm" in name:
            param.data = 0.1 * torch.randn(param.shape, generator=gen)


def fused_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights named as published checkpoints name them: each attention's per-step
    input and output projections fused (``in_proj_weight``, ``out_proj.weight``), which the
    package's load hook splits again."""
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    fused: dict[str, list[tuple[int, torch.Tensor]]] = {}
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        for part, target in ((".in_projs.", "in_proj_weight"), (".out_projs.", "out_proj.weight")):
            if part in key:
                prefix, rest = key.split(part)
                index = int(rest.split(".")[0])
                fused.setdefault(f"{prefix}.{target}", []).append((index, value))
                break
        else:
            out[key] = value
    for key, parts in fused.items():
        out[key] = torch.cat([value for _, value in sorted(parts, key=lambda p: p[0])], dim=0)
    return out


def build_lm(cfg: dict, seed: int, path: Path) -> None:
    from moshi.models import loaders

    torch.manual_seed(seed)
    lm_kwargs = {k: v for k, v in copy.deepcopy(cfg).items()
                 if k not in ("moshi_name", "mimi_name", "mimi_config_name", "tokenizer_name", "model_id", "tts_config")}
    lm = loaders.get_moshi_lm(None, lm_kwargs=lm_kwargs, device="cpu", dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    perturb_norms(lm, gen)
    save_lm(lm, path)


def save_lm(lm: torch.nn.Module, path: Path) -> None:
    state = {k: v.to(torch.bfloat16) if v.dtype.is_floating_point else v for k, v in fused_state(lm).items()}
    save_file(state, str(path))


def build_mimi(path: Path) -> None:
    from moshi.models import loaders

    torch.manual_seed(SEEDS["mimi"])
    mimi = loaders.get_mimi(None, copy.deepcopy(MIMI_CONFIG), device="cpu", num_codebooks=N_Q)
    gen = torch.Generator().manual_seed(SEEDS["mimi"] + 1)
    for name, buffer in mimi.named_buffers():
        if name.endswith("embedding_sum"):
            buffer.copy_(torch.randn(buffer.shape, generator=gen))
        elif name.endswith("cluster_usage"):
            buffer.copy_(0.5 + torch.rand(buffer.shape, generator=gen))
        elif name.endswith("_initialized"):
            buffer.fill_(1.0)
    state = {k: v.detach().clone().contiguous() for k, v in mimi.state_dict().items()}
    save_file(state, str(path))


def build_voices(model_dir: Path) -> None:
    gen = torch.Generator().manual_seed(SEEDS["voices"])
    for voice in VOICES:
        path = model_dir / "voices" / f"{voice}.wav.{MODEL_ID['sig']}@{MODEL_ID['epoch']}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({"speaker_wavs": torch.randn(1, VOICE_DIM, VOICE_FRAMES, generator=gen)}, str(path))


def build_checkpoint(model_dir: Path, tokenizer: Path, mimi: Path, distilled: bool) -> dict:
    model_dir.mkdir(parents=True)
    cfg = lm_config(distilled)
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    (model_dir / "mimi_config.json").write_text(json.dumps(MIMI_CONFIG, indent=1) + "\n")
    if distilled:
        shutil.copy(tokenizer, model_dir / cfg["tokenizer_name"])
        shutil.copy(mimi, model_dir / cfg["mimi_name"])
    else:  # one copy of the shared files (size budget): the plain model links to the distilled one's
        for name in (cfg["tokenizer_name"], cfg["mimi_name"]):
            (model_dir / name).symlink_to(Path("..") / "distilled" / name)
    build_lm(cfg, SEEDS["lm_distilled" if distilled else "lm_plain"], model_dir / cfg["moshi_name"])
    build_voices(model_dir)
    tune_text_head(model_dir, cfg)
    return cfg


def tune_text_head(model_dir: Path, cfg: dict) -> None:
    """See TEXT_HEAD_COMMON_LOGIT: the hidden states come from a greedy generation of the
    reference (both voices, the long corpus line), read where ``forward_text`` returns them."""
    tts = load_tts(model_dir)
    distilled = bool(tts.valid_cfg_conditionings)
    if not distilled:
        tts.cfg_coef = 2.0
    lm = tts.lm
    hidden: list[torch.Tensor] = []
    original = lm.forward_text

    def recording(*args, **kwargs):
        out, logits = original(*args, **kwargs)
        hidden.append(out.detach().reshape(-1, out.shape[-1]).clone())
        return out, logits

    lm.forward_text = recording
    voices = [model_dir / "voices" / f"{v}.wav.{MODEL_ID['sig']}@{MODEL_ID['epoch']}.safetensors" for v in VOICES]
    attributes = [tts.make_condition_attributes([v], cfg_coef=2.0 if distilled else None) for v in voices]
    entries = [tts.prepare_script([TEXT_CORPUS[-1]], padding_between=1) for _ in voices]
    tts.generate(entries, attributes, use_sampling=False)
    lm.forward_text = original
    # Steps before the audio starts (the text-to-audio delay) look alike and unlike the rest: the
    # split is drawn from the steps after them.
    states = torch.cat(hidden[tts.delay_steps + 2:])
    mean = states.mean(0)
    unit = mean / mean.norm()
    spread = states - mean
    direction = torch.linalg.svd(spread, full_matrices=False).Vh[0]
    direction = direction - (direction @ unit) * unit  # no share of the constant part
    direction = direction / (spread @ direction).std()
    common = unit * (TEXT_HEAD_COMMON_LOGIT / float((states @ unit).mean()))
    with torch.no_grad():
        lm.text_linear.weight[0] = common + TEXT_HEAD_SPLIT_LOGIT * direction
        lm.text_linear.weight[3] = common - TEXT_HEAD_SPLIT_LOGIT * direction
    save_lm(lm, model_dir / cfg["moshi_name"])


# ---------------------------------------------------------------------------------------------
# Running the reference
# ---------------------------------------------------------------------------------------------

def load_tts(model_dir: Path, **kwargs):
    from moshi.models import loaders
    from moshi.models.tts import TTSModel

    cfg = json.loads((model_dir / "config.json").read_text())
    info = loaders.CheckpointInfo.from_hf_repo(
        "local", moshi_weights=model_dir / cfg["moshi_name"], mimi_weights=model_dir / cfg["mimi_name"],
        tokenizer=model_dir / cfg["tokenizer_name"], config_path=model_dir / "config.json",
        mimi_config_path=model_dir / "mimi_config.json")
    # TTSModel's default n_q is the published 32; the tiny model has N_Q.
    kwargs.setdefault("n_q", N_Q)
    return TTSModel.from_checkpoint_info(info, device="cpu", dtype=torch.float32,
                                         voice_repo=str(model_dir / "voices"), **kwargs)


class Recorder:
    """Wraps the package's ``sample_token`` (as bound in moshi.models.lm) to keep every logit
    tensor a generation samples from, in call order: per step the text logits, then (once the
    depth transformer runs) one call per codebook."""

    def __init__(self):
        import moshi.models.lm as lm_module

        self.module = lm_module
        self.original = lm_module.sample_token
        self.calls: list[torch.Tensor] = []

    def __enter__(self):
        def wrapped(logits, *args, **kwargs):
            self.calls.append(logits.detach().float().clone())
            return self.original(logits, *args, **kwargs)

        self.module.sample_token = wrapped
        return self

    def __exit__(self, *exc):
        self.module.sample_token = self.original


def split_calls(calls: list[torch.Tensor], text_card: int) -> list[dict]:
    """Per step: {"text": [B, text_card], "depth": [dep_q, B, card] or None}."""
    steps: list[dict] = []
    for logits in calls:
        flat = logits.reshape(logits.shape[0], -1)
        if flat.shape[1] == text_card:
            steps.append({"text": flat, "depth": []})
        else:
            steps[-1]["depth"].append(flat)
    for step in steps:
        step["depth"] = torch.stack(step["depth"]) if step["depth"] else None
    return steps


def decode_like_simple_generate(tts, frames: list[torch.Tensor], end_steps: list[int | None]) -> list[np.ndarray]:
    """The audio ``simple_generate`` returns for these frames: Mimi decodes the frames after the
    text-to-audio delay in streaming mode, clipped to [-1, 1]; the first two frames' audio is
    dropped and each item is cut at its end step."""
    with tts.mimi.streaming(frames[0].shape[0]), torch.no_grad():
        pcms = [torch.clip(tts.mimi.decode(frame[:, 1:, :]), -1, 1) for frame in frames[tts.delay_steps:]]
    pcms = pcms[2:]
    return [torch.cat([pcm[i, 0, :] for pcm in pcms[:end_steps[i]]]).numpy().astype(np.float32)
            for i in range(frames[0].shape[0])]


def greedy_lmgen():
    """The package's LMGen asked for greedy decoding (its argument ``use_sampling``), for the
    calls that do not pass their own arguments to it (``simple_generate``)."""
    import moshi.models.tts as tts_module

    original = tts_module.LMGen

    class Greedy(original):
        def __init__(self, *args, **kwargs):
            kwargs["use_sampling"] = False
            super().__init__(*args, **kwargs)

    return tts_module, original, Greedy


CASES = [
    # name, checkpoint, script (a list of turns per item), voices, settings, description
    ("distilled_one", "distilled", [["Hello world, this is a tiny test."]], [VOICES[0]], {},
     "one text, one voice; guidance 2.0 given as the distilled condition"),
    ("plain_cfg", "plain", [["Hello world, this is a tiny test."]], [VOICES[0]], {"cfg_coef": 2.0},
     "a model without the cfg condition: guidance 2.0 doubles the batch (the null half without text or voice)"),
    ("plain_no_cfg", "plain", [["Bonjour tout le monde."]], [VOICES[1]], {"cfg_coef": 1.0},
     "a model without the cfg condition, guidance off"),
    ("distilled_batch", "distilled", [["Hello world, this is a tiny test."], ["How are you today?"]],
     VOICES, {}, "two texts and two voices in one batch"),
    ("distilled_nq4", "distilled", [["The quick brown fox jumps."]], [VOICES[0]], {"n_q": 4},
     "four of the model's eight codebooks"),
    ("distilled_turns_break", "distilled",
     [["Hi there. <break time=\"0.4s\"/> How are you?", "Fine, thanks."]], [VOICES[0]], {},
     "two speaker turns and a break of 0.4 s (5 frames)"),
    ("distilled_break", "distilled", [["Hi there. <break time=\"0.4s\"/> How are you?"]], [VOICES[1]], {},
     "one turn with a break of 0.4 s (5 frames)"),
    ("distilled_padding_bonus", "distilled", [["Hello world, this is a tiny test."]], [VOICES[0]],
     {"padding_bonus": 10.0}, "a padding bonus of 10 on the text logits' pad (about the tiny model's margin for a new word)"),
    ("plain_other_ids", "plain", [["How are you today?"]], [VOICES[1]], {"cfg_coef": 2.0, "padding_bonus": -8.0},
     "a negative padding bonus: the model samples ids other than pad and new word, which the state machine "
     "reads as pad"),
    ("distilled_dialog", "distilled",
     [["Hi there. <break time=\"0.4s\"/> How are you?", "I am fine, thank you.", "The quick brown fox."],
      ["", "Bonjour tout le monde.", "How are you today?"]],
     [VOICES, VOICES[::-1]], {},
     "two dialogues batched, each in two voices (the main speaker's first): three turns with a break, and "
     "three turns starting with the other speaker (an empty first turn)"),
    ("distilled_long", "distilled",
     [["A long sentence keeps the model busy past its attention window, on and on, until the end of it all."]],
     [VOICES[1]], {}, f"a generation longer than the attention window ({CONTEXT} positions)"),
]


def run_case(w: Writer, model_dir: Path, name: str, script_batch, voices, settings, desc) -> dict:
    cfg_coef = settings.get("cfg_coef", 2.0)
    n_q = settings.get("n_q", N_Q)
    tts = load_tts(model_dir, n_q=n_q, padding_bonus=settings.get("padding_bonus", 0.0))
    distilled = bool(tts.valid_cfg_conditionings)
    if not distilled:
        tts.cfg_coef = cfg_coef
    entries = [tts.prepare_script(script, padding_between=1) for script in script_batch]
    # An item's voices: one name, or a dialogue's (the main speaker's first).
    item_voices = [[v] if isinstance(v, str) else list(v) for v in voices]
    voice_paths = [[Path(tts.get_voice_path(str(model_dir / "voices" / v) + ".wav")) for v in names]
                   for names in item_voices]
    attributes = [tts.make_condition_attributes(paths, cfg_coef=cfg_coef if distilled else None)
                  for paths in voice_paths]
    with Recorder() as recorder:
        result = tts.generate(entries, attributes, use_sampling=False)
    steps = split_calls(recorder.calls, tts.lm.text_card)
    frames = result.frames
    audio = decode_like_simple_generate(tts, frames, result.end_steps)
    base = f"cases/{name}/"
    voices_arg = "[voice]" if all(len(names) == 1 for names in item_voices) else "voices"
    call = (f"TTSModel.generate(prepare_script(script, padding_between=1), make_condition_attributes({voices_arg}, "
            f"cfg_coef={cfg_coef if distilled else None}), use_sampling=False) with TTSModel(n_q={n_q}, "
            f"padding_bonus={settings.get('padding_bonus', 0.0)}, cfg_coef={tts.cfg_coef})")
    stacked = torch.stack([f[:, :, 0] for f in frames]).numpy().astype(np.int64)   # [T, B, 1 + n_q]
    w.npy(base + "frames.npy", stacked, "the generation's frames, [step, item, text + codebooks]; the acoustic "
          "delay undone (step s holds the codes of frame s); -1 = zero token, -2 = not generated", call)
    w.npy(base + "text_tokens.npy", np.array(result.logged_text_tokens, dtype=np.int64),
          "per item and step: (the text token sampled, the token fed back after the state machine)", call)
    w.npy(base + "text_logits.npy", torch.stack([s["text"] for s in steps[:N_TEXT_LOGIT_STEPS]]).numpy(),
          "the text logits sampled from (after guidance and the padding bonus), [step, item, text_card]", call)
    depth_steps = [i for i, s in enumerate(steps) if s["depth"] is not None][:N_DEPTH_LOGIT_STEPS]
    w.npy(base + "depth_logits.npy", torch.stack([steps[i]["depth"] for i in depth_steps]).numpy(),
          "the depth transformer's logits sampled from (after guidance), [step, codebook, item, card], for the "
          f"steps {depth_steps}", call)
    for index, pcm in enumerate(audio):
        w.npy(base + f"audio_{index}.npy", pcm, "the item's audio as simple_generate makes it from these frames "
              "(24 kHz float32)", "Mimi streaming decode of frames[delay_steps:], clipped, [2:], cut at end_step")
    summary = {
        "description": desc, "checkpoint": model_dir.name, "script": script_batch, "voices": voices,
        "settings": {"cfg_coef": cfg_coef, "n_q": n_q, "padding_bonus": settings.get("padding_bonus", 0.0),
                     "padding_between": 1, "greedy": True, "distilled": distilled},
        "entries": [[{"tokens": e.tokens, "text": e.text, "padding": e.padding} for e in item] for item in entries],
        "end_steps": result.end_steps, "consumption_times": result.all_consumption_times,
        "transcripts": result.all_transcripts, "steps": len(steps),
        "frames": len(frames), "depth_logit_steps": depth_steps, "delay_steps": tts.delay_steps,
        "audio_samples": [int(pcm.shape[0]) for pcm in audio],
    }
    w.json(base + "case.json", summary, desc, call)
    return {"tts": tts, "result": result, "audio": audio, "voices": voice_paths, "script": script_batch,
            "cfg_coef": cfg_coef}


def check_simple_generate(model_dir: Path, case: dict) -> None:
    """simple_generate (greedy) gives the audio recorded from generate's frames, bit for bit."""
    tts_module, original, greedy = greedy_lmgen()
    tts = load_tts(model_dir, n_q=N_Q)
    tts_module.LMGen = greedy
    try:
        texts = [script[0] for script in case["script"]]
        pcms = tts.simple_generate(texts if len(texts) > 1 else texts[0],
                                   [str(p[0]) for p in case["voices"]] if len(texts) > 1 else str(case["voices"][0][0]),
                                   cfg_coef=case["cfg_coef"], show_progress=False)
    finally:
        tts_module.LMGen = original
    for ours, theirs in zip(case["audio"], pcms):
        if not np.array_equal(ours, theirs.numpy()):
            raise SystemExit("simple_generate's audio differs from the frames' decode")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    out: Path = args.out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    w = Writer(out)
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        tokenizer = train_tokenizer(scratch)
        build_mimi(scratch / "mimi_tiny.safetensors")
        models = {}
        for variant in ("distilled", "plain"):  # distilled first: plain links to its shared files
            model_dir = out / "models" / variant
            build_checkpoint(model_dir, tokenizer, scratch / "mimi_tiny.safetensors", variant == "distilled")
            models[variant] = model_dir
            for path in sorted(model_dir.rglob("*")):
                if path.is_file() and not path.is_symlink():
                    w.note(str(path.relative_to(out)), "tiny checkpoint file, published layout")
        w.manifest["config"] = {"distilled": lm_config(True), "plain": lm_config(False), "mimi": MIMI_CONFIG}
        results = {}
        for name, variant, script, voices, settings, desc in CASES:
            results[name] = run_case(w, models[variant], name, script, voices, settings, desc)
            print(f"{name}: end steps {results[name]['result'].end_steps}, frames {len(results[name]['result'].frames)}",
                  flush=True)
        for name in ("distilled_one", "plain_cfg", "distilled_batch"):
            check_simple_generate(models[CASES[[c[0] for c in CASES].index(name)][1]], results[name])
        # The tokenizer's pieces for the texts used, so the engine's tokenization is checked too.
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=str(models["distilled"] / lm_config(True)["tokenizer_name"]))
        words = sorted({word for line in TEXT_CORPUS for word in line.split()})
        w.json("tokenizer_words.json", {word: sp.encode(word) for word in words},
               "SentencePieceProcessor.encode of each corpus word", "sp.encode(word)")
    w.manifest["versions"] = versions()
    w.manifest["seeds"] = SEEDS
    w.manifest["python"] = sys.version.split()[0]
    (out / "manifest.json").write_text(json.dumps(w.manifest, indent=1, sort_keys=True) + "\n")
    print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
