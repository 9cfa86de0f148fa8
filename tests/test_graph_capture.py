"""The captured-call helper every CUDA graph of the engine goes through (cuda/graphs.py): bucket
choice, and on the CPU (``capture=False``) a call that reads its fixed buffers as they are when it
runs. The captures themselves run in tests/test_cuda.py."""

from __future__ import annotations

import pytest
import torch

from audio_pipeline.cuda.graphs import Buckets, GraphPool


def test_a_call_of_n_rows_takes_the_smallest_bucket_that_holds_them():
    buckets = Buckets([8, 1, 4, 4, 2])
    assert buckets.sizes == [1, 2, 4, 8] and buckets.largest == 8 and str(buckets) == "1,2,4,8"
    assert [buckets.fit(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, None]


@pytest.mark.parametrize("sizes", [[], [0, 4], [-1]])
def test_buckets_must_be_positive(sizes):
    with pytest.raises(ValueError, match="batch buckets must be positive"):
        Buckets(sizes)


def test_an_uncaptured_call_reads_its_buffers_at_each_call_and_counts():
    pool = GraphPool("cpu", capture=False)
    inputs = torch.zeros(4)
    call = pool.call(lambda: inputs * 2 + 1)
    assert pool.replays == 0 and call.graph is None  # nothing ran at "capture"
    inputs[:2].copy_(torch.tensor([1.0, 3.0]))
    assert call()[:2].tolist() == [3.0, 7.0]
    inputs[:1].copy_(torch.tensor([5.0]))
    assert call().tolist() == [11.0, 7.0, 1.0, 1.0] and pool.replays == 2
    assert not torch.is_inference_mode_enabled()  # the call's inference mode ends with it
