"""OpSettings: validation by field name, the policy's decision producing it, the ops reading it."""

import pytest
import torch

from mxfx.ops.linear import mx_linear
from mxfx.policy import Policy, Rule
from mxfx.ops.settings import OpSettings, resolve


def test_invalid_fields_are_named():
    with pytest.raises(ValueError, match="wgrad='fp8'"):
        OpSettings(wgrad="fp8")
    with pytest.raises(ValueError, match="format='nvfp4'"):
        OpSettings(format="nvfp4")
    with pytest.raises(ValueError, match="keep_dequantized_weights=1"):
        OpSettings(keep_dequantized_weights=1)
    with pytest.raises(ValueError, match="fuse_wgrad_accumulation=1"):
        OpSettings(fuse_wgrad_accumulation=1)
    with pytest.raises(ValueError, match="mxfx policy: fuse_wgrad_accumulation='yes' must be True or False"):
        Policy(fuse_wgrad_accumulation="yes")
    with pytest.raises(TypeError, match="mxfx.mx_linear: unknown keyword.*'rule'"):
        mx_linear(torch.randn(32, 32), torch.randn(32, 32), rule="floor")


def test_resolve_defaults_and_overrides():
    assert resolve("op", None, {}, wgrad_default="bf16") == OpSettings(wgrad="bf16")
    base = OpSettings(scale_rule="floor", save="bf16")
    assert resolve("op", base, {"wgrad": "bf16"}, "mxfp8") == OpSettings(scale_rule="floor", wgrad="bf16", save="bf16")


def test_decision_produces_the_settings():
    policy = Policy(keep_dequantized_weights=True, rules=[Rule(op="linear", scale_rule="floor", save="bf16")])
    d = policy.decide("linear", "layers.0.mlp")
    assert d.settings == OpSettings(
        scale_rule="floor", wgrad="mxfp8", save="bf16", keep_dequantized_weights=True, fuse_wgrad_accumulation=True
    )
    assert d.settings.graph_kwargs() == {
        "scale_rule": "floor",
        "wgrad": "mxfp8",
        "save": "bf16",
        "keep_dequantized_weights": True,
        "fuse_wgrad_accumulation": True,  # the default
    }
    assert policy.decide("grouped_mm", "layers.0.experts").settings.wgrad == "bf16"
    unfused = Policy(fuse_wgrad_accumulation=False).decide("grouped_mm", "layers.0.experts").settings
    assert not unfused.fuse_wgrad_accumulation
    assert "fuse_wgrad_accumulation" not in unfused.graph_kwargs()  # off: the call as before


def test_settings_object_equals_keywords():
    """An op given the settings object computes exactly what the same fields by name compute (floor differs
    from rceil on these values, so a dropped field would show)."""
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    by_name = mx_linear(x, w, scale_rule="floor", wgrad="bf16")
    by_object = mx_linear(x, w, settings=OpSettings(scale_rule="floor", wgrad="bf16"))
    assert torch.equal(by_name, by_object)
    assert not torch.equal(by_object, mx_linear(x, w, settings=OpSettings(scale_rule="rceil")))
