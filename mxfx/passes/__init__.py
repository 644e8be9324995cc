"""Graph passes run by the mxfp8 backend on the Dynamo graph, in order.

Each pass is one file: the pattern it matches, the replacement and why it is
valid. Every hit and every skip is recorded in the graph's precision map.
"""

from mxfx.passes import all_to_all, combine, dispatch_mx, grouped_mm, linear, saved, swiglu, weight_refresh

PIPELINE = (
    # first: dispatch/combine become mx_all_to_all before passes that consume their rows
    ("all_to_all", all_to_all.run),
    ("linear", linear.run),
    ("grouped_mm", grouped_mm.run),
    ("dispatch_mx", dispatch_mx.run),  # after both: grouped GEMMs take MX made before the dispatch (received, or pre-gather)
    ("swiglu", swiglu.run),
    ("combine", combine.run),
    ("saved", saved.run),
    ("weight_refresh", weight_refresh.run),
)
