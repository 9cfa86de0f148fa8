"""Configuration: defaults, every source and its precedence, flag parsing, resolve() rules, and
that only fields that act are accepted."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
import torch

from audio_pipeline.config import (
    DEFAULT_MODEL,
    AudioGenerationConfig,
    KVCacheConfig,
    LimitsConfig,
    MAXModelConfig,
    ModelConfig,
    PipelineConfig,
    PrependPromptSpeechTokens,
    PrometheusMetricsMode,
    SamplingConfig,
)
from audio_pipeline.decoders import AudioDecoder, register_audio_decoder
from audio_pipeline.decoders.settings_check import check_decoder_settings


class _TestDecoder(AudioDecoder):
    @classmethod
    def load(cls, weights: str, config: dict[str, Any] | None = None, **kwargs: Any) -> AudioDecoder:
        raise NotImplementedError

    def decode(self, codes):  # pragma: no cover - never loaded
        raise NotImplementedError


@register_audio_decoder
class Frame7Decoder(_TestDecoder):
    name = "test-config-frame7"
    tokens_per_frame = 7


@register_audio_decoder
class Frame1Decoder(_TestDecoder):
    name = "test-config-frame1"
    tokens_per_frame = 1


@register_audio_decoder
class CausalDecoder(_TestDecoder):
    name = "test-config-causal"
    tokens_per_frame = 7
    supports_block_causal = True


D7 = Frame7Decoder.name


def make(**fields: Any) -> AudioGenerationConfig:
    """A configuration of ``fields`` checked as the engine and the command line check it (its own
    rules, then what its audio decoder can honour)."""
    return check_decoder_settings(AudioGenerationConfig(**{"audio_decoder": D7, **fields}))


# --- defaults -------------------------------------------------------------------------------------

def test_every_field_is_documented():
    models = [AudioGenerationConfig, KVCacheConfig, ModelConfig, SamplingConfig, LimitsConfig]
    for model in models:
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"


def test_defaults():
    config = make()
    assert config.config_file is None and config.section_name is None and config.max_length is None
    assert config.max_batch_size is None and config.max_queue_size_tg is None and config.min_batch_size_tg is None
    assert config.ce_delay_ms == 0.0
    assert config.enable_prioritize_first_decode is False
    assert config.enable_chunked_prefill is True
    assert config.enable_in_flight_batching is None  # the device decides (for_device)
    assert config.max_num_steps == -1
    assert config.max_batch_input_tokens == 8192
    assert config.kvcache_ce_watermark == 0.95
    assert config.enable_overlap_scheduler is None
    assert config.audio_decoder_weights == "" and config.chunk_size is None and config.buffer == 0
    assert config.block_causal is False
    assert config.prepend_prompt_speech_tokens is PrependPromptSpeechTokens.NEVER
    assert config.prepend_prompt_speech_tokens_causal is False
    assert config.prometheus_metrics_mode is PrometheusMetricsMode.INSTRUMENT_ONLY
    assert config.audio_decoder_config == {}
    assert config.voices_dir is None and config.grace_period_s == 10.0
    assert AudioGenerationConfig.model_fields["audio_decoder"].default == "snac"


def test_nested_defaults():
    config = make()
    assert MAXModelConfig is ModelConfig
    model = config.model
    assert (model.model_path, model.dtype, model.device) == (DEFAULT_MODEL, "auto", "auto")
    assert DEFAULT_MODEL == "builtin:slt-en-v5"
    assert model.served_model_name is None
    assert model.kv_cache == KVCacheConfig(kv_cache_page_size=None, enable_prefix_caching=True,
                                           device_memory_utilization=0.9)
    assert model.kv_cache.page_size_for("cpu") == 128 and model.kv_cache.page_size_for("cuda") == 16
    assert model.kv_cache.kv_cache_memory_bytes is None and model.kv_cache.cache_dtype == "auto"
    sampling = config.sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p) == (0.6, 0.95, -1, 0.0)
    assert (sampling.repetition_penalty, sampling.max_tokens, sampling.max_tokens_limit) == (1.1, 1200, 4096)
    assert sampling.min_tokens == 0 and sampling.seed is None and sampling.max_text_chars == 100_000


def test_enums_are_strings_with_their_values():
    assert [m.value for m in PrependPromptSpeechTokens] == ["never", "once", "rolling"]
    assert [m.value for m in PrometheusMetricsMode] == ["instrument_only", "launch_server", "launch_multiproc_server"]
    assert PrependPromptSpeechTokens.ROLLING == "rolling" and str(PrependPromptSpeechTokens.ROLLING) == "rolling"


def test_default_decoder_resolves_once_snac_exists():
    pytest.importorskip("audio_pipeline.decoders.snac")
    assert AudioGenerationConfig().audio_decoder == "snac"


# --- field validation -----------------------------------------------------------------------------

@pytest.mark.parametrize("fields, field_name", [
    ({"chunk_size": [7, 0]}, "chunk_size"),
    ({"chunk_size": []}, "chunk_size"),
    ({"buffer": -7}, "buffer"),
    ({"max_batch_size": 0}, "max_batch_size"),
    ({"kvcache_ce_watermark": 0.0}, "kvcache_ce_watermark"),
    ({"kvcache_ce_watermark": 1.5}, "kvcache_ce_watermark"),
    ({"max_num_steps": 0}, "max_num_steps"),
    ({"grace_period_s": -1}, "grace_period_s"),
    ({"sampling": {"top_k": 0}}, "top_k"),
    ({"sampling": {"top_p": 0}}, "top_p"),
    ({"sampling": {"temperature": -0.1}}, "temperature"),
    ({"model": {"device": "gpu"}}, "device"),
    ({"model": {"dtype": "int8"}}, "dtype"),
    ({"model": {"kv_cache": {"device_memory_utilization": 1.2}}}, "device_memory_utilization"),
    ({"not_a_field": 1}, "not_a_field"),
    ({"sampling": {"not_a_field": 1}}, "not_a_field"),
])
def test_field_validation_names_the_field(fields, field_name):
    with pytest.raises(ValueError, match=field_name):
        make(**fields)


def test_assignment_is_validated():
    config = make()
    with pytest.raises(ValueError, match="buffer"):
        config.buffer = -1
    with pytest.raises(ValueError, match="temperature"):
        config.sampling.temperature = -1


# --- from_flags -----------------------------------------------------------------------------------

def flags(*audio_flags: str, **config_flags: Any) -> AudioGenerationConfig:
    return AudioGenerationConfig.from_flags(audio_flags, **{"audio_decoder": D7, **config_flags})


@pytest.mark.parametrize("text, expected", [
    ("28,56,112", [28, 56, 112]), (" 7 , 14 ", [7, 14]), ("[7, 14]", [7, 14]), ("none", None)])
def test_flag_chunk_size(text, expected):
    assert flags(f"chunk_size={text}").chunk_size == expected


@pytest.mark.parametrize("text, expected", [("true", True), ("TRUE", True), ("False", False), ("no", False)])
def test_flag_booleans(text, expected):
    assert flags(f"enable_chunked_prefill={text}").enable_chunked_prefill is expected


@pytest.mark.parametrize("text", ["maybe", "2", ""])
def test_flag_booleans_refuse_other_words(text):
    with pytest.raises(ValueError, match=r"for enable_chunked_prefill: Input should be a valid boolean"):
        flags(f"enable_chunked_prefill={text}")


def test_flag_enums_by_value():
    config = flags("prepend_prompt_speech_tokens=rolling", "buffer=7", "prometheus_metrics_mode=launch_server")
    assert config.prepend_prompt_speech_tokens is PrependPromptSpeechTokens.ROLLING
    assert config.prometheus_metrics_mode is PrometheusMetricsMode.LAUNCH_SERVER
    with pytest.raises(ValueError, match=r"prepend_prompt_speech_tokens: .*'never', 'once' or 'rolling'"):
        flags("prepend_prompt_speech_tokens=ROLLING_ALWAYS")


def test_flag_names_take_dash_or_underscore():
    config = flags("max-batch-size=4", "max_queue_size_tg=8", "sampling.max-tokens=100")
    assert (config.max_batch_size, config.max_queue_size_tg, config.sampling.max_tokens) == (4, 8, 100)


def test_flag_dotted_names_reach_nested_fields():
    config = flags("sampling.temperature=0.5", "model.dtype=float32", "model.kv_cache.kv_cache_page_size=64",
                   "model.model_path=/models/x", "model.num_threads=3")
    assert config.sampling.temperature == 0.5 and config.model.dtype == "float32"
    assert config.model.kv_cache.kv_cache_page_size == 64 and config.model.model_path == "/models/x"
    assert config.model.num_threads == 3 and config.sampling.top_p == 0.95


def test_flag_decoder_settings_are_json_or_strings():
    config = flags("audio_decoder_config.hop=512", "audio_decoder_config.window=hann",
                   "audio_decoder_config.causal=true", 'audio_decoder_config.sizes=[1, 2]')
    assert config.audio_decoder_config == {"hop": 512, "window": "hann", "causal": True, "sizes": [1, 2]}


def test_flag_values_that_do_not_parse_name_the_field():
    with pytest.raises(ValueError, match=r"'7.5' for buffer: .*integer"):
        flags("buffer=7.5")
    with pytest.raises(ValueError, match=r"'abc' for chunk_size\.1: .*integer"):
        flags("chunk_size=28,abc")
    with pytest.raises(ValueError, match=r"'warm' for sampling\.temperature: .*number"):
        flags("sampling.temperature=warm")
    with pytest.raises(ValueError, match=r"'inf' for sampling\.temperature: .*finite number"):
        flags("sampling.temperature=inf")
    with pytest.raises(ValueError, match=r"'fp8' for model\.dtype: .*'auto', 'float32'"):
        flags("model.dtype=fp8")
    with pytest.raises(ValueError, match=r'field "model"'):
        flags("model=/models/x")
    assert flags('sampling={"temperature": 0.2}').sampling.temperature == 0.2  # a section as JSON


def test_flag_unknown_key_and_missing_equals_name_the_key():
    with pytest.raises(ValueError, match=r"unknown configuration key 'chunk_sizes' \(audio flag 'chunk_sizes=28'\); "
                                         r"did you mean 'chunk_size'"):
        flags("chunk_sizes=28")
    with pytest.raises(ValueError, match=r"unknown configuration key 'sampling\.temp'"):
        flags("sampling.temp=0.5")
    with pytest.raises(ValueError, match=r"buffer.*no fields"):
        flags("buffer.size=7")
    with pytest.raises(ValueError, match=r"'buffer' has no '='"):
        flags("buffer")


def test_flags_win_over_config_flags_and_later_flags_over_earlier():
    config = AudioGenerationConfig.from_flags(["buffer=14", "max-batch-size=3", "max_batch_size=5"],
                                              audio_decoder=D7, buffer=7, max_batch_size=2, model={"dtype": "float16"})
    assert (config.buffer, config.max_batch_size, config.model.dtype) == (14, 5, "float16")
    assert flags(buffer=21).buffer == 21


# --- sources and precedence -----------------------------------------------------------------------

YAML_TEXT = """
audio_decoder: test-config-frame7
buffer: 7
max_batch_size: 4
sampling:
  temperature: 0.3
  top_p: 0.9
model:
  model_path: /models/from-file
"""

TOML_TEXT = """
audio_decoder = "test-config-frame7"
chunk_size = [14, 28]

[sampling]
temperature = 0.4

[serve]
audio_decoder = "test-config-frame1"
buffer = 3

[serve.model]
dtype = "float32"
"""


@pytest.fixture
def yaml_file(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(YAML_TEXT)
    return path


@pytest.fixture
def toml_file(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text(TOML_TEXT)
    return path


def test_yaml_file(yaml_file):
    config = AudioGenerationConfig.load(config_file=str(yaml_file), env={})
    assert (config.buffer, config.max_batch_size, config.model.model_path) == (7, 4, "/models/from-file")
    assert (config.sampling.temperature, config.sampling.top_p, config.sampling.top_k) == (0.3, 0.9, -1)
    assert config.config_file == str(yaml_file)


def test_toml_file_and_section_name(toml_file):
    with pytest.raises(ValueError, match=r"unknown configuration key 'serve'.*config\.toml"):
        AudioGenerationConfig.load(config_file=str(toml_file), env={})
    section = AudioGenerationConfig.load(config_file=str(toml_file), section_name="serve", env={})
    assert (section.audio_decoder, section.buffer, section.model.dtype) == ("test-config-frame1", 3, "float32")
    assert section.chunk_size is None and section.sampling.temperature == 0.6
    plain = toml_file.with_name("plain.toml")
    plain.write_text(TOML_TEXT.split("[serve]")[0])
    whole = AudioGenerationConfig(config_file=str(plain))
    assert whole.chunk_size == [14, 28] and whole.sampling.temperature == 0.4


def test_missing_section_names_it(toml_file):
    with pytest.raises(ValueError, match=r"section_name 'prod' is not a section.*'serve'"):
        AudioGenerationConfig.load(config_file=str(toml_file), section_name="prod", env={})


def test_section_name_without_file_is_an_error():
    with pytest.raises(ValueError, match="section_name 'serve' is set but config_file is not"):
        make(section_name="serve")


@pytest.mark.parametrize("name, text, message", [
    ("missing.yaml", None, "cannot be read"),
    ("broken.yaml", "buffer: [7\n", "cannot be parsed"),
    ("broken.toml", "buffer = = 7\n", "cannot be parsed"),
    ("list.yaml", "- 1\n- 2\n", "mapping of field names"),
    ("config.json", "{}", "unsupported file type"),
])
def test_bad_files_name_the_path(tmp_path, name, text, message):
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    with pytest.raises(ValueError, match=rf"config_file '.*{name}'.*{message}|{message}.*{name}"):
        AudioGenerationConfig.load(config_file=str(path), env={})


def test_unknown_key_in_file_names_key_and_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("audio_decoder: test-config-frame7\nsampling:\n  temprature: 0.5\n")
    with pytest.raises(ValueError, match=r"unknown configuration key 'sampling\.temprature' \(config file '.*c\.yaml'\)"):
        AudioGenerationConfig.load(config_file=str(path), env={})


def test_environment_mapping():
    env = {"AUDIO_PIPELINE_AUDIO_DECODER": D7, "AUDIO_PIPELINE_BUFFER": "14",
           "AUDIO_PIPELINE_CHUNK_SIZE": "7,21", "AUDIO_PIPELINE_MODEL__MODEL_PATH": "/models/env",
           "AUDIO_PIPELINE_SAMPLING__TEMPERATURE": "0.2", "AUDIO_PIPELINE_MODEL__KV_CACHE__ENABLE_PREFIX_CACHING": "false",
           "AUDIO_PIPELINE_AUDIO_DECODER_CONFIG__HOP": "256",
           "AUDIO_PIPELINE_CACHE": "/tmp/cache", "HOME": "/root", "OTHER_BUFFER": "x"}
    config = AudioGenerationConfig.load(env=env)
    assert (config.buffer, config.chunk_size, config.model.model_path) == (14, [7, 21], "/models/env")
    assert config.sampling.temperature == 0.2 and config.model.kv_cache.enable_prefix_caching is False
    assert config.audio_decoder_config == {"hop": 256}


def test_environment_errors_name_the_variable():
    with pytest.raises(ValueError, match=r"unknown configuration key 'bufer'.*AUDIO_PIPELINE_BUFER"):
        AudioGenerationConfig.load(env={"AUDIO_PIPELINE_BUFER": "7"})
    with pytest.raises(ValueError, match=r"unknown configuration key 'sampling\.temp' \(environment variable "
                                         r"AUDIO_PIPELINE_SAMPLING__TEMP\)"):
        AudioGenerationConfig.load(env={"AUDIO_PIPELINE_SAMPLING__TEMP": "0.5"})
    with pytest.raises(ValueError, match=r"'seven' for buffer: .*integer"):
        AudioGenerationConfig.load(env={"AUDIO_PIPELINE_BUFFER": "seven"})


def test_environment_nests_with_double_underscores_at_any_depth():
    env = {"AUDIO_PIPELINE_MODEL__KV_CACHE__CACHE_DTYPE": "bfloat16", "AUDIO_PIPELINE_LIMITS__MAX_REGISTERED_VOICES": "20",
           "AUDIO_PIPELINE_OPENAI_VOICES__ALLOY": "slt-en", "AUDIO_PIPELINE_MAX_BATCH_SIZE": "none",
           "AUDIO_PIPELINE_SAMPLING__STOP_TOKEN_IDS": "5,6"}
    config = AudioGenerationConfig.load(env=env, audio_decoder=D7)
    assert config.model.kv_cache.cache_dtype == "bfloat16" and config.limits.max_registered_voices == 20
    assert config.openai_voices == {"alloy": "slt-en"} and config.max_batch_size is None
    assert config.sampling.stop_token_ids == [5, 6]


def test_process_environment_is_the_default(monkeypatch, yaml_file):
    monkeypatch.setenv("AUDIO_PIPELINE_CONFIG_FILE", str(yaml_file))
    monkeypatch.setenv("AUDIO_PIPELINE_SAMPLING__TOP_P", "0.5")
    config = AudioGenerationConfig.load()
    assert config.buffer == 7 and config.sampling.top_p == 0.5 and config.sampling.temperature == 0.3


def test_environment_picks_the_file_and_section(toml_file):
    env = {"AUDIO_PIPELINE_CONFIG_FILE": str(toml_file), "AUDIO_PIPELINE_SECTION_NAME": "serve"}
    assert AudioGenerationConfig.load(env=env).audio_decoder == "test-config-frame1"


def test_precedence_defaults_file_env_keywords_flags(yaml_file):
    env = {"AUDIO_PIPELINE_BUFFER": "14", "AUDIO_PIPELINE_MAX_BATCH_SIZE": "5", "AUDIO_PIPELINE_SAMPLING__TOP_P": "0.8"}
    config = AudioGenerationConfig.load(config_file=str(yaml_file), env=env, max_batch_size=6, buffer=21,
                                        audio_flags=["buffer=28"])
    assert config.buffer == 28                      # flag > keyword > env > file
    assert config.max_batch_size == 6               # keyword > env > file
    assert config.sampling.top_p == 0.8             # env > file, nested keys merge
    assert config.sampling.temperature == 0.3       # file > default
    assert config.sampling.max_tokens == 1200       # default
    assert config.model.model_path == "/models/from-file"


def test_overrides_are_nested_dicts():
    config = AudioGenerationConfig.load(env={"AUDIO_PIPELINE_MODEL__MODEL_PATH": "/models/env"}, audio_decoder=D7,
                                        model={"dtype": "float16"}, sampling={"temperature": 0.1})
    assert (config.model.dtype, config.model.model_path, config.sampling.temperature) == ("float16", "/models/env", 0.1)
    with pytest.raises(ValueError, match=r"unknown configuration key 'model\.modle_path' \(keyword argument\)"):
        AudioGenerationConfig.load(env={}, audio_decoder=D7, model={"modle_path": "/x"})
    with pytest.raises(ValueError, match=r"unknown configuration key 'model__model_path' \(keyword argument\)"):
        AudioGenerationConfig.load(env={}, audio_decoder=D7, model__model_path="/x")


def test_flags_can_name_the_file(yaml_file):
    config = AudioGenerationConfig.load(env={}, audio_flags=[f"config-file={yaml_file}"])
    assert config.buffer == 7


def test_config_file_in_constructor_sits_below_the_arguments(yaml_file):
    config = AudioGenerationConfig(config_file=str(yaml_file), buffer=0, sampling={"top_p": 0.7})
    assert config.buffer == 0 and config.sampling.top_p == 0.7 and config.sampling.temperature == 0.3


# --- resolve() ------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, message", [
    ({"chunk_size": [7, 10]}, r"chunk_size \[7, 10\].*multiple of .*7 tokens per frame"),
    ({"buffer": 5}, r"buffer \(5\) must be a multiple"),
    ({"audio_decoder": "no-such-decoder"}, r"audio_decoder 'no-such-decoder'"),
    ({"block_causal": True}, r"block_causal=true is not supported by audio_decoder"),
    ({"prepend_prompt_speech_tokens": "once", "prepend_prompt_speech_tokens_causal": True},
     r"prepend_prompt_speech_tokens_causal=true is not supported"),
    ({"audio_decoder": CausalDecoder.name, "prepend_prompt_speech_tokens_causal": True},
     r"prepend_prompt_speech_tokens_causal=true has no effect"),
    ({"prepend_prompt_speech_tokens": "rolling"}, r"rolling needs buffer > 0: .*buffer=0 leaves none"),
    ({"max_batch_size": 9000}, r"max_batch_size \(9000\) exceeds max_batch_input_tokens \(8192\)"),
    ({"max_batch_size": 4, "min_batch_size_tg": 5}, r"min_batch_size_tg \(5\) exceeds max_batch_size \(4\)"),
    ({"max_batch_size": 4, "max_queue_size_tg": 2}, r"max_queue_size_tg \(2\) is below max_batch_size \(4\)"),
    ({"sampling": {"max_tokens": 5000}}, r"sampling\.max_tokens \(5000\) exceeds sampling\.max_tokens_limit"),
    ({"sampling": {"min_tokens": 50, "max_tokens": 40}}, r"sampling\.min_tokens \(50\) exceeds sampling\.max_tokens"),
    ({"max_length": 1200}, r"sampling\.max_tokens \(1200\) leaves no room .*max_length \(1200\)"),
    ({"enable_in_flight_batching": True, "enable_chunked_prefill": False},
     r"enable_in_flight_batching needs enable_chunked_prefill"),
])
def test_resolve_rules(fields, message):
    with pytest.raises(ValueError, match=message):
        make(**fields)


#: (the last settings a rule or field accepts, the first it refuses, what the refusal names).
EDGES = [
    ({"chunk_size": [7, 14]}, {"chunk_size": [7, 15]}, r"chunk_size \[7, 15\]"),
    ({"audio_decoder": Frame1Decoder.name, "chunk_size": [3, 5], "buffer": 1},
     {"audio_decoder": Frame1Decoder.name, "chunk_size": [3, 0], "buffer": 1}, "chunk_size"),
    ({"buffer": 7}, {"buffer": 8}, r"buffer \(8\) must be a multiple"),
    ({"prepend_prompt_speech_tokens": "rolling", "buffer": 7}, {"prepend_prompt_speech_tokens": "rolling"},
     "rolling needs buffer > 0"),
    ({"max_batch_size": 8192}, {"max_batch_size": 8193}, r"max_batch_size \(8193\) exceeds max_batch_input_tokens"),
    ({"max_batch_size": 4, "min_batch_size_tg": 4}, {"max_batch_size": 4, "min_batch_size_tg": 5},
     "min_batch_size_tg"),
    ({"max_batch_size": 4, "max_queue_size_tg": 4}, {"max_batch_size": 4, "max_queue_size_tg": 3},
     "max_queue_size_tg"),
    ({"enable_overlap_scheduler": True, "max_num_steps": 1}, {"enable_overlap_scheduler": True, "max_num_steps": 2},
     r"max_num_steps \(2\) must be -1 or 1 with enable_overlap_scheduler"),
    ({"sampling": {"max_tokens": 4096}}, {"sampling": {"max_tokens": 4097}}, "exceeds sampling.max_tokens_limit"),
    ({"sampling": {"min_tokens": 40, "max_tokens": 40}}, {"sampling": {"min_tokens": 41, "max_tokens": 40}},
     r"sampling\.min_tokens \(41\)"),
    ({"max_length": 1201}, {"max_length": 1200}, "leaves no room"),
    ({"kvcache_ce_watermark": 1.0}, {"kvcache_ce_watermark": 1.001}, "kvcache_ce_watermark"),
    ({"sampling": {"top_k": 1}}, {"sampling": {"top_k": 0}}, "top_k"),
    ({"model": {"device": "cuda:1"}}, {"model": {"device": "cuda:x"}}, "device"),
]


@pytest.mark.parametrize("accepted, refused, message", EDGES)
def test_each_rule_accepts_up_to_its_edge_and_refuses_past_it(accepted, refused, message):
    make(**accepted)  # raises if the rule (or field) is stricter than it says
    with pytest.raises(ValueError, match=message):
        make(**refused)


def test_resolve_lists_every_broken_rule():
    with pytest.raises(ValueError, match=r"(?s)invalid configuration:.*chunk_size.*buffer"):
        make(chunk_size=[5], buffer=3)


def test_assignment_checks_the_field_and_resolve_the_rules():
    config = make()
    config.buffer = 5  # a valid int, but not a multiple of the decoder's frame
    with pytest.raises(ValueError, match="buffer"):
        check_decoder_settings(config.resolve())
    config.buffer = 7
    check_decoder_settings(config.resolve())  # the rules read the fields as they are now: the fixed value passes


# --- only fields that act are accepted -------------------------------------------------------------

#: Fields that nothing read (some only refused when set): gone, so any source setting them is refused.
REMOVED = ["pipeline_role", "ep_size", "enable_echo", "pool_embeddings", "chat_template", "use_experimental_kernels",
           "use_vendor_blas", "pdl_level", "custom_architectures", "zmq_endpoint_base", "execute_empty_batches",
           "max_batch_total_tokens", "force", "use_legacy_module", "defer_resolve", "draft_model", "profiling",
           "lora", "speculative", "run_model_test_mode", "model.weight_path", "model.trust_remote_code",
           "sampling.enable_structured_output"]


@pytest.mark.parametrize("name", REMOVED)
def test_removed_fields_are_refused_as_unknown_keys(name):
    with pytest.raises(ValueError, match=rf"unknown configuration key '{name}' \(audio flag '{name}=1'\)"):
        flags(f"{name}=1")
    variable = "AUDIO_PIPELINE_" + name.upper().replace(".", "__")
    with pytest.raises(ValueError, match=rf"unknown configuration key '{name}' \(environment variable {variable}\)"):
        AudioGenerationConfig.load(env={variable: "1"})


def test_removed_field_in_a_file_or_keyword_is_refused(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("max_batch_total_tokens: 8192\n")
    with pytest.raises(ValueError, match=r"unknown configuration key 'max_batch_total_tokens' \(config file"):
        AudioGenerationConfig.load(env={}, config_file=str(path))
    with pytest.raises(ValueError, match=r"unknown configuration key 'sampling\.enable_structured_output'"):
        make(sampling={"enable_structured_output": True})


def test_fields_no_source_sets_stay_unset():
    """model_fields_set holds exactly what some source (or the model's streaming defaults) set
    (resolved_audio_decoder reads it)."""
    config = AudioGenerationConfig.load(env={"AUDIO_PIPELINE_MAX_BATCH_SIZE": "8"}, audio_flags=["max_num_steps=2"],
                                        sampling={"seed": 1})
    assert {"max_batch_size", "max_num_steps", "sampling"} <= config.model_fields_set
    assert not {"enable_in_flight_batching", "enable_overlap_scheduler", "audio_decoder"} & config.model_fields_set
    assert config.model_fields_set - {"max_batch_size", "max_num_steps", "sampling"} <= {"chunk_size", "buffer",
                                                                                        "block_causal"}


def test_the_models_streaming_defaults_sit_below_every_source(tmp_path):
    default = AudioGenerationConfig.load(env={})
    assert (default.chunk_size, default.block_causal) == ([8, 8, 16, 24, 40], True)  # the built-in voice's manifest
    path = tmp_path / "c.yaml"
    path.write_text("chunk_size: [16]\n")
    assert AudioGenerationConfig.load(env={}, config_file=str(path)).chunk_size == [16]
    assert AudioGenerationConfig.load(env={"AUDIO_PIPELINE_CHUNK_SIZE": "none"}).chunk_size is None
    assert AudioGenerationConfig.load(env={}, audio_flags=["block_causal=false"]).block_causal is False


@pytest.mark.slow
def test_acting_values_take_effect_in_a_server(tiny_model_dir, tmp_path, caplog):
    """kv_cache_memory_bytes sizes the cache's blocks, voices_dir keeps the registered voices, and
    grace_period_s is how long a stopping server lets a stream run on before cutting it (what the
    server says it drains for; the stream, far longer, is cut). (Where the
    other fields act, they are tested there: model.served_model_name in test_http,
    prometheus_metrics_mode in test_metrics, ce_delay_ms and enable_prioritize_first_decode in
    test_scheduler, max_num_steps and audio_decoder_weights in test_engine_core.)"""
    import grpc

    from audio_pipeline.testing.tiny_models import TINY_LLAMA_CONFIG
    from audio_pipeline.testing.background import BackgroundServer
    from audio_pipeline_client import TTSClient
    from audio_pipeline_client._proto import tts_pb2, tts_pb2_grpc
    from helpers import TRANSCRIPT, make_config, recording

    tiny = TINY_LLAMA_CONFIG  # float16 keys and values of every layer (a float32 model's cache on CPU), per token:
    token_bytes = 2 * tiny["num_hidden_layers"] * tiny["num_key_value_heads"] * (
        tiny["hidden_size"] // tiny["num_attention_heads"]) * 2
    voices = tmp_path / "voices"
    config = make_config(tiny_model_dir, "grace_period_s=0.5", voices_dir=str(voices),
                         model={"kv_cache": {"kv_cache_page_size": 16,
                                             "kv_cache_memory_bytes": 300 * 16 * token_bytes}})
    caplog.set_level(logging.INFO, logger="audio_pipeline.server.app")
    server = BackgroundServer(config).start()
    try:
        assert server.engine.scheduler.block_manager.total_num_blocks == 300
        with TTSClient(server.target, timeout=120) as client:
            client.register_voice("alice", recording(), TRANSCRIPT)
        assert json.loads((voices / "alice" / "voice.json").read_text())["name"] == "alice"
        with grpc.insecure_channel(server.target) as channel:
            stream = tts_pb2_grpc.TextToSpeechStub(channel).Synthesize(tts_pb2.SynthesizeRequest(
                text="A long one.", sampling=tts_pb2.SamplingParams(max_tokens=4000, min_tokens=4000)), timeout=120)
            next(stream), next(stream)  # format, first audio: the stream is under way
            server.stop()  # lets the stream run on for grace_period_s, then cuts it
            with pytest.raises(grpc.RpcError):
                list(stream)  # cut before its 4000 tokens
        assert "draining in-flight streams for up to 0.5 s" in caplog.text  # make_config's grace is 5 s
    finally:
        server.stop()


# --- display and logging --------------------------------------------------------------------------

def test_to_display_dict_is_json():
    config = make(chunk_size=[28], audio_decoder_config={"hop": 1})
    shown = json.loads(json.dumps(config.to_display_dict()))
    assert shown["chunk_size"] == [28] and shown["prepend_prompt_speech_tokens"] == "never"
    assert shown["model"]["kv_cache"]["kv_cache_page_size"] is None and shown["audio_decoder_config"] == {"hop": 1}


def test_log_basic_config(caplog):
    config = make(chunk_size=[28, 56], buffer=14, max_batch_size=8, model={"model_path": "/models/m", "dtype": "bfloat16"})
    with caplog.at_level(logging.INFO, logger="audio_pipeline.config"):
        config.log_basic_config()
    text = caplog.text
    for expected in ["/models/m", "dtype=bfloat16", "device=auto", D7, "weights from the model",
                     "chunk_size=[28, 56]", "buffer=14", "block_causal=False", "prepend_prompt_speech_tokens=never",
                     "max_batch_size=8", "max_queue_size_tg", "page_size=device default", "temperature=0.6",
                     "max_tokens=1200", "instrument_only"]:
        assert expected in text, expected
    assert all(record.levelno == logging.INFO for record in caplog.records)


def test_log_basic_config_to_a_given_logger(caplog):
    with caplog.at_level(logging.INFO, logger="custom"):
        make().log_basic_config(logging.getLogger("custom"))
    assert {record.name for record in caplog.records} == {"custom"}


def test_pipeline_config_alone_needs_no_decoder():
    config = PipelineConfig(max_batch_size=2)
    assert "audio_decoder" not in config.to_display_dict()
    with pytest.raises(ValueError, match="buffer"):
        PipelineConfig(buffer=7)


def test_the_open_values_are_resolved_once_for_the_device():
    """for_device makes every open value (None) the one the engine uses: on CUDA large batches,
    mixed batching, overlap (one pass per round), the decoder thread and 16-token pages; on the CPU
    32 requests, none of those, 128-token pages. What a source set is kept; overlap stays off where
    multi-step decoding was asked for; a default never breaks a limit that was set."""
    from audio_pipeline.core.model_runner import default_decode_buckets

    config = make()
    assert (config.max_batch_size, config.enable_overlap_scheduler, config.audio_decoder_thread) == (None, None, None)
    cpu, gpu = config.for_device("cpu"), config.for_device("cuda")
    assert (cpu.max_batch_size, cpu.max_queue_size, cpu.enable_in_flight_batching, cpu.enable_overlap_scheduler,
            cpu.audio_decoder_thread, cpu.max_num_steps, cpu.model.kv_cache.kv_cache_page_size) == (
        32, 256, False, False, False, -1, 128)
    assert (gpu.max_batch_size, gpu.max_queue_size, gpu.enable_in_flight_batching, gpu.enable_overlap_scheduler,
            gpu.audio_decoder_thread, gpu.max_num_steps, gpu.model.kv_cache.kv_cache_page_size) == (
        256, 256, True, True, True, 1, 16)
    chosen = make(max_batch_size=64, enable_in_flight_batching=False, max_num_steps=4,
                  audio_decoder_thread=False, model={"kv_cache": {"kv_cache_page_size": 32}}).for_device("cuda")
    assert (chosen.max_batch_size, chosen.enable_in_flight_batching, chosen.enable_overlap_scheduler,
            chosen.max_num_steps, chosen.audio_decoder_thread, chosen.model.kv_cache.kv_cache_page_size) == (
        64, False, False, 4, False, 32)
    assert make(enable_chunked_prefill=False).for_device("cuda").enable_in_flight_batching is False
    assert make(max_queue_size_tg=48).for_device("cuda").max_batch_size == 48
    assert make(max_batch_input_tokens=100).for_device("cuda").max_batch_size == 100
    with pytest.raises(ValueError, match=r"min_batch_size_tg \(64\) exceeds max_batch_size \(32\)"):
        make(min_batch_size_tg=64).for_device("cpu")
    assert default_decode_buckets(torch.device("cuda"), 256, cuda_graphs=True) == [1, 2, 4, 8, 16, 24, 32,
                                                                                   *range(48, 257, 16)]
    assert default_decode_buckets(torch.device("cuda"), 20, cuda_graphs=True) == [1, 2, 4, 8, 16, 20]
    assert default_decode_buckets(torch.device("cuda"), 256, cuda_graphs=False) == default_decode_buckets(
        torch.device("cpu"), 256, cuda_graphs=True) == []


def test_the_longest_sequence_is_one_setting():
    """max_length is set in one place (the top level, as the pipeline configuration names it);
    model.max_length, a second name for it, is refused as an unknown key."""
    assert make(max_length=2048).max_length == 2048
    with pytest.raises(ValueError, match=r"unknown configuration key 'model\.max_length'; the setting is 'max_length'"):
        make(model={"max_length": 2048})
    with pytest.raises(ValueError, match=r"'model\.max_length' \(audio flag .*\); the setting is 'max_length'"):
        AudioGenerationConfig.load(env={}, audio_flags=["model.max_length=2048"])


def test_audio_flags_may_be_maxs_dictionary_of_names_and_values():
    """from_flags takes MAX's dictionary as well as NAME=VALUE strings, with the same result;
    values of any JSON type are read as their flag text would be."""
    strings = AudioGenerationConfig.from_flags(["chunk_size=16,32", "block_causal=true", "sampling.top_k=7",
                                                "audio_decoder_config.mode=fast", "max_batch_size=none"])
    mapping = AudioGenerationConfig.from_flags({"chunk_size": [16, 32], "block_causal": True, "sampling.top_k": 7,
                                                "audio_decoder_config.mode": "fast", "max_batch_size": None})
    assert strings.model_dump() == mapping.model_dump()
    assert (mapping.chunk_size, mapping.block_causal, mapping.sampling.top_k) == ([16, 32], True, 7)
    with pytest.raises(ValueError, match="unknown configuration key 'sampling.top_q'"):
        AudioGenerationConfig.from_flags({"sampling.top_q": 1})
