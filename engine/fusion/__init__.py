"""Strategy registry. Importing this package registers every built-in strategy."""
from . import cacheblend, epic, full, reuse  # noqa: F401  (registration side effect of the package)
from .base import SelectContext, Strategy, available, budget_for, make_strategy, register, topk_positions

__all__ = ["SelectContext", "Strategy", "available", "budget_for", "make_strategy", "register", "topk_positions"]
