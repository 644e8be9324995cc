"""What mxfx tells about a compiled model: ops and weights left unconverted (``coverage.py``), the graph breaks
behind them (``graph_breaks.py``), policy rules that do not apply as written (``rule_check.py``), when those are
judged (``judgment.py``), and frames Dynamo gave up compiling (``recompiles.py``). The precision map they read
(:mod:`mxfx.report`) sits below the passes, which write it.
"""
