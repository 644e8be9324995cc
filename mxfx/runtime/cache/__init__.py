"""Weight caches: the forward and dgrad operands (forms) derived from one high-precision weight, per format.

The parameter (FP32 main weight, or BF16) is the only source of truth (the recipe,
"DDP Must Be MXFP8-Aware": derived representations of the FP32 main weight). The caches are
plain tensors held here, never parameters: no gradients, not in ``state_dict``, invisible to
the optimizer. They are quantized once after each optimizer update and reused across
microbatches (the recipe, "Forward, Dgrad, and Wgrad Need Different Operands"); every
lookup checks they are fresh, so a forward never uses a stale cache. ``docs/caches.md``
describes the behaviour for users.

Modules, by concern:

* :mod:`~mxfx.runtime.cache.forms`: the registry of form families: each format registers the forms it
  builds and how (:mod:`mxfx.formats`); the cache routes requests to them.
* :mod:`~mxfx.runtime.cache.store`: one entry per weight (storage region), its identity and
  freshness (version counter, step count), :func:`lookup`, :func:`set_dgrad_at_refresh`, and
  the shared mutable state (``store.state``).
* :mod:`~mxfx.runtime.cache.operands`: the custom op the formats' GEMM operands call
  (:func:`weight_form`).
* :mod:`~mxfx.runtime.cache.refreshing`: :func:`refresh` and the global optimizer step
  post-hook (:func:`install`).
* :mod:`~mxfx.runtime.cache.compiled_step`: the refresh inside a compiled optimizer step
  (:func:`new_plan`, :func:`after_step`) and the Inductor lowering of the cache ops.
* :mod:`~mxfx.runtime.cache.inspect`: :func:`stats`, :func:`persistent_bytes`,
  :func:`num_entries`, :func:`clear`.
* :mod:`~mxfx.runtime.cache.gathered`: forms gathered by FSDP2 (:func:`install_forms`,
  :func:`step_count`).
"""

from mxfx.runtime.cache.forms import FormFamily, all_forms, counts, register
from mxfx.runtime.cache.store import (
    WEIGHT_KINDS,
    cached_formats,
    dgrad_at_refresh,
    entry_forms,
    lookup,
    set_dgrad_at_refresh,
)
from mxfx.runtime.cache.operands import weight_form
from mxfx.runtime.cache.compiled_step import after_step, new_plan, stamp_pending
from mxfx.runtime.cache.refreshing import hook_installed, install, refresh, uninstall
from mxfx.runtime.cache.inspect import clear, num_entries, persistent_bytes, reset_stats, stats
from mxfx.runtime.cache.gathered import install_forms, step_count

__all__ = [
    "FormFamily",
    "WEIGHT_KINDS",
    "after_step",
    "all_forms",
    "cached_formats",
    "clear",
    "counts",
    "dgrad_at_refresh",
    "entry_forms",
    "hook_installed",
    "install",
    "install_forms",
    "lookup",
    "new_plan",
    "num_entries",
    "persistent_bytes",
    "refresh",
    "register",
    "reset_stats",
    "set_dgrad_at_refresh",
    "stamp_pending",
    "stats",
    "step_count",
    "uninstall",
    "weight_form",
]
