"""torchtitan 0.2 train specs at two MoE models' real per-layer shapes, with fewer layers.

Importing this module (``--experimental.custom_import real_shapes``, with this folder on ``PYTHONPATH``)
registers, through torchtitan's ``register_train_spec``:

- ``qwen3_30b_a3b``: torchtitan's ``qwen3`` train spec; its ``30B-A3B`` flavor (dim 2048, 32 query / 4 KV
  heads of 128, 128 routed experts top-8 of hidden 768, vocabulary 151936).
- ``deepseek_v3_16b``: torchtitan's ``deepseek_v3`` train spec; its ``16B`` flavor (dim 2048, MLA with KV rank
  512, 16 heads, a dense first block of hidden 10944, then 64 routed experts top-6 of hidden 1408 and 2 shared
  experts), with causal SDPA in place of the flavor's FlexAttention (see ``SOURCES``).

Flavors are named ``<n>layers`` (the first ``n`` blocks, the model's vocabulary) or ``<n>layers_vocab<v>`` (a
vocabulary of ``v``, e.g. a small test tokenizer's); every other field is torchtitan's flavor's, but for the
``SOURCES`` changes.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Iterator, Mapping

from torchtitan.models import deepseek_v3, qwen3
from torchtitan.protocols.train_spec import get_train_spec, register_train_spec

# spec name -> (torchtitan model, its flavor, fields changed in every derived flavor)
SOURCES = {
    "qwen3_30b_a3b": ("qwen3", "30B-A3B", {}),
    # torchtitan 0.2's FlexAttention compiles itself with Inductor inside the block's compile; SDPA with a
    # causal mask runs the same attention under any backend (no document masking between packed samples).
    "deepseek_v3_16b": ("deepseek_v3", "16B", {"attn_type": "sdpa", "attn_mask_type": "causal"}),
}
_NAME = re.compile(r"(\d+)layers(?:_vocab(\d+))?")


def base_flavor(spec: str):
    """torchtitan's own model args that ``spec`` derives its flavors from (not a copy: do not change it)."""
    model, name, _ = SOURCES[spec]
    return {"qwen3": qwen3.qwen3_args, "deepseek_v3": deepseek_v3.deepseekv3_args}[model][name]


def flavor(spec: str, name: str):
    """The model args of flavor ``name`` (``<n>layers[_vocab<v>]``) of ``spec``: a copy of torchtitan's flavor
    with ``n_layers`` (1 to the model's own count), the vocabulary and the ``SOURCES`` fields changed."""
    base = base_flavor(spec)
    m = _NAME.fullmatch(name)
    if m is None or not 1 <= int(m.group(1)) <= base.n_layers:
        raise KeyError(
            f"{spec}: flavor {name!r} is not '<n>layers' or '<n>layers_vocab<v>' with 1 <= n <= {base.n_layers}"
        )
    args = copy.deepcopy(base)  # torchtitan's trainer changes the args it builds from in place
    args.n_layers = int(m.group(1))
    if m.group(2):
        args.vocab_size = int(m.group(2))
    for key, value in SOURCES[spec][2].items():
        setattr(args, key, value)
    return args


class Flavors(Mapping):
    """The flavors of one spec, built on first lookup and kept (a lookup returns the same args object, as a dict
    would). Iterates over the flavors looked up so far and ``<n>layers`` with the model's own layer count."""

    def __init__(self, spec: str):
        self.spec = spec
        self._built: dict = {}

    def __getitem__(self, name: str):
        if name not in self._built:
            self._built[name] = flavor(self.spec, name)
        return self._built[name]

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys([*self._built, f"{base_flavor(self.spec).n_layers}layers"]))

    def __len__(self) -> int:
        return len(list(iter(self)))


for _spec, (_model, _, _) in SOURCES.items():
    register_train_spec(_spec, dataclasses.replace(get_train_spec(_model), model_args=Flavors(_spec)))
