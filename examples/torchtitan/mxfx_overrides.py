"""torchtitan config overrides for training its MoE debug models under ``--compile.backend mxfp8``.

Activate with ``--override.imports mxfx_overrides.mxfx_model`` (this directory on
``PYTHONPATH``); torchtitan's override mechanism swaps configs before anything is built.

- :func:`sdpa_attention`: torchtitan's language models default to FlexAttention, and torchtitan
  refuses any compile backend other than ``inductor`` / ``aot_eager`` for a model with
  FlexAttention (it has only an Inductor lowering). This swaps it for causal SDPA, which
  torchtitan's trainer supports as its maskless attention (no per-document masks: packed
  documents attend to each other, the same in every compile backend).
- :func:`mxfx_model` (the one to use): the SDPA swap on the whole model, plus the model
  registered with ``mxfx.name_modules`` so policy rules (``MXFX_POLICY``) match the whole model's
  names (``layers.3.attention.wo``) although torchtitan compiles each block on its own; kwarg
  ``expert_hidden_dim`` shrinks the routed experts for quick runs.
"""

from __future__ import annotations

import dataclasses

import mxfx
from torchtitan.config import override
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.models.common.moe import GroupedExperts


@override(
    target=FlexAttention.Config, description="causal SDPA in place of FlexAttention (non-Inductor compile backends)"
)
def sdpa_attention(config: FlexAttention.Config) -> ScaledDotProductAttention.Config:
    return ScaledDotProductAttention.Config()


_NAMED: dict[type, type] = {}


def _named_class(cls: type) -> type:
    """A subclass of the model config ``cls``, of the same layout, whose ``build()`` registers the model
    with ``mxfx.name_modules``."""
    if cls not in _NAMED:

        def build(self, **kwargs):
            return mxfx.name_modules(cls.build(self, **kwargs))

        _NAMED[cls] = type(
            cls.__name__,
            (cls,),
            {"__slots__": (), "build": build, "__module__": cls.__module__, "__qualname__": cls.__qualname__},
        )
    return _NAMED[cls]


@override(target=Decoder.Config, description="mxfx: SDPA for FlexAttention, model registered with mxfx.name_modules")
def mxfx_model(config: Decoder.Config, sdpa: bool = True, expert_hidden_dim: int | None = None) -> Decoder.Config:
    """The whole model's config: :func:`sdpa_attention` on every FlexAttention in it (unless ``sdpa``
    is false), routed experts of hidden size ``expert_hidden_dim`` when given (quick runs), and
    ``build()`` registering the model with ``mxfx.name_modules``. One override, since torchtitan
    refuses an override of a config nested in another override's.

    Changes ``config`` in place and returns it: torchtitan's trainer holds the model config it
    builds from before it applies overrides, so a new root object would not be built.
    """
    if sdpa:
        for _, _, parent, attr in config.traverse(FlexAttention.Config):
            _replace(parent, attr, sdpa_attention(None))
    if expert_hidden_dim is not None:
        for _, experts, parent, attr in config.traverse(GroupedExperts.Config):
            _replace(parent, attr, dataclasses.replace(experts, hidden_dim=expert_hidden_dim))
    if type(config) not in _NAMED.values():
        config.__class__ = _named_class(type(config))
    return config


def _replace(parent, attr, new) -> None:
    if isinstance(parent, list):
        parent[attr] = new
    else:
        setattr(parent, attr, new)
