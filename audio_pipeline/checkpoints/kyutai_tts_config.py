"""The configuration of a Kyutai TTS checkpoint (delayed streams modeling), as its ``config.json``
lays it out: the language model's keywords beside the files it names (``moshi_name``,
``mimi_name``, ``tokenizer_name``, optionally ``mimi_config_name``), ``model_id`` (the voice files'
signature) and ``tts_config`` (the text-to-audio delay, the text lookahead).

Only what the family runs is accepted: a causal backbone with rotary positions, gated feed-forward
layers, a depth transformer that generates every codebook, per-step depth weights. Anything else
is refused here, naming the key, rather than computed wrongly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Mimi's frame rate (frames a second): the family's step rate.
FRAME_RATE = 12.5


def is_kyutai_tts_config(raw: Any) -> bool:
    """Whether a parsed config.json is a Kyutai TTS checkpoint's (a ``tts_config`` beside the
    language model's ``dep_q``)."""
    return isinstance(raw, dict) and isinstance(raw.get("tts_config"), dict) and "dep_q" in raw


@dataclass(frozen=True)
class DsmConfig:
    """What the model and its state machine read from the checkpoint's config.json."""

    dim: int
    num_heads: int
    num_layers: int
    kv_repeat: int
    text_card: int
    card: int
    n_q: int
    delays: tuple[int, ...]
    context: int | None
    max_period: float
    norm: str
    gating: str
    hidden_scale: float
    demux_second_stream: bool
    cross_attention: bool
    depformer_dim: int
    depformer_num_heads: int
    depformer_num_layers: int
    depformer_dim_feedforward: int
    depformer_multi_linear: bool
    depformer_schedule: tuple[int, ...]
    depformer_low_rank: int | None
    depformer_gating: str
    conditioners: dict
    fuser: dict
    audio_delay_steps: int
    second_stream_ahead: int
    model_id: dict
    moshi_name: str
    mimi_name: str
    tokenizer_name: str
    mimi_config_name: str | None

    @property
    def depformer_weights(self) -> int:
        """The depth transformer's weight sets (the schedule maps each codebook to one)."""
        return max(self.depformer_schedule) + 1

    @property
    def voice_suffix(self) -> str:
        """The ending of this checkpoint's voice files: ``<name>.wav`` + ``.<sig>@<epoch>.safetensors``."""
        if not self.model_id:
            return ".safetensors"
        return f".{self.model_id['sig']}@{self.model_id['epoch']}.safetensors"

    @property
    def distilled_guidance(self) -> bool:
        """Whether guidance is a condition (trained with CFG distillation) rather than a doubled batch."""
        return "cfg" in self.conditioners

    @property
    def cfg_values(self) -> tuple[float, ...]:
        """The guidance values a distilled model takes as its condition."""
        if not self.distilled_guidance:
            return ()
        lut = self.conditioners["cfg"]["lut"]
        return tuple(float(v) for v in lut.get("possible_values") or ())

    @property
    def multi_speaker(self) -> bool:
        """Whether voices condition the model through cross-attention (``speaker_wavs``)."""
        return "speaker_wavs" in self.conditioners


def _get(raw: dict, key: str, default: Any = None) -> Any:
    return raw[key] if key in raw else default


def read_dsm_config(model_dir: Path | str) -> DsmConfig:
    """The DsmConfig of a checkpoint directory; ValueError naming the key of anything unsupported."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"Kyutai TTS config.json not found in {model_dir}")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not is_kyutai_tts_config(raw):
        raise ValueError(f"{model_dir}/config.json is not a Kyutai TTS checkpoint's (no tts_config and dep_q)")
    return dsm_config(raw)


def dsm_config(raw: dict) -> DsmConfig:
    def refuse(key: str, why: str) -> None:
        raise ValueError(f"Kyutai TTS config.json: {key} {why}")

    n_q, dep_q = int(raw["n_q"]), int(raw["dep_q"])
    if dep_q != n_q:
        refuse("dep_q", f"is {dep_q}: only models whose depth transformer generates every codebook (dep_q = n_q "
                        f"= {n_q}) are served")
    delays = tuple(int(d) for d in raw["delays"])
    if len(delays) != n_q + 1 or delays[0] != 0:
        refuse("delays", f"must list the text stream's delay (0) and one per codebook ({n_q + 1} in all)")
    if _get(raw, "positional_embedding", "sin") != "rope":
        refuse("positional_embedding", "must be rope")
    if _get(raw, "depformer_pos_emb", "sin") != "none":
        refuse("depformer_pos_emb", "must be none")
    if not _get(raw, "causal", True):
        refuse("causal", "must be true")
    if not _get(raw, "depformer_weights_per_step", False):
        refuse("depformer_weights_per_step", "must be true")
    for key in ("gating", "depformer_gating"):
        if _get(raw, key, "none") == "none":
            refuse(key, "must name an activation (gated feed-forward layers)")
    for key in ("layer_scale", "depformer_layer_scale"):
        if _get(raw, key) is not None:
            refuse(key, "must be null")
    if _get(raw, "norm_emb", False):
        refuse("norm_emb", "must be false")
    if _get(raw, "bias_proj", False):
        refuse("bias_proj", "must be false")
    norm = _get(raw, "norm", "layer_norm")
    if norm not in ("rms_norm_f32", "rms_norm", "layer_norm", "layer_norm_f32"):
        refuse("norm", f"{norm!r} is not one of rms_norm_f32, rms_norm, layer_norm, layer_norm_f32")
    if _get(raw, "depformer_norm") is not None:
        refuse("depformer_norm", "must be null")
    tts = raw["tts_config"]
    if tts.get("multistream"):
        refuse("tts_config.multistream", "is not supported")
    schedule = _get(raw, "depformer_weights_per_step_schedule") or list(range(dep_q))
    if len(schedule) != dep_q:
        refuse("depformer_weights_per_step_schedule", f"must have {dep_q} entries")
    dim = int(raw["dim"])
    hidden_scale = float(_get(raw, "hidden_scale", 4))
    depformer_dim = int(raw["depformer_dim"])
    feedforward = _get(raw, "depformer_dim_feedforward")
    if isinstance(feedforward, list):
        refuse("depformer_dim_feedforward", "must be one number")
    conditioners = dict(_get(raw, "conditioners") or {})
    fuser = dict(_get(raw, "fuser") or {})
    for name, spec in conditioners.items():
        if spec.get("type") not in ("lut", "tensor"):
            refuse(f"conditioners.{name}.type", "must be lut or tensor")
        if spec.get("type") == "lut" and spec["lut"].get("tokenizer", "noop") != "noop":
            refuse(f"conditioners.{name}.lut.tokenizer", "must be noop")
    if fuser.get("prepend"):
        refuse("fuser.prepend", "is not supported")
    return DsmConfig(
        dim=dim, num_heads=int(raw["num_heads"]), num_layers=int(raw["num_layers"]),
        kv_repeat=int(_get(raw, "kv_repeat", 1)), text_card=int(raw["text_card"]), card=int(raw["card"]), n_q=n_q,
        delays=delays, context=_get(raw, "context"), max_period=float(_get(raw, "max_period", 10000)), norm=norm,
        gating=raw["gating"], hidden_scale=hidden_scale,
        demux_second_stream=bool(_get(raw, "demux_second_stream", False)),
        cross_attention=bool(_get(raw, "cross_attention", False)),
        depformer_dim=depformer_dim, depformer_num_heads=int(_get(raw, "depformer_num_heads", 8)),
        depformer_num_layers=int(_get(raw, "depformer_num_layers", 2)),
        depformer_dim_feedforward=int(feedforward if feedforward is not None else hidden_scale * depformer_dim),
        depformer_multi_linear=bool(_get(raw, "depformer_multi_linear", False)),
        depformer_schedule=tuple(int(i) for i in schedule),
        depformer_low_rank=_get(raw, "depformer_low_rank_embeddings"),
        depformer_gating=_get(raw, "depformer_gating", raw["gating"]),
        conditioners=conditioners, fuser=fuser,
        audio_delay_steps=int(float(tts.get("audio_delay", 0.0)) * FRAME_RATE),
        second_stream_ahead=int(tts.get("second_stream_ahead", 0)),
        model_id=dict(_get(raw, "model_id") or {}),
        moshi_name=_get(raw, "moshi_name", "model.safetensors"),
        mimi_name=_get(raw, "mimi_name", "tokenizer-e351c8d8-checkpoint125.safetensors"),
        tokenizer_name=_get(raw, "tokenizer_name", "tokenizer_spm_32k_3.model"),
        mimi_config_name=_get(raw, "mimi_config_name"))


#: Where a checkpoint directory keeps its voices (laid out as Kyutai's voice repository).
VOICES_DIR = "voices"


def voice_files(model_dir: Path | str, config: DsmConfig) -> list[tuple[str, Path]]:
    """The checkpoint's voices as (name, file), sorted by name: each speaker embedding file under
    ``voices/`` whose name ends with the checkpoint's suffix (``<name>.wav.<sig>@<epoch>.safetensors``),
    named by its path below ``voices/`` without that ending (``expresso/ex03-ex01_happy_001_channel1_334s``).
    The layout and the model both number voices by this order."""
    root = Path(model_dir) / VOICES_DIR
    if not root.is_dir():
        return []
    ending = ".wav" + config.voice_suffix
    found = []
    for path in root.rglob("*" + ending):
        if path.is_file():
            found.append((path.relative_to(root).as_posix()[:-len(ending)], path))
    return sorted(found)


def read_config(model_dir: Path | str):
    """The checkpoint's config as the engine reads a model's (a namespace with the backbone's
    transformer fields: hidden_size, num_attention_heads, num_key_value_heads, head_dim,
    num_hidden_layers, vocab_size), the DsmConfig as ``dsm``."""
    from types import SimpleNamespace

    dsm = read_dsm_config(model_dir)
    return SimpleNamespace(model_type=MODEL_TYPE, dsm=dsm, options=generation_options(model_dir, dsm),
                           hidden_size=dsm.dim, num_attention_heads=dsm.num_heads,
                           num_key_value_heads=dsm.num_heads // dsm.kv_repeat, head_dim=dsm.dim // dsm.num_heads,
                           num_hidden_layers=dsm.num_layers, vocab_size=dsm.text_card, max_position_embeddings=None)


#: The architecture's name in the engine's model registry (its config.json has no model_type).
MODEL_TYPE = "kyutai_tts"


#: The manifest beside a checkpoint (layouts/manifest.py reads it for the layout; the model and the
#: codec read the same generation settings from it here, so that all three agree).
MANIFEST = "audio_pipeline.json"
#: Guidance where the manifest sets none: the reference's.
DEFAULT_CFG_COEF = 2.0
#: Conditions a server keeps where the manifest sets none (each holds its voices' cross-attention
#: keys and values for every layer: at the published shape, tens to a hundred MB).
DEFAULT_KEPT_CONDITIONS = 16


@dataclass(frozen=True)
class GenerationOptions:
    """The checkpoint's generation settings (its manifest's ``layout_options``): the guidance
    coefficient, the bonus added to the text's padding logit, the codebooks generated, and how many
    conditions (a voice or a dialogue's two, with a guidance value) the model keeps computed."""

    cfg_coef: float
    padding_bonus: float
    n_q: int
    kept_conditions: int = DEFAULT_KEPT_CONDITIONS

    def doubled(self, config: DsmConfig) -> bool:
        """Whether guidance doubles the batch: a model not distilled for it, guided."""
        return not config.distilled_guidance and self.cfg_coef != 1.0


def generation_options(model_dir: Path | str, config: DsmConfig, options: dict | None = None) -> GenerationOptions:
    """The settings ``options`` gives (default: the manifest's layout_options in ``model_dir``);
    ValueError naming the option for a value the model cannot take."""
    if options is None:
        path = Path(model_dir) / MANIFEST
        options = {}
        if path.is_file():
            try:
                options = dict(json.loads(path.read_text()).get("layout_options") or {})
            except (ValueError, AttributeError):
                options = {}  # the manifest's own reader reports it
    cfg = float(options.get("cfg_coef", DEFAULT_CFG_COEF))
    if config.distilled_guidance and cfg not in config.cfg_values:
        raise ValueError(f"layout_options.cfg_coef: {cfg} is not one of the values the model was distilled for "
                         f"{list(config.cfg_values)}")
    if cfg <= 0:
        raise ValueError(f"layout_options.cfg_coef: {cfg} must be above 0")
    n_q = options.get("n_q", config.n_q)
    if not isinstance(n_q, int) or isinstance(n_q, bool) or not 1 <= n_q <= config.n_q:
        raise ValueError(f"layout_options.n_q: {n_q!r} must be a whole number from 1 to the model's {config.n_q}")
    kept = options.get("kept_conditions", DEFAULT_KEPT_CONDITIONS)
    if not isinstance(kept, int) or isinstance(kept, bool) or kept < 1:
        raise ValueError(f"layout_options.kept_conditions: {kept!r} must be a whole number from 1")
    return GenerationOptions(cfg, float(options.get("padding_bonus", 0.0)), n_q, kept)
