"""Graph passes run by the mxfp8 backend on the Dynamo graph, in order.

Each pass is one file: the pattern it matches, the replacement and why it is
valid. Every hit and every skip is recorded in the graph's precision map.
"""

from mxfx.passes import all_to_all, batched_mm, combine, dispatch_mx, grouped_mm, linear, saved, swiglu, unconverted, weight_refresh

PIPELINE = (
    # first: dispatch/combine become mx_all_to_all before passes that consume their rows
    ("all_to_all", all_to_all.run),
    ("linear", linear.run),
    ("grouped_mm", grouped_mm.run),
    ("grouped_mm", batched_mm.run),  # same switch: HF's batched_mm experts become sorted grouped GEMMs
    ("dispatch_mx", dispatch_mx.run),  # after both: grouped GEMMs take MX made before the dispatch (received, or pre-gather)
    ("swiglu", swiglu.run),
    ("combine", combine.run),
    ("saved", saved.run),
    ("weight_refresh", weight_refresh.run),
    # last: what reads a weight mxfx would convert but no pass rewrote is reported (always on)
    ("unconverted", unconverted.run),
)
