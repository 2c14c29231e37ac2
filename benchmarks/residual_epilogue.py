"""The decoder's residual adds in the GEMM epilogue against the shipped separate add kernel, side by side in one
run: `benchmarks/ab_ttft.py --variant epilogue` (this name is kept for the commands in docs/gpu/README.md).

    python benchmarks/residual_epilogue.py --shapes qwen05b,llama8b --contexts 8192,32768 --strategies full,infoflow
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))

from ab_ttft import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(default_variant="epilogue"))
