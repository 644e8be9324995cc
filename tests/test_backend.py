"""Backend registration, options, and the dump."""

import copy
import dataclasses
import json
import pickle
import subprocess
import sys

import warnings

import pytest
import torch
import torch.nn as nn

import mxfx
from mxfx.policy import Policy, Rule


def _last_line_of_fresh_process(code: str) -> str:
    """Run ``code`` in a new Python process (nothing imported yet); its last line of output."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.slow
def test_entry_point_without_importing_mxfx():
    err = float(
        _last_line_of_fresh_process(
            "import sys, torch\n"
            "m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))\n"
            "x = torch.randn(8, 32)\n"
            "y = torch.compile(m, backend='mxfp8', options={'inner': 'eager'})(x)\n"
            "assert 'mxfx' in sys.modules, 'backend did not load mxfx'\n"
            "print(float((y - m(x)).abs().max()))\n"
        )
    )
    assert 0 < err < 0.1  # quantized (not identical to fp32) but close


@pytest.mark.slow
def test_import_registers_every_custom_op():
    """``import mxfx`` alone makes every ``torch.ops.mxfx`` op callable (a fresh process imports nothing else)."""
    assert (
        _last_line_of_fresh_process(
            "import torch, mxfx\n"
            "names = ['quantize', 'dequantize', 'quantize_dual', 'mm', 'grouped_mm', 'grouped_mm_wgrad',\n"
            "         'grouped_wgrad_bf16', 'cached_weight', 'block_quantize', 'block_mm', 'block_grouped_mm',\n"
            "         'quantize_dual_dequantized', 'swiglu_quantize_dequantize', 'route_weight_quantize_dequantize',\n"
            "         'swiglu_quantize_save', 'swiglu_quantize_dequantize_save']\n"
            "print('missing', [n for n in names if not hasattr(torch.ops.mxfx, n)])\n"
        )
        == "missing []"
    )


def test_options_validation_names_valid_values():
    with pytest.raises(ValueError, match="valid keys"):
        Policy.from_options({"scale_rul": "rceil"})
    with pytest.raises(ValueError, match="'rceil', 'floor'"):
        Policy.from_options({"scale_rule": "nearest"})
    with pytest.raises(ValueError, match="'linear'"):
        Policy.from_options({"rules": [{"op": "conv"}]})
    with pytest.raises(ValueError, match="valid keys"):
        Policy.from_options({"rules": [{"modul": "x"}]})
    with pytest.raises(ValueError, match="inner"):
        Policy.from_options({"inner": "tvm"})


def test_policy_decisions_first_match_wins(tmp_path):
    p = Policy(rules=(Rule(module="layers.0.*", precision="bf16"), {"op": "linear", "wgrad": "bf16"}))
    assert p.decide("linear", "layers.0.attn.qkv").precision == "bf16"
    d = p.decide("linear", "layers.1.attn.qkv")
    assert (d.precision, d.wgrad, d.scale_rule) == ("mxfp8", "bf16", "rceil")
    assert p.decide("grouped_mm", "layers.1.experts").wgrad == "bf16"  # per-kind default
    assert Policy().decide("linear", "x").wgrad == "mxfp8"
    assert Policy(wgrad="bf16").decide("linear", "x").wgrad == "bf16"
    assert Policy().decide("linear", "lm_head").precision == "bf16"
    assert Policy().decide("router", "layers.0.mlp.gate").precision == "bf16"
    assert Policy(min_size=1000).decide("linear", "x", macs=999).precision == "bf16"
    with pytest.raises(ValueError, match=r"min_size=1000000000.0 must be a non-negative int.*write 1000000000"):
        Policy(min_size=1e9)
    with pytest.raises(ValueError, match=r"unknown option key\(s\) \['scale_rul'\]; valid keys: scale_rule"):
        Policy(scale_rul="floor")  # a keyword typo, not only a dict key, lists the valid ones
    with pytest.raises(ValueError, match=r"unknown rule key\(s\) \['modul'\]; valid keys: module"):
        mxfx.Rule(modul="x")
    with pytest.raises(ValueError, match=r"rule module=5 must be a glob string"):
        Policy(rules=[{"module": 5, "precision": "bf16"}])
    with pytest.raises(ValueError, match=r"rule module=' ' is blank and would match no module; leave module out"):
        Policy(rules=[{"module": " ", "precision": "bf16"}])
    toml = tmp_path / "policy.toml"
    toml.write_text('scale_rule = "floor"\n[[rules]]\nmodule = "*.o_proj"\nprecision = "bf16"\n')
    q = Policy.from_toml(toml)
    assert q.scale_rule == "floor" and q.decide("linear", "layers.3.o_proj").precision == "bf16"
    bad = tmp_path / "bad.toml"
    bad.write_text('scale_rul = "floor"\n')  # an unknown key: the error names the file and the valid keys
    with pytest.raises(ValueError, match=r"policy file '.*bad.toml': unknown option key\(s\) \['scale_rul'\]"):
        Policy.from_toml(bad)
    bad.write_text("scale_rule = floor\n")  # not TOML (an unquoted string)
    with pytest.raises(ValueError, match=r"'.*bad.toml' is not valid UTF-8 TOML"):
        Policy.from_toml(bad)
    bad.write_bytes(b'format = "caf\xe9"\n')  # not UTF-8
    with pytest.raises(ValueError, match=r"'.*bad.toml' is not valid UTF-8 TOML"):
        Policy.from_toml(bad)
    bad.write_text("# comments only\n")  # valid TOML that sets nothing: the default policy, with a word
    with pytest.warns(UserWarning, match=r"policy file '.*bad.toml' sets no field: the default policy applies"):
        assert Policy.from_toml(bad) == Policy()
    for missing in (tmp_path / "nope.toml", tmp_path):  # no such file; a folder
        with pytest.raises(FileNotFoundError, match=r"mxfx policy: '.*' is not a file"):
            Policy.from_toml(missing)


def test_policy_env_when_no_options(tmp_path, monkeypatch):
    # A trainer that passes only the backend name (torchtitan's --compile.backend) gets MXFX_POLICY's file.
    toml = tmp_path / "policy.toml"
    toml.write_text('inner = "eager"\n[[rules]]\nmodule = "0"\nprecision = "bf16"\n')
    monkeypatch.setenv("MXFX_POLICY", str(toml))
    m = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64))
    torch.compile(m, backend="mxfp8")(torch.randn(4, 32))
    assert [r.forward for r in mxfx.last_report().records if r.kind == "linear"] == ["fp32", "mxfp8"]  # FP32 model
    with pytest.warns(UserWarning, match=r"MXFX_POLICY='.*policy.toml' is set, but the compile gives options"):
        assert Policy.from_options({}).rules == ()  # explicit options win over the file, with a word
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Policy.from_options({})  # said once per file
    monkeypatch.setenv("MXFX_POLICY", str(tmp_path / "missing.toml"))
    with pytest.raises(FileNotFoundError, match="MXFX_POLICY=.*missing.toml' is not a file"):
        Policy.from_options(None)
    torch._dynamo.reset()


def test_dump_dir_and_env(tmp_path, monkeypatch):
    m = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 48))
    torch.compile(m, backend="mxfp8", options={"inner": "eager", "dump_dir": str(tmp_path)})(torch.randn(4, 32))
    folder = tmp_path / "graph_{:03d}".format(mxfx.last_report().graph_id)
    before, after, prec = ((folder / f).read_text() for f in ("before.py", "after.py", "precision.txt"))
    assert "torch._C._nn.linear" in before and "mx_linear" not in before
    assert after.count("mx_linear(") == 1 and after.count("torch._C._nn.linear(") == 1  # 32->64 rewritten; 64->48 kept
    assert "features 64->48 are not multiples of 32" in prec and "mxfp8" in prec
    data = json.loads((folder / "precision.json").read_text())
    assert data["summary"] == prec.splitlines()[0].removeprefix("# mxfx precision map, ")
    assert [r["forward"] for r in data["records"]] == ["mxfp8", "fp32"] and "lint + recompile" in data["steps"]
    torch._dynamo.reset()
    env_dir = tmp_path / "env"
    monkeypatch.setenv("MXFX_DUMP_DIR", str(env_dir))
    torch.compile(m, backend="mxfp8", options={"inner": "eager"})(torch.randn(4, 32))
    assert (env_dir / "graph_{:03d}".format(mxfx.last_report().graph_id) / "precision.txt").exists()
    torch._dynamo.reset()  # an explicit dump_dir=None wins over the variable, as other given options do
    torch.compile(m, backend="mxfp8", options={"inner": "eager", "dump_dir": None})(torch.randn(4, 32))
    assert not (env_dir / "graph_{:03d}".format(mxfx.last_report().graph_id)).exists()
    assert Policy(dump_dir=None).dump_dir is None and Policy().dump_dir == str(env_dir)
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(ValueError, match=r"dump_dir='.*afile' is a file, not a folder"):
        Policy(dump_dir=str(afile))
    with pytest.raises(ValueError, match=r"dump_dir='  ' is blank; name a folder"):
        Policy(dump_dir="  ")
    monkeypatch.setenv("MXFX_DUMP_DIR", " ")  # a blank variable is an unset one, as an empty one is
    assert Policy().dump_dir is None


def test_dynamic_shapes_dump_each_compiled_graph_once(tmp_path):
    # dynamic=True: AOTAutograd makes Dynamo trace the forward again (its Python float scalars, RoPE's base, become
    # constants), so the backend rewrites two graphs of which only the second is compiled and runs
    from tests.models import MoETransformer, tiny_config

    torch.manual_seed(0)
    idx = torch.randint(0, 256, (2, 32))
    before = len(mxfx.all_reports())
    compiled = torch.compile(
        MoETransformer(tiny_config()),
        backend="mxfp8",
        dynamic=True,
        options={"inner": "aot_eager", "dump_dir": str(tmp_path)},
    )
    with torch.autocast("cpu", torch.bfloat16):
        compiled(idx, idx)
    maps = mxfx.all_reports()[before:]
    assert len(maps) == 1, [pm.summary() for pm in maps]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"graph_{maps[0].graph_id:03d}"]


def test_a_graph_that_fails_to_compile_keeps_its_dump(tmp_path):
    def failing(gm, example_inputs):
        raise RuntimeError("inner compiler failed")

    m = nn.Sequential(nn.Linear(32, 64))
    with pytest.raises(Exception, match="inner compiler failed"):
        torch.compile(m, backend="mxfp8", options={"inner": failing, "dump_dir": str(tmp_path)})(torch.randn(4, 32))
    folder = tmp_path / "graph_{:03d}".format(mxfx.last_report().graph_id)
    assert "mx_linear(" in (folder / "after.py").read_text()


def test_rules_only_override_what_they_set():
    # A rule that sets no precision must not lift the default BF16 rules for routers and lm_head.
    p = Policy(rules=({"scale_rule": "floor"}, {"op": "linear", "min_size": 0}))
    assert p.decide("linear", "lm_head").precision == "bf16"
    assert p.decide("router", "layers.0.gate").precision == "bf16"
    d = p.decide("linear", "layers.0.qkv")
    assert (d.precision, d.scale_rule) == ("mxfp8", "floor")
    assert Policy(rules=({"module": "lm_head", "precision": "mxfp8"},)).decide("linear", "lm_head").precision == "mxfp8"


def test_save_policy_reaches_dense_linears():
    m = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    x = torch.randn(32, 32, requires_grad=True)  # 32 tokens: no padding, so packing pays
    for opts in ({"save": "bf16"}, {"rules": [{"op": "saved", "precision": "bf16"}]}):
        torch._dynamo.reset()
        torch.compile(m, backend="mxfp8", options={"inner": "eager", **opts})(x)
        assert {r.saved for r in mxfx.last_report().records} == {"fp32"}, opts  # kept as it is, in an FP32 model
    torch._dynamo.reset()
    torch.compile(m, backend="mxfp8", options={"inner": "eager"})(x)
    assert {r.saved for r in mxfx.last_report().records} == {"mxfp8"}


@pytest.mark.parametrize(
    "bad",
    [
        {"scale_rule": None},
        {"save": None},
        {"inner": None},
        {"rules": "lm_head"},
        {"passes": ["linear"]},
        {"dump_dir": 5},
        {"min_size": None},
    ],
)
def test_bad_option_types_raise_value_error(bad):
    with pytest.raises(ValueError, match="mxfx policy"):
        Policy.from_options(bad)


def test_public_format_api_guards():
    q, s = mxfx.quantize(torch.randn(4, 32, requires_grad=True))
    assert not q.requires_grad and not s.requires_grad
    with pytest.raises(TypeError, match=r"not a floating type of 16 bits or more"):
        mxfx.dequantize(q, s, dtype=torch.int32)


def test_dynamic_token_counts_one_graph():
    from torch._dynamo.backends.debugging import aot_eager

    compiles = []

    def counting_inner(gm, example_inputs):
        compiles.append(gm)
        return aot_eager(gm, example_inputs)

    m = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    compiled = torch.compile(m, backend="mxfp8", options={"inner": counting_inner}, dynamic=True)
    reference = torch.compile(m, backend="mxfp8", options={"inner": "eager"}, dynamic=True)
    # not multiples of 32 (wgrad pads tokens inside the op); above 32 so the padded token count is
    # never a single block, which Dynamo specializes like any size-1 dim
    for tokens in (40, 129, 300):
        x = torch.randn(tokens, 64, requires_grad=True)
        y = compiled(x)
        y.square().sum().backward()
        torch.testing.assert_close(y, reference(x), rtol=1e-5, atol=1e-5)
        assert torch.isfinite(x.grad).all()
    assert len(compiles) == 1  # one graph serves every token count
    assert compiles[0].code.count("mx_linear(") == 2


def test_printing_a_report_shows_its_table():
    """``print(mxfx.last_report())`` (the README's recipe) prints the table, one line per op, not a dataclass repr."""
    m = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    torch._dynamo.reset()
    torch.compile(m, backend="mxfp8", options={"inner": "eager"})(torch.randn(32, 64))
    text = str(mxfx.last_report())
    lines = text.splitlines()
    assert text == mxfx.last_report().to_text() and lines[0].startswith("# mxfx precision map")
    assert lines[1].split()[:3] == ["node", "kind", "module"]
    assert len(lines) == 2 + 2 and all(" linear " in ln and " mxfp8 " in ln for ln in lines[2:]), text


def test_inference_graph_report_claims_no_backward():
    """Under no_grad the MX linears run the forward GEMM only: the map shows no dgrad/wgrad/saved and no savings."""
    m = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    x = torch.randn(32, 64)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(m, backend="mxfp8", options={"inner": "eager"})(x)
    pm = mxfx.last_report()
    assert [(r.forward, r.dgrad, r.wgrad, r.saved) for r in pm.records] == [("mxfp8", "-", "-", "-")] * 2
    assert pm.saved_bytes() == (0, 0) and "inference graph" in pm.records[0].reason
    torch._dynamo.reset()
    torch.compile(m, backend="mxfp8", options={"inner": "eager"})(x)
    # with grad: both get a backward, the first without a dgrad (its input needs no gradient); the second one's
    # input (ReLU's output) stays as it is, in FP32: ReLU's backward keeps it
    assert [(r.dgrad, r.wgrad, r.saved) for r in mxfx.last_report().records] == [
        ("-", "mxfp8", "mxfp8"),
        ("mxfp8", "mxfp8", "fp32"),
    ]


def test_inference_graph_report_kept_ops_claim_no_backward_either():
    """Ops kept as written (features 40, not a multiple of 32; a BF16 rule) read "-" for dgrad/wgrad/saved under
    no_grad as the MX ops do, and with grad the dtype they run in: FP32 (an FP32 model without autocast), but no
    dgrad for the first (its input needs no gradient)."""
    m = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 40), nn.ReLU(), nn.Linear(40, 64))
    options = {"inner": "eager", "rules": [{"module": "0", "precision": "bf16"}]}
    x = torch.randn(32, 64)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(m, backend="mxfp8", options=options)(x)
    assert [(r.forward, r.dgrad, r.wgrad, r.saved) for r in mxfx.last_report().records] == [("fp32", "-", "-", "-")] * 3
    torch._dynamo.reset()
    torch.compile(m, backend="mxfp8", options=options)(x)
    assert [(r.forward, r.dgrad, r.wgrad, r.saved) for r in mxfx.last_report().records] == [
        ("fp32", "-", "fp32", "fp32"),
        ("fp32",) * 4,
        ("fp32",) * 4,
    ]


def test_policy_is_read_only_after_validation():
    """Validated once: the frozen Policy's mappings cannot be edited into invalid values afterwards."""
    p = Policy(passes={"linear": False}, transport={"dispatch_bwd": "bf16"})
    with pytest.raises(TypeError):
        p.transport["dispatch_fwd"] = "fp8"
    with pytest.raises(TypeError):
        p.passes["linaer"] = False
    q = Policy(passes=p.passes, transport=p.transport)  # a policy's own mappings are valid input
    assert not q.pass_enabled("linear") and q.transport_precision("dispatch_bwd") == "bf16"


def test_policy_is_hashable_and_equal_by_settings():
    """A policy can key a cache: equal settings hash and compare equal, whatever container they came in."""
    rule = mxfx.Rule(module="layers.*", precision="bf16")
    a = Policy(rules=[rule], passes={"linear": False}, transport={"dispatch_bwd": "bf16"})
    b = Policy(rules=(rule,), passes={"linear": False}, transport={"dispatch_bwd": "bf16"})
    c = Policy(rules=(rule,), passes={"linear": True}, transport={"dispatch_bwd": "bf16"})
    assert a == b and hash(a) == hash(b)
    assert a != c and len({a, b, c}) == 2
    for twin in (copy.deepcopy(a), pickle.loads(pickle.dumps(a))):  # still copies and pickles
        assert twin == a and hash(twin) == hash(a)
    assert dataclasses.asdict(a)["passes"] == {"linear": False}


@pytest.mark.slow
def test_compile_mode_reaches_inner_inductor_without_cuda_graphs():
    """torch.compile(mode=...) is not dropped: Inductor gets the mode's settings, less the CUDA graphs that
    would replay past the weight caches' freshness checks (said in a warning)."""
    from mxfx.backend import inductor_mode_options

    assert inductor_mode_options(None) == {} and inductor_mode_options("default") == {}
    with pytest.warns(UserWarning, match="turns them off"):
        opts = inductor_mode_options("max-autotune")
    assert opts["max_autotune"] is True and "triton.cudagraphs" not in opts
    m = nn.Linear(64, 64)
    with pytest.warns(UserWarning, match=r"mode='reduce-overhead'.*CUDA graphs"):
        torch.compile(m, backend="mxfp8", mode="reduce-overhead")(torch.randn(32, 64))


def test_reset_reports_forgets_the_tables_and_keeps_numbering():
    """After ``mxfx.reset_reports()`` no table of an earlier model is shown as the last one; the next graph's
    table is the only one, numbered after those forgotten."""
    torch._dynamo.reset()
    f = torch.compile(torch.nn.Linear(64, 64), backend="mxfp8", options={"inner": "aot_eager"})
    f(torch.randn(32, 64))
    first = mxfx.last_report()
    assert first is not None
    mxfx.reset_reports()
    assert mxfx.last_report() is None and mxfx.all_reports() == []
    torch._dynamo.reset()
    g = torch.compile(torch.nn.Linear(64, 64), backend="mxfp8", options={"inner": "aot_eager"})
    g(torch.randn(32, 64))
    (only,) = mxfx.all_reports()
    assert only.graph_id > first.graph_id
