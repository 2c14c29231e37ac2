"""Strategy registry. Importing this package registers every built-in strategy."""
# registration side effect of the package:
from . import cacheblend, epic, full, fusionrag, infoflow, prophetkv, qcfuse, reuse  # noqa: F401
from .base import SelectContext, Strategy, available, budget_for, make_strategy, register, topk_positions

__all__ = ["SelectContext", "Strategy", "available", "budget_for", "make_strategy", "register", "topk_positions"]
