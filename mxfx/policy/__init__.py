"""The per-op precision policy and what it decides from: :class:`Policy` and :class:`Rule` (``policy.py``), and the
measured crossover tables of ``min_size="auto"``, one per format and GPU (``crossover.py``,
``crossover_mxfp8_sm90.json``).

The settings a decision gives an op (:class:`mxfx.ops.settings.OpSettings`) live with the ops that read them: the
ops sit below the policy and import nothing above them.
"""

from mxfx.policy.policy import (  # noqa: F401
    DEFAULT_RULES,
    KIND_FIELDS,
    NARROW,
    OP_KINDS,
    PASSES,
    Decision,
    Policy,
    Rule,
)
