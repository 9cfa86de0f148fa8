"""Loads Hugging Face safetensors checkpoints (single file or sharded) into a module."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from torch import nn


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a model directory, from its shard index when there is one."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / name for name in shards]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"checkpoint shard(s) listed in {index} are missing: {', '.join(missing)}")
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def load_safetensors_into(module: nn.Module, model_dir: Path, dtype: torch.dtype,
                          device: torch.device, *, ignore_prefixes: tuple[str, ...] = ()) -> None:
    """Assigns every tensor of the checkpoint to ``module``'s parameters, cast to ``dtype``.

    ``module`` may be built on the meta device: parameters are replaced, not copied into.
    Tied parameters (lm_head sharing the embedding) may be absent from the file. Any other
    missing or unexpected key, or a shape mismatch, is an error that names them. Keys starting with
    one of ``ignore_prefixes`` (weights another loader reads, e.g. CSM's ``codec_model.``) are skipped:
    neither loaded nor unexpected.
    """
    params = dict(module.named_parameters(remove_duplicate=False))
    state: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():
                if key.endswith("rotary_emb.inv_freq") or (ignore_prefixes and key.startswith(ignore_prefixes)):
                    continue
                if key not in params:
                    unexpected.append(key)
                    continue
                tensor = f.get_tensor(key)
                if tensor.shape != params[key].shape:
                    raise ValueError(f"{path.name}: {key} has shape {tuple(tensor.shape)}, "
                                     f"the model expects {tuple(params[key].shape)}")
                state[key] = tensor.to(device=device, dtype=dtype)
    # A tied parameter is stored once, under either of its names.
    missing = [n for n in params if n not in state and not any(params[n] is params[o] for o in state)]
    if unexpected or missing:
        raise ValueError(f"checkpoint in {model_dir} does not match the model: "
                         f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                         f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
    module.load_state_dict(state, strict=False, assign=True)
    tie = getattr(module, "tie_weights", None)
    if tie is not None:
        tie()


def load_strict(module: nn.Module, tensors: dict[str, torch.Tensor], what: str) -> None:
    """Loads ``tensors`` into ``module`` exactly; ValueError naming ``what`` and the tensors that
    are missing, unexpected or of another shape (a config that does not fit its weights)."""
    ours = module.state_dict()
    missing = sorted(set(ours) - set(tensors))
    unexpected = sorted(set(tensors) - set(ours))
    wrong = sorted(k for k in set(ours) & set(tensors) if ours[k].shape != tensors[k].shape)
    if missing or unexpected or wrong:
        raise ValueError(f"{what} tensors do not fit its config: {len(missing)} missing {missing[:3]}, "
                         f"{len(unexpected)} unexpected {unexpected[:3]}, {len(wrong)} of another shape {wrong[:3]}")
    module.load_state_dict(tensors, strict=True)


def read_config_json(directory: Path, what: str) -> object:
    """The parsed ``config.json`` of a checkpoint directory; FileNotFoundError or ValueError naming
    the file (``what`` names the kind of checkpoint in the message)."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{what} config.json not found in {directory}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None


def init_random_weights(module: nn.Module, dtype: torch.dtype, device: torch.device, seed: int = 0) -> None:
    """Draws every parameter of ``module`` (built on the meta device) on ``device``: norms at one,
    the rest normal with std 0.02, as a fresh Llama."""
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, parameter in list(module.named_parameters()):
        owner = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
        if name.endswith("norm.weight"):
            value = torch.ones(parameter.shape, dtype=dtype, device=device)
        else:
            value = torch.empty(parameter.shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=generator)
        setattr(owner, name.rpartition(".")[2], nn.Parameter(value, requires_grad=False))


#: The torch.nn.init functions the layers' reset_parameters call (Linear, Embedding).
_INIT_FUNCTIONS = ("kaiming_uniform_", "uniform_", "normal_", "trunc_normal_", "zeros_", "ones_", "xavier_uniform_",
                   "xavier_normal_", "constant_")


@contextlib.contextmanager
def skipped_weight_init() -> Iterator[None]:
    """Modules built inside skip torch.nn.init's random initialisation (their weights are loaded
    right after, or drawn by init_random_weights). On the meta device that initialisation is not
    only wasted: torch runs a meta tensor's in-place random fill through its Python reference
    kernels, whose first use imports sympy and the symbolic-shape machinery (some 25 MiB of a
    server's resident memory)."""
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}
    try:
        for name in _INIT_FUNCTIONS:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, function in saved.items():
            setattr(nn.init, name, function)
