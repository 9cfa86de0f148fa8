"""The committed generated gRPC code is what proto/ generates today."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_current(tmp_path):
    spec = importlib.util.spec_from_file_location("generate_proto", ROOT / "scripts" / "generate_proto.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    committed = ROOT / "clients" / "audio_pipeline_client" / "_proto"
    for fresh in module.generate(tmp_path):
        assert fresh.read_text() == (committed / fresh.name).read_text(), (
            f"{fresh.name} is stale: run `python scripts/generate_proto.py`")
