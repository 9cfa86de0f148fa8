"""A request's ``language``: any usual spelling of one of the model's languages, or auto; each
family declares the languages it speaks, a checkpoint that lists its own speaks those, and a
manifest's ``languages`` wins over both. (Through real servers: tests/test_request_fields.py.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from audio_pipeline.errors import InvalidArgument
from audio_pipeline.layouts.manifest import MANIFEST_NAME, ModelManifest
from audio_pipeline.layouts.registry import available_families, get_family
from audio_pipeline.text.languages import AUTO, SpokenLanguages, describe, language_of

QWEN_CHECKPOINT = Path(__file__).parent / "fixtures" / "qwen3_tts" / "models" / "custom_voice"


@pytest.mark.parametrize("spelling", ["English", "english", "ENGLISH", " English ", "en", "EN", "eng", "en-US",
                                      "en-us", "en_US", "en-GB", "en-Latn-US"])
def test_every_usual_spelling_of_english_is_the_us_english_voices_language(spelling):
    assert SpokenLanguages(("en-US",)).resolve(spelling) == "en-US"


@pytest.mark.parametrize("spelling", ["Auto", "auto", "AUTO"])
def test_auto_is_served_by_every_model(spelling):
    assert SpokenLanguages(("en-US",)).resolve(spelling) == AUTO
    assert SpokenLanguages(()).resolve(spelling) == AUTO


@pytest.mark.parametrize("spelling,name", [("de", "German"), ("deu", "German"), ("ger", "German"),
                                           ("zh-Hans-CN", "Chinese"), ("cmn", "Chinese"), ("Mandarin", "Chinese"),
                                           ("fr_CA", "French"), ("fre", "French"), ("pt-BR", "Portuguese"),
                                           ("Farsi", "Persian"), ("yue", "Cantonese")])
def test_names_iso_codes_and_bcp47_tags_name_their_language(spelling, name):
    assert language_of(spelling).name == name


@pytest.mark.parametrize("spelling", ["Klingon", "xx", "e", "english-us", "en--US", "", "auto"])
def test_what_names_no_language_is_none(spelling):
    assert language_of(spelling) is None


def test_another_language_is_refused_naming_the_field_and_listing_the_supported_ones():
    spoken = SpokenLanguages(("en-US",))
    for requested, shown in (("fr", "'fr' (French)"), ("French", "'French'"), ("Klingon", "'Klingon'")):
        with pytest.raises(InvalidArgument) as refused:
            spoken.resolve(requested)
        assert refused.value.field == "language"
        assert str(refused.value) == (f"language: {shown} is not a language this model speaks; supported: "
                                      "English (en-US), or auto")
    with pytest.raises(InvalidArgument, match=r"^language: 'x{40}\.\.\.' is not a language"):
        spoken.resolve("x" * 500)  # echoed cut short
    with pytest.raises(InvalidArgument, match=r"supported: only auto$"):
        SpokenLanguages(()).resolve("en")


def test_a_models_own_names_match_as_written_and_by_language():
    spoken = SpokenLanguages(("chinese", "english", "beijing_dialect"))
    assert [spoken.resolve(s) for s in ("ZH", "zh-TW", "English", "en-AU", "BEIJING_DIALECT")] == [
        "chinese", "chinese", "english", "english", "beijing_dialect"]
    assert [describe(e) for e in spoken.entries] == ["Chinese (zh)", "English (en)", "beijing_dialect"]


def test_every_family_declares_its_languages():
    built_in = ("csm", "maya1", "neutts", "orpheus", "phoneme-lpc", "phoneme-lpc-frame", "qwen3-tts")
    assert set(built_in) <= set(available_families())
    declared = {name: get_family(name).languages for name in built_in}
    assert declared == {"csm": ("en",), "maya1": ("en",), "neutts": ("en",), "orpheus": ("en",),
                        "phoneme-lpc": ("en-US",), "phoneme-lpc-frame": ("en-US",),
                        # its checkpoint's own (the layout's spoken_languages)
                        "qwen3-tts": ()}
    for name, languages in declared.items():
        if languages:
            SpokenLanguages(languages).check(name)


class _Layout:
    """A layout of a family that speaks its family's languages (lists none of its own)."""

    @staticmethod
    def spoken_languages():
        return None


def test_a_manifests_languages_win_over_the_familys(tmp_path):
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"family": "orpheus"}))
    assert ModelManifest.read(tmp_path).spoken_languages(_Layout()).entries == ("en",)
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"family": "orpheus", "languages": ["German", "fr-FR", "auto"]}))
    spoken = ModelManifest.read(tmp_path).spoken_languages(_Layout())
    assert spoken.resolve("de-AT") == "German" and spoken.resolve("fra") == "fr-FR"
    with pytest.raises(InvalidArgument, match=r"supported: German \(de\), French \(fr-FR\), or auto"):
        spoken.resolve("en")
    for bad, message in ((["Klingon"], r"languages: 'Klingon' is not a language"),
                         ([], r"languages: empty")):
        (tmp_path / MANIFEST_NAME).write_text(json.dumps({"family": "orpheus", "languages": bad}))
        with pytest.raises(ValueError, match=message):
            ModelManifest.read(tmp_path).spoken_languages(_Layout())
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"family": "orpheus", "languages": "English"}))
    with pytest.raises(ValueError, match="languages must be a list"):
        ModelManifest.read(tmp_path)


def test_qwen3_tts_speaks_its_checkpoints_languages_or_those_of_them_its_manifest_names(tmp_path):
    qwen = tmp_path / "qwen"
    shutil.copytree(QWEN_CHECKPOINT, qwen)
    (qwen / MANIFEST_NAME).write_text(json.dumps({"family": "qwen3-tts"}))
    manifest = ModelManifest.read(qwen)
    layout = manifest.make_layout(qwen)
    assert manifest.spoken_languages(layout).entries == layout.spoken_languages()
    assert {"english", "chinese", "beijing_dialect"} <= set(layout.spoken_languages())
    (qwen / MANIFEST_NAME).write_text(json.dumps({"family": "qwen3-tts", "languages": ["en", "Chinese", "auto"]}))
    manifest = ModelManifest.read(qwen)
    spoken = manifest.spoken_languages(layout)
    assert spoken.entries == ("english", "chinese")  # as the layout takes them
    with pytest.raises(InvalidArgument, match=r"supported: English \(en\), Chinese \(zh\), or auto"):
        spoken.resolve("German")
    (qwen / MANIFEST_NAME).write_text(json.dumps({"family": "qwen3-tts", "languages": ["Hindi"]}))
    with pytest.raises(ValueError, match=r"languages: 'Hindi' is not one of the checkpoint's: "
                                         r"beijing_dialect, Chinese \(zh\)"):
        ModelManifest.read(qwen).spoken_languages(layout)
