"""`reuse` (TurboRAG-style, no fine-tune): cached documents are used as they are; only the question runs."""
from .base import Strategy, register


@register
class Reuse(Strategy):
    name = "reuse"
    graph_safe = True
    layout_free = True
    ignores_ratio = True
