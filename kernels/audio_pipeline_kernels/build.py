"""Builds the native CPU kernels ahead of their first use: ``python -m audio_pipeline_kernels.build``.

Each kernel compiles on its first call otherwise (native_build.py), about 20 to 40 s apiece on a
2-core machine, in the first request a server serves (or the first test that needs it). The set-up
script runs this once, so that cost is paid at installation, with the kernels compiling side by
side (the compiler is a subprocess: threads overlap the builds). Built kernels are cached in
torch's extension folder under a fingerprint of their source, flags and CPU: a second run finds
them and returns at once. A kernel that cannot be built (no C++ compiler) is reported and skipped:
the engine runs its torch form instead, as it would at run time.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor


def _kernels():
    from audio_pipeline_kernels.native_decode import native_decode
    from audio_pipeline_kernels.native_paged_attention import native_attention
    from audio_pipeline_kernels.native_sampler import native_sampler

    return {"decode layers and products": native_decode, "paged attention": native_attention,
            "sampler": native_sampler}


def build_all() -> dict[str, bool]:
    """Builds (or finds) every native kernel, side by side; name -> whether it is available."""
    kernels = _kernels()
    with ThreadPoolExecutor(len(kernels)) as pool:
        built = {name: pool.submit(kernel) for name, kernel in kernels.items()}
        return {name: future.result() is not None for name, future in built.items()}


def main() -> int:
    started = time.perf_counter()
    available = build_all()
    missing = [name for name, ok in available.items() if not ok]
    print(f"native CPU kernels: {len(available) - len(missing)} of {len(available)} ready in "
          f"{time.perf_counter() - started:.0f} s" + (f" ({', '.join(missing)}: the torch form serves)" if missing
                                                      else ""), file=sys.stderr)
    return 0  # a kernel that cannot be built is not an installation failure: its torch form serves


if __name__ == "__main__":
    sys.exit(main())
