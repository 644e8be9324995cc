"""Graph passes run by the mxfp8 backend on the Dynamo graph, in order.

Each pass is one file: the pattern it matches, the replacement and why it is
valid. Every hit and every skip is recorded in the graph's precision map.
"""

from mxfx.passes import linear

PIPELINE = (("linear", linear.run),)
