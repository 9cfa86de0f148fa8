"""The reliability suite, quick version: hostile requests, cancels, overload, a slow reader and SIGTERM
against a real `audio-pipeline serve` (the full run: `python -m audio_pipeline.bench.reliability`)."""

import pytest

from audio_pipeline.bench.fuzz import fuzz_cases
from audio_pipeline.bench.reliability import main
from audio_pipeline_client._proto import tts_pb2

#: Real servers and whole voices: left out of the quick subset (scripts/test.sh -m "not slow").
pytestmark = pytest.mark.slow


def test_fuzz_cases_are_reproducible_and_cover_every_kind():
    cases = fuzz_cases(300, seed=5)
    assert cases == fuzz_cases(300, seed=5) and cases != fuzz_cases(300, seed=6)
    assert {c.kind for c in cases} == {"fields", "corrupt", "utf8"}
    # Field cases are well-formed messages; the others mostly are not.
    for case in cases:
        if case.kind == "fields":
            tts_pb2.SynthesizeRequest.FromString(case.payload)


def test_quick_reliability_run_passes_every_check(capsys):
    assert main(["--fuzz", "150", "--cancels", "30", "--grace", "5"]) == 0
    out = capsys.readouterr().out
    assert "fuzz: no UNKNOWN, INTERNAL or hang" in out and "SIGTERM" in out
    assert "FAIL" not in out and out.rstrip().endswith("PASS")
