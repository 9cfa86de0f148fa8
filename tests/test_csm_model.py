"""Our Sesame CSM (audio_pipeline.models.csm) against transformers' CsmForConditionalGeneration on tiny
random checkpoints (tests/csm_model.py): the backbone over the paged KV cache (text and audio
positions, prefill then one-position steps), the depth decoder's frames, greedy generation end to
end, and the checkpoint's tied and ignored weights."""

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, CsmForConditionalGeneration

from audio_pipeline.config import KVCacheConfig, PipelineConfig
from audio_pipeline.core.kv_cache import PagedKVCacheManager
from audio_pipeline.core.kv_cache.build import build_kv_cache
from audio_pipeline.models.csm import CsmSpeechLM
from audio_pipeline.models.csm_model import CsmPipelineModel
from audio_pipeline.models.weights import load_safetensors_into
from csm_model import AUDIO, BOS, EOS, hf_generate_frames, write_tiny_csm

ATOL = 1e-4
TIED = ("backbone_model.embed_tokens.embed_audio_tokens.weight", "depth_decoder.model.embed_tokens.weight")
#: CSM-1B's RoPE (llama3 scaling), on both the backbone and the depth decoder.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def load_ours(model_dir) -> CsmSpeechLM:
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = CsmSpeechLM(config)
    load_safetensors_into(model, model_dir, torch.float32, torch.device("cpu"), ignore_prefixes=("codec_model.",))
    model.reset_rotary(torch.device("cpu"))
    return model.eval()


def load_reference(model_dir):
    return CsmForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()


def paged_manager(csm_config, attention_kernel="auto", block_size=4, num_blocks=128):
    params = CsmPipelineModel.get_kv_params(csm_config, 1, KVCacheConfig(kv_cache_page_size=block_size), torch.float32)
    return PagedKVCacheManager(params, torch.device("cpu"), num_blocks, enable_prefix_caching=False,
                               attention_kernel=attention_kernel, num_heads=csm_config.num_attention_heads)


@pytest.fixture(scope="module", params=["default_rope", "llama3_rope"])
def model_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "llama3_rope":
        return write_tiny_csm(path, seed=5, rope_parameters=LLAMA3_ROPE,
                              depth_decoder_config=dict(rope_parameters=LLAMA3_ROPE))
    return write_tiny_csm(path, seed=1)


def mixed_sequence(generator, length, audio_spans, num_codebooks=8, codebook_size=16):
    """Random text ids and, inside ``audio_spans``, random frames (-1 rows elsewhere); the ids at audio
    positions are random too (the model must ignore them)."""
    ids = torch.randint(0, 300, (length,), generator=generator)
    frames = torch.full((length, num_codebooks), -1, dtype=torch.long)
    for a, b in audio_spans:
        frames[a:b] = torch.randint(0, codebook_size, (b - a, num_codebooks), generator=generator)
    return ids, frames


def reference_outputs(reference, ids, frames):
    """transformers' backbone hidden states (after the final norm) and logits for one sequence, its
    audio positions embedded by transformers' own audio embedding."""
    embeds = reference.embed_text_tokens(ids[None])
    audio = frames[:, 0] >= 0
    if audio.any():
        embeds[0, audio] = reference.backbone_model.embed_tokens(frames[audio][None])[0]
    out = reference(inputs_embeds=embeds, output_hidden_states=True)
    return out.hidden_states[-1][0], out.logits[0]


@pytest.mark.parametrize("attention_kernel", ["auto", "torch"])
def test_backbone_matches_transformers_on_text_and_audio_positions(model_dir, attention_kernel):
    """A ragged batch (text only, text then audio, audio between text), prefilled in one pass, then
    decoded one position per sequence per step on top of the paged cache."""
    ours, reference = load_ours(model_dir), load_reference(model_dir)
    generator = torch.Generator().manual_seed(0)
    sequences = [mixed_sequence(generator, 11, []), mixed_sequence(generator, 17, [(6, 17)]),
                 mixed_sequence(generator, 14, [(2, 7), (9, 10)])]
    prefill = [6, 9, 5]
    kv = paged_manager(ours.csm_config, attention_kernel)
    names = [f"seq{i}" for i in range(len(sequences))]
    for name, (ids, _) in zip(names, sequences):
        kv.claim(name)
        kv.block_manager.alloc(name, len(ids))
    hidden_parts = [[] for _ in sequences]
    spans = [[(0, k)] + [(p, p + 1) for p in range(k, len(ids))] for k, (ids, _) in zip(prefill, sequences)]
    with torch.no_grad():
        for step in range(max(len(s) for s in spans)):
            live = [i for i, s in enumerate(spans) if step < len(s)]
            chunks = [(i, *spans[i][step]) for i in live]
            ids = torch.cat([sequences[i][0][a:b] for i, a, b in chunks])
            frames = torch.cat([sequences[i][1][a:b] for i, a, b in chunks])
            positions = torch.cat([torch.arange(a, b) for _, a, b in chunks])
            batch = kv.batch([names[i] for i in live], [a for _, a, _ in chunks], [b - a for _, a, b in chunks])
            hidden = ours(ids, positions, batch, frames=frames)
            row = 0
            for i, a, b in chunks:
                hidden_parts[i].append(hidden[row:row + b - a])
                row += b - a
        for (ids, frames), parts in zip(sequences, hidden_parts):
            want_hidden, want_logits = reference_outputs(reference, ids, frames)
            got = torch.cat(parts)
            torch.testing.assert_close(got, want_hidden, atol=ATOL, rtol=0)
            torch.testing.assert_close(ours.compute_logits(got), want_logits, atol=ATOL, rtol=0)
            assert ours.compute_logits(got).dtype == torch.float32


def test_text_prompt_without_frames_matches_transformers_input_ids(model_dir):
    """frames=None: every position is text, as transformers embeds a 2-D input_ids prompt."""
    ours, reference = load_ours(model_dir), load_reference(model_dir)
    ids = torch.tensor([BOS, *b"Hello there, world.", EOS])
    kv = paged_manager(ours.csm_config)
    kv.claim("a")
    kv.block_manager.alloc("a", len(ids))
    with torch.no_grad():
        got = ours(ids, torch.arange(len(ids)), kv.batch(["a"], [0], [len(ids)]))
        want = reference(input_ids=ids[None], output_hidden_states=True)
    torch.testing.assert_close(got, want.hidden_states[-1][0], atol=ATOL, rtol=0)
    torch.testing.assert_close(ours.compute_logits(got), want.logits[0], atol=ATOL, rtol=0)


def test_out_of_range_ids_are_clamped_not_looked_up(model_dir):
    """Ids at audio positions may be anything (the layout's placeholder); frames' -1 rows are text."""
    ours = load_ours(model_dir)
    frames = torch.tensor([[-1] * 8, [3] * 8])
    ids = torch.tensor([5, 10**6])
    x = ours.embed(ids, frames)
    torch.testing.assert_close(x[0], ours.embed_text_tokens.weight[5])
    offsets = torch.arange(8) * 16
    torch.testing.assert_close(x[1], ours.backbone_model.embed_tokens.embed_audio_tokens.weight[3 + offsets].sum(0))


def greedy(k, logits):
    return logits.argmax(-1)


def test_depth_frame_matches_transformers_depth_generate(model_dir):
    ours, reference = load_ours(model_dir), load_reference(model_dir)
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(3, 32, generator=generator) * 1.5
    first = torch.tensor([4, 11, 0])
    seen = []

    def choose(k, logits):
        seen.append((k, tuple(logits.shape), logits.dtype))
        return logits.argmax(-1)

    got = ours.depth_frame(hidden, first, choose)
    with torch.no_grad():
        want = reference.depth_decoder.generate(input_ids=F.pad(first[:, None], (1, 0)),
                                                backbone_last_hidden_state=hidden, do_sample=False,
                                                min_new_tokens=7, max_new_tokens=7)
    assert got.shape == (3, 8) and got.dtype == torch.long
    assert got.tolist() == want[:, 1:].tolist()
    assert seen == [(k, (3, 16), torch.float32) for k in range(1, 8)]
    assert len({tuple(row) for row in got.tolist()}) == 3


def test_depth_frame_rows_are_independent_of_the_batch(model_dir):
    ours = load_ours(model_dir)
    hidden = torch.randn(4, 32, generator=torch.Generator().manual_seed(3))
    first = torch.tensor([1, 2, 3, 4])
    together = ours.depth_frame(hidden, first, greedy)
    alone = torch.cat([ours.depth_frame(hidden[i:i + 1], first[i:i + 1], greedy) for i in range(4)])
    assert together.tolist() == alone.tolist()


def test_greedy_generation_matches_transformers_generate(model_dir):
    """Backbone over the paged cache + depth_frame, each frame fed back as an audio position,
    reproduce transformers' greedy generate frame for frame."""
    ours = load_ours(model_dir)
    prompt = [BOS, *b"[0]A tiny test.", EOS]
    max_frames = 8
    want = hf_generate_frames(model_dir, prompt, max_frames)
    kv = paged_manager(ours.csm_config)
    kv.claim("s")
    kv.block_manager.alloc("s", len(prompt) + max_frames)
    ids, frames, start = torch.tensor(prompt), None, 0
    got = []
    with torch.no_grad():
        while len(got) < len(want):
            hidden = ours(ids, torch.arange(start, start + len(ids)), kv.batch(["s"], [start], [len(ids)]),
                          frames=frames)[-1:]
            first = ours.compute_logits(hidden).argmax(-1)
            frame = ours.depth_frame(hidden, first, greedy)
            got.append(frame[0].tolist())
            start += len(ids)
            ids, frames = torch.tensor([AUDIO]), frame
    assert got == want
    assert len({tuple(f) for f in got}) > 1


# --- weights ---------------------------------------------------------------------------------------


def copy_checkpoint(model_dir, tmp_path, edit):
    state = load_file(str(model_dir / "model.safetensors"))
    edit(state)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((model_dir / "config.json").read_text())
    return tmp_path


@pytest.mark.parametrize("stored", ["depth", "backbone", "both"])
def test_tied_codebook_embedding_loads_from_either_name(model_dir, tmp_path, stored):
    original = load_file(str(model_dir / "model.safetensors"))
    weight = original[TIED[1]]
    assert TIED[0] not in original  # transformers saves the depth decoder's name

    def edit(state):
        if stored in ("backbone", "both"):
            state[TIED[0]] = weight.clone()
        if stored == "backbone":
            del state[TIED[1]]

    ours = load_ours(copy_checkpoint(model_dir, tmp_path, edit))
    backbone = ours.backbone_model.embed_tokens.embed_audio_tokens.weight
    assert backbone is ours.depth_decoder.model.embed_tokens.weight
    assert torch.equal(backbone, weight)


def test_codec_keys_are_skipped_and_unknown_keys_reported(model_dir, tmp_path):
    state = load_file(str(model_dir / "model.safetensors"))
    assert any(k.startswith("codec_model.") for k in state)
    with pytest.raises(ValueError, match=r"unexpected \['codec_model\."):
        with torch.device("meta"):
            model = CsmSpeechLM(AutoConfig.from_pretrained(model_dir))
        load_safetensors_into(model, model_dir, torch.float32, torch.device("cpu"))

    def edit(state):
        state["backbone_model.extra.weight"] = torch.zeros(2)
        del state["lm_head.weight"]

    with pytest.raises(ValueError, match=r"missing \['lm_head.weight'\].*unexpected \['backbone_model.extra.weight'\]"):
        load_ours(copy_checkpoint(model_dir, tmp_path, edit))


# --- the PipelineModel -----------------------------------------------------------------------------


def test_pipeline_model_sizes_from_the_backbone_and_runs_frames(model_dir):
    config = AutoConfig.from_pretrained(model_dir)
    kv_config = KVCacheConfig(kv_cache_page_size=4)
    served = PipelineConfig(model={"model_path": str(model_dir), "compile": True}).for_device("cpu")
    pipeline = CsmPipelineModel(served, config, model_dir, devices=[torch.device("cpu")], dtype=torch.float32,
                                kv_cache_config=kv_config)
    params = pipeline.kv_params
    assert (params.num_layers, params.n_kv_heads, params.head_dim) == (2, 2, 8)
    assert pipeline.max_seq_len == 1024 and CsmPipelineModel.get_num_layers(config) == 2
    assert pipeline.codes_per_token == 8 and pipeline.model.lm_head.weight.shape == (16, 32)
    assert pipeline.forward is pipeline.model  # eager even with model.compile
    kv = build_kv_cache(pipeline, 1 << 20)
    kv.claim("s")
    kv.block_manager.alloc("s", 3)
    frames = torch.tensor([[-1] * 8, [1] * 8, [2] * 8])
    with torch.no_grad():
        hidden = pipeline.forward(torch.tensor([BOS, AUDIO, AUDIO]), torch.arange(3), kv.batch(["s"], [0], [3]),
                                  frames=frames)
    reference = load_ours(model_dir)
    torch.testing.assert_close(pipeline.depth_frame(hidden[-1:], torch.tensor([5]), greedy),
                               reference.depth_frame(hidden[-1:], torch.tensor([5]), greedy))


def test_random_weights_are_not_supported(model_dir):
    with pytest.raises(NotImplementedError):
        CsmPipelineModel(PipelineConfig(model={"model_path": str(model_dir)}), AutoConfig.from_pretrained(model_dir),
                         model_dir, devices=[torch.device("cpu")], dtype=torch.float32,
                         kv_cache_config=KVCacheConfig(), random_weights=True)
