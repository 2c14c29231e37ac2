"""`full`: the reference. Every token is computed; no cache is read."""
from .base import SelectContext, Strategy, register


@register
class Full(Strategy):
    name = "full"
    graph_safe = True
    layout_free = True
    uses_cache = False
    ignores_ratio = True

    def initial(self, ctx: SelectContext):
        return ctx.candidates
