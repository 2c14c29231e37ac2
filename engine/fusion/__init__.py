"""Strategy registry. Importing this package registers every built-in strategy."""
# registration side effect of the package:
from . import cacheblend, coinrag, epic, full, fusionrag, infoflow, prophetkv, qcfuse, reuse, sift  # noqa: F401
from .base import (SelectContext, Strategy, available, budget_for, make_strategy, probes, register,
                   topk_positions)

#: The strategy used when none is named. InfoFlow had the lowest KL to full prefill on 3 of the 4 dev QA sets at
#: 15% recompute (docs/quality/), at the same GPU TTFT as CacheBlend.
DEFAULT_STRATEGY = "infoflow"

__all__ = ["DEFAULT_STRATEGY", "SelectContext", "Strategy", "available", "budget_for", "make_strategy", "probes",
           "register", "topk_positions"]
