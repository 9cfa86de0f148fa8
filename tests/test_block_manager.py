"""The torch-free paged block manager: allocation, release, prefix sharing, eviction, watermark."""

import sys

import pytest

from audio_pipeline.core.kv_cache.block_manager import BlockManager, KVCacheFull


def test_the_block_manager_does_not_import_torch():
    import subprocess

    code = "import sys, audio_pipeline.core.kv_cache.block_manager, audio_pipeline.core.scheduler; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_alloc_grows_by_whole_blocks_and_release_frees_everything():
    manager = BlockManager(10, 4, enable_prefix_caching=False)
    manager.claim("a")
    manager.alloc("a", 5)
    assert len(manager.block_table("a")) == 2 and manager.num_used_blocks == 2
    manager.alloc("a", 8)  # still fits in two blocks
    assert manager.num_used_blocks == 2
    manager.alloc("a", 9)
    assert manager.num_used_blocks == 3
    manager.claim("b")
    manager.alloc("b", 28)
    assert manager.num_free_blocks == 0
    with pytest.raises(KVCacheFull, match="needs 1 more KV blocks, 0 free"):
        manager.alloc("a", 13)
    manager.release("a")
    manager.release("b")
    manager.release("b")  # idempotent
    assert manager.num_used_blocks == 0 and manager.num_free_blocks == 10 and manager.sequences == []


def test_shared_prompt_prefix_is_reused_and_counted():
    manager = BlockManager(16, 4)
    prompt = list(range(100, 111))  # 11 tokens: two full blocks and a partial one
    assert manager.claim("a", prompt) == 0
    manager.alloc("a", len(prompt))
    manager.step("a", prompt)
    assert manager.num_cached_blocks == 2

    other = prompt[:8] + [7, 7, 7, 7]  # the same first two blocks, then different
    assert manager.claim("b", other) == 8
    assert manager.block_table("b")[:2] == manager.block_table("a")[:2]
    manager.alloc("b", len(other))
    assert manager.num_used_blocks == 3 + 1  # a: 3 blocks; b: shares 2, owns 1 more
    assert manager.prefix_stats.queried_tokens == len(prompt) + len(other)
    assert manager.prefix_stats.hit_tokens == 8
    assert manager.prefix_stats.hit_rate == pytest.approx(8 / 23)

    manager.release("a")
    assert manager.num_used_blocks == 3  # b still holds the two shared blocks and its own
    manager.release("b")
    assert manager.num_used_blocks == 0


def test_a_prompt_never_reuses_its_own_last_token():
    manager = BlockManager(8, 4)
    prompt = list(range(8))  # exactly two blocks
    manager.claim("a", prompt)
    manager.alloc("a", 8)
    manager.step("a", prompt)
    manager.release("a")
    # Reusing both blocks would leave nothing to compute the next-token logits from.
    assert manager.claim("b", prompt) == 4


def test_released_prefix_stays_cached_until_space_is_needed_lru_first():
    manager = BlockManager(4, 2)
    for name, base in (("a", 0), ("b", 100)):
        tokens = [base, base + 1, base + 2]
        manager.claim(name, tokens)
        manager.alloc(name, 4)
        manager.step(name, tokens)
        manager.release(name)
    assert manager.num_used_blocks == 0 and manager.num_cached_blocks == 2
    assert manager.claim("a2", [0, 1, 2]) == 2  # a's block came back from the evictable pool
    manager.release("a2")
    # Filling the cache evicts the least recently released cached block first: b's.
    manager.claim("c", [])
    manager.alloc("c", 6)
    assert manager.claim("b2", [100, 101, 102]) == 0
    assert manager.claim("a3", [0, 1, 2]) == 2


def test_watermark_limits_projected_usage():
    manager = BlockManager(10, 4)
    manager.claim("a")
    manager.alloc("a", 32)  # 8 of 10 blocks
    assert manager.can_alloc("b", 4)
    assert not manager.can_alloc("b", 4, watermark=0.85)
    assert manager.can_alloc("b", 4, watermark=0.9)
    assert not manager.can_alloc("b", 12)


def test_holds_says_whether_a_sequence_needs_no_more_blocks():
    """The decode scheduler's shortcut: a row whose blocks already cover its next tokens skips
    can_alloc and alloc; one that crosses into a new block, or is unknown, does not."""
    manager = BlockManager(10, 4)
    manager.claim("a")
    manager.alloc("a", 5)  # 2 blocks: room for 8 tokens
    assert manager.holds("a", 5) and manager.holds("a", 8)
    assert not manager.holds("a", 9) and not manager.holds("b", 1)
    manager.release("a")
    assert not manager.holds("a", 1)


def test_step_refuses_tokens_beyond_the_allocation():
    manager = BlockManager(4, 4)
    manager.claim("a")
    manager.alloc("a", 4)
    with pytest.raises(ValueError, match="5 tokens committed but only 1 blocks allocated"):
        manager.step("a", [1, 2, 3, 4, 5])
    manager.step("gone", [1])  # a released sequence's late commit is ignored


def test_commit_asks_for_the_tokens_only_when_a_block_filled_and_caches_as_step_does():
    tokens = list(range(100, 120))
    asked = []

    def prefix(count):
        asked.append(count)
        return tokens[:count]

    manager = BlockManager(8, 4)
    manager.claim("a")
    manager.alloc("a", 13)  # four blocks
    for count in range(1, 14):  # one token a step, as decode steps write them
        manager.commit("a", count, prefix, count)
    assert asked == [4, 8, 12]  # one call per filled block, none for the other ten steps
    assert manager.num_cached_blocks == 3
    # Another sequence with the same tokens finds the three blocks, as after step().
    assert manager.claim("b", tokens[:13]) == 12
    with pytest.raises(ValueError, match="17 tokens committed but only 4 blocks allocated"):
        manager.commit("a", 17, prefix, 17)
    manager.commit("gone", 4, prefix, 4)  # a released sequence's late commit is ignored
    assert asked == [4, 8, 12, 17]


def test_a_cache_that_may_grow_asks_for_twice_its_size_up_to_its_most():
    """A cache that starts small grows when an allocation (or an admission within its watermark)
    needs more: to about twice its size, never past max_num_blocks, keeping every sequence's blocks
    and the prefix cache as they were; past its most it is full as any cache is."""
    asked = []

    def grow(total):
        asked.append(total)
        return total

    manager = BlockManager(2, 4, max_num_blocks=7, grow=grow)
    manager.claim("a", list(range(8)))
    manager.alloc("a", 8)
    manager.step("a", list(range(8)))
    assert (manager.total_num_blocks, asked) == (2, [])
    manager.claim("b")
    manager.alloc("b", 5)  # two more blocks: the cache doubles
    assert (manager.total_num_blocks, asked) == (4, [4])
    assert manager.block_table("a") == [0, 1] and manager.block_table("b") == [2, 3]
    assert manager.can_alloc("c", 8, watermark=0.9)  # admitted: the cache grows to make room
    assert asked == [4, 7] and manager.max_num_blocks == manager.total_num_blocks == 7
    manager.claim("c")
    manager.alloc("c", 12)
    with pytest.raises(KVCacheFull):
        manager.alloc("c", 13)
    manager.release("a")
    manager.claim("d", list(range(8)) + [99])
    assert manager.block_table("d") == [0, 1]  # a's prefix is still cached after growing


def test_a_cache_without_a_grow_hook_keeps_its_size():
    manager = BlockManager(2, 4, max_num_blocks=8)
    manager.claim("a")
    with pytest.raises(KVCacheFull):
        manager.alloc("a", 9)
    assert manager.total_num_blocks == 2


class _Owner:
    def __init__(self, request_id, processed):
        self.request_id, self.processed = request_id, processed


@pytest.mark.parametrize("prefix", [False, True])
def test_a_sliding_window_hands_back_the_blocks_no_query_sees_again(prefix):
    """With a window of 10 positions and blocks of 4, a sequence that has written n tokens keeps
    the blocks holding positions from n + 1 - 10 on (what its next query, at n, sees): a long
    sequence holds about a window's worth, through every way tokens are committed; the dropped
    places keep their index (HOLE) and release frees only what is held."""
    from audio_pipeline.core.kv_cache.block_manager import HOLE

    manager = BlockManager(12, 4, enable_prefix_caching=prefix, window=10)
    manager.claim("a")
    tokens = list(range(1000))
    for n in range(1, 41):
        manager.alloc("a", n)
        if n % 3 == 0:
            manager.step("a", tokens[:n])
        elif n % 3 == 1:
            manager.commit_all([_Owner("a", n)], lambda owner: tokens[:owner.processed])
        else:
            manager.commit("a", n, lambda owner: tokens[:n], None)
        held = [b for i, b in enumerate(manager.block_table("a")) if i >= max(0, n + 1 - 10) // 4]
        assert manager.num_used_blocks == len(held) <= 4
        assert manager.block_table("a")[:max(0, n + 1 - 10) // 4] == [HOLE] * (max(0, n + 1 - 10) // 4)
    row = manager.page_rows(["a"])[0]
    assert manager.page_table[row, :manager.page_counts[row]].tolist() == manager.block_table("a")
    assert manager.held_tokens(10_000) == 18 and BlockManager(4, 4).held_tokens(10_000) == 10_000
    # Another sequence takes the blocks handed back; releasing the first frees only its own.
    manager.claim("b")
    manager.alloc("b", 8 * 4)
    manager.release("a")
    manager.release("b")
    assert manager.num_used_blocks == 0 and manager.num_free_blocks == 12
