"""Regenerates the committed Python gRPC code from proto/ (run after editing a .proto file).

    python scripts/generate_proto.py [OUT_DIR]

The code goes to clients/audio_pipeline_client/_proto/ by default; tests/test_proto_current.py
regenerates into a temporary folder and fails if the committed files differ.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTO_FILES = ["audio_pipeline/v1/tts.proto"]
DEFAULT_OUT = ROOT / "clients" / "audio_pipeline_client" / "_proto"
CLIENT_PACKAGE = "audio_pipeline_client._proto"


def generate(out_dir: Path) -> list[Path]:
    """Writes tts_pb2.py, tts_pb2.pyi and tts_pb2_grpc.py into ``out_dir``; returns their paths."""
    from grpc_tools import protoc  # build-time only: the client library does not need grpcio-tools

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        include = str(Path(protoc.__file__).parent / "_proto")
        args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={tmp}",
                f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", *PROTO_FILES]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        for proto in PROTO_FILES:
            stem = Path(proto).with_suffix("")
            for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
                source = Path(tmp) / f"{stem}{suffix}"
                text = source.read_text()
                # Generated modules live in one flat package: make their imports relative.
                package = ".".join(stem.parent.parts)
                text = re.sub(rf"^from {re.escape(package)} import ", "from . import ", text, flags=re.M)
                # The messages' __module__ is the module they are imported from, so they pickle (Ray
                # Serve passes requests and chunks between its proxy and the replicas as pickles).
                text = text.replace(f"'{package}.{stem.name}_pb2'", f"'{CLIENT_PACKAGE}.{stem.name}_pb2'")
                target = out_dir / source.name
                target.write_text(text)
                written.append(target)
    init = out_dir / "__init__.py"
    init.write_text('"""Generated gRPC code for proto/audio_pipeline/v1 (scripts/generate_proto.py)."""\n')
    written.append(init)
    return written


def main() -> None:
    out_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT
    if out_dir == DEFAULT_OUT and out_dir.exists():
        shutil.rmtree(out_dir)
    for path in generate(out_dir):
        print(path)


if __name__ == "__main__":
    main()
