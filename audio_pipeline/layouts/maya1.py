"""The Maya1 layout: Orpheus's speech tokens, frames and SNAC decoder, with a voice described in
words instead of named.

Maya1 (a Llama 3B speech LM) uses Orpheus's special ids (start of human 128259, end of human
128260, start of AI 128261, start of speech 128257, end of speech 128258) and speech-token ranges;
what differs is the prompt: the text is preceded by the voice's description,
``<description="..."> text``. Any description is a voice; the model's manifest may name a few.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from audio_pipeline.errors import InvalidArgument
from audio_pipeline.layouts.voice_info import VoiceInfo
from audio_pipeline.layouts.orpheus import STREAMING, OrpheusLayout
from audio_pipeline.layouts.registry import Family, register_family

#: Voices of a Maya1 model whose manifest names none (a description is the voice).
PRESET_VOICES = (
    VoiceInfo("narrator", "Calm adult male narrator with an American accent, low pitch, warm timbre, "
                          "measured pacing."),
    VoiceInfo("host", "Friendly adult female podcast host with an American accent, normal pitch, bright "
                      "timbre, conversational pacing."),
    VoiceInfo("storyteller", "Older British male storyteller, gentle and expressive, slow pacing."),
)


@dataclass(frozen=True)
class Maya1Layout(OrpheusLayout):
    #: The voice is a description in words (any text), not a name from a fixed list.
    described_voices: ClassVar[bool] = True

    def build_prompt(self, tokenizer, text: str, voice: str | None, reference=None, speed: float = 1.0) -> list[int]:
        if reference is not None:
            raise InvalidArgument("this model speaks in a described voice and cannot clone a recording: "
                                  "describe the voice instead", field="reference")
        return self.prompt_ids(tokenizer(self.prompt_text(text, voice)).input_ids)

    @staticmethod
    def prompt_text(text: str, voice: str | None) -> str:
        # The description sits inside double quotes: its own quotes and line breaks would end it early.
        description = " ".join((voice or "").replace('"', "'").split())
        return f'<description="{description}"> {text}'


def is_maya1(config: dict, model_dir: Path) -> bool:
    """A Maya1 checkpoint: its config.json names one (``_name_or_path``, as transformers writes it)
    or its directory is named so (its config is a plain Llama's)."""
    return any("maya1" in name.lower() for name in (str(config.get("_name_or_path", "")), model_dir.name))


register_family(Family(
    "maya1", make_layout=lambda model_dir, tokenizer, options: Maya1Layout(), detect=is_maya1,
    voices=PRESET_VOICES, default_voice=PRESET_VOICES[0].name, languages=("en",), streaming=STREAMING))
