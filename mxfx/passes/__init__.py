"""Graph passes run by the mxfp8 backend on the Dynamo graph, in order.

Each pass is one module, named for its switch in :data:`mxfx.policy.PASSES` (the list of passes, in the order
they run): the pattern it matches, the replacement and why it is valid, and ``run(gm, policy, pm)``. Every hit and
every skip is recorded in the graph's precision map.
"""

import importlib

from mxfx.passes import unconverted
from mxfx.policy import PASSES

PIPELINE = (
    *((name, importlib.import_module(f"{__name__}.{name}").run) for name in PASSES),
    ("unconverted", unconverted.run),
)
"""``(switch, run)`` of each pass in order: those of :data:`mxfx.policy.PASSES`, then ``unconverted``, always on:
what reads a weight mxfx would convert but no pass rewrote is reported."""
