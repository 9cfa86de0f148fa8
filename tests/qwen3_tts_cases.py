"""Qwen3-TTS's golden cases (tests/fixtures/qwen3_tts/, made by scripts/qwen3_tts_reference/ with
qwen-tts 0.1.1 on tiny random CustomVoice, VoiceDesign and Base checkpoints): each case's inputs,
its recorded arrays, the engine request that asks for the same speech, and a copy of its checkpoint
set up as the case was run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

from audio_pipeline.service.voices import VoicePrompt

FIXTURES = Path(__file__).parent / "fixtures" / "qwen3_tts"
CASES = sorted(path.name for path in (FIXTURES / "cases").iterdir())


def case_info(name: str) -> tuple[dict, dict, str]:
    info = json.loads((FIXTURES / "cases" / name / "case.json").read_text())
    return info, info["inputs"], info["model"].split("/")[-1]


def case_array(name: str, file: str) -> np.ndarray:
    return np.load(FIXTURES / "cases" / name / file)


def case_reference(name: str) -> VoicePrompt | None:
    """A Base case's reference as the reference took it: its codes, transcript (none in x-vector
    mode) and speaker embedding."""
    _, inputs, kind = case_info(name)
    if kind != "base":
        return None
    path = FIXTURES / "cases" / name / "ref_code.npy"
    codes = torch.from_numpy(np.load(path)).reshape(-1) if path.is_file() else torch.zeros(0, dtype=torch.long)
    transcript = "" if inputs.get("x_vector_only_mode") else inputs["ref_text"]
    return VoicePrompt(transcript, codes, torch.from_numpy(case_array(name, "ref_spk_embedding.npy")))


def case_request(name: str) -> dict:
    """The engine request of a case: its text and voice (a preset speaker, a description, or the
    reference), its instruction, greedy, as many frames as the reference could make (its
    max_new_tokens 17 gives at most 16: the last token sampled gets no code predictor)."""
    _, inputs, kind = case_info(name)
    request = {"voice": inputs["speaker"].lower() if kind == "custom_voice" else None,
               "reference": case_reference(name), "temperature": 0.0, "max_tokens": 16}
    if kind == "voice_design":
        request["voice"] = inputs["instruct"]
    if kind == "custom_voice" and inputs.get("instruct"):
        request["instructions"] = inputs["instruct"]
    return request


def model_copy(tmp_path: Path, kind: str, language: str, streaming_text: bool) -> Path:
    """The fixture checkpoint of ``kind`` with a manifest setting the layout's language and text
    mode (the reference takes them per call; the engine per model)."""
    directory = tmp_path / f"{kind}-{language}-{streaming_text}"
    if not directory.exists():
        shutil.copytree(FIXTURES / "models" / kind, directory)
        (directory / "audio_pipeline.json").write_text(json.dumps(
            {"family": "qwen3-tts", "layout_options": {"language": language, "streaming_text": streaming_text}}))
    return directory
