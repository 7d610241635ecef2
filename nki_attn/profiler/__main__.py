"""``python -m nki_attn.profiler``: print the cost-model parameter table (Markdown) that docs/performance.md embeds."""
from .params import render_table

print(render_table())
