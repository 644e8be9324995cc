"""sm90 SASS of mxfx's Triton kernels, compiled without a GPU from the launches the library makes.

:func:`captured_launches` runs a library entry point on CPU tensors with its module's ``launch`` recording the
kernel, grid and arguments instead of running them; :func:`compile_sm90` specializes one launch as Triton's launcher
does (integers equal to 1 become constants, integers and aligned pointers divisible by 16 get
``tt.divisibility = 16``, ``do_not_specialize`` honoured), compiles it for sm90 with the ``ptxas`` of Triton's wheel
and disassembles it. Needs Triton's bundled ``ptxas``, ``nvdisasm`` and ``cuobjdump`` (Linux wheel), no GPU.

``python tests/sass.py`` prints, per case of :func:`cases`, the SASS instructions, global and shared memory
instructions by width, and shared bytes: the MX kernels are issue-bound on the H200, so these counts explain most
of their bandwidth and a change can be read here before it is timed.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.runtime.jit import mangle_type
from triton.tools.tensor_descriptor import TensorDescriptor

from mxfx.kernels.common.launch import StandIn


TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
"""Where Triton's wheel keeps ``ptxas``, ``nvdisasm`` and ``cuobjdump``."""


def missing() -> str:
    """Why sm90 SASS cannot be built here, "" when it can: Triton's interpreter is on (no compiled mode), or the
    wheel carries no ``ptxas`` / ``nvdisasm`` (not a Linux wheel)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "needs Triton's compiled mode (TRITON_INTERPRET is on)"
    if not os.access(os.path.join(TOOLS, "ptxas"), os.X_OK) or not os.access(os.path.join(TOOLS, "nvdisasm"), os.X_OK):
        return "needs Triton's bundled ptxas and nvdisasm (Linux wheel)"
    return ""


_TRITON_TYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.uint8: "u8",
    torch.int8: "i8",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.float8_e4m3fn: "fp8e4nv",
}


@dataclasses.dataclass
class Launch:
    kernel: triton.runtime.jit.JITFunction
    grid: tuple
    args: tuple
    kwargs: dict


@dataclasses.dataclass
class Compiled:
    sass: str
    counts: collections.Counter  # opcode (first dotted part) -> instructions
    memory: collections.Counter  # full LDG/STG/LDS/STS opcode -> instructions
    shared: int  # bytes
    registers: int  # per thread, as ptxas allocated them

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def captured_launches(modules, fn, *args, **kwargs) -> list[Launch]:
    """Call ``fn(*args, **kwargs)`` with ``launch`` in each of ``modules`` recording instead of running."""
    seen: list[Launch] = []

    def record(kernel, grid, *a, **kw):
        seen.append(Launch(kernel, grid, a, kw))

    saved = [(m, m.launch) for m in modules]
    try:
        for m in modules:
            m.launch = record
        fn(*args, **kwargs)
    finally:
        for m, f in saved:
            m.launch = f
    return seen


def specialize(kernel, args, kwargs):
    """(signature, constexprs, attrs) for ``triton.compile``, as Triton's launcher would specialize them."""
    names = list(kernel.arg_names)
    values = dict(zip(names, args))
    values.update({k: v for k, v in kwargs.items() if k in names})
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
        v = values[p.name]
        if p.is_constexpr or v is None:
            signature[p.name], constexprs[(i,)] = "constexpr", v
        elif isinstance(v, (torch.Tensor, StandIn)):  # a stand-in: a fake tensor's launch (compile ahead)
            signature[p.name] = "*" + _TRITON_TYPES[v.dtype]
            if v.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, TensorDescriptor):  # host TMA descriptor: element type and block shape
            signature[p.name] = f"tensordesc<{_TRITON_TYPES[v.base.dtype]}{list(v.block_shape)}>"
        elif type(v).__name__ == "TensorDescriptor":  # a Gluon descriptor also carries its shared layout
            signature[p.name] = mangle_type(v)
        elif isinstance(v, bool):
            signature[p.name] = "i1"
        elif isinstance(v, int):
            if v == 1 and not p.do_not_specialize:
                signature[p.name], constexprs[(i,)] = "constexpr", 1
                continue
            signature[p.name] = "i32" if -(2**31) <= v < 2**31 else "i64"
            if not p.do_not_specialize and v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            raise TypeError(f"sass: argument {p.name} of type {type(v).__name__} is not handled")
    return signature, constexprs, attrs


def compile_sm90(launch: Launch) -> Compiled:
    """Compile one captured launch for sm90 and disassemble it."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs = specialize(launch.kernel, launch.args, launch.kwargs)
    if getattr(launch.kernel, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
    src = ASTSource(launch.kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {k: launch.kwargs[k] for k in ("num_warps", "num_stages", "maxnreg") if launch.kwargs.get(k) is not None}
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run(
            [os.path.join(TOOLS, "nvdisasm"), "-c", f.name], capture_output=True, text=True, check=True
        ).stdout
        usage = subprocess.run(
            [os.path.join(TOOLS, "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
    memory = collections.Counter(o for o in ops if o.split(".")[0] in ("LDG", "STG", "LDS", "STS"))
    return Compiled(
        sass, collections.Counter(o.split(".")[0] for o in ops), memory, compiled.metadata.shared, registers
    )


def cases():
    """(name, modules to patch, fn, args, kwargs) for the kernels the benchmark rows time, at small shapes."""
    from mxfx.kernels.mx import dual

    from mxfx.kernels.mx import quantize
    from mxfx.kernels.mx import swiglu

    x = torch.randn(256, 2048, dtype=torch.bfloat16)
    g, u = torch.randn_like(x), torch.randn_like(x)
    gu = torch.randn(256, 4096, dtype=torch.bfloat16)
    return [
        ("quantize rowwise", [quantize], quantize.quantize_lastdim, (x, "rceil"), {}),
        ("quantize columnwise (x.t())", [quantize], quantize.quantize_lastdim, (x.t(), "rceil"), {}),
        ("quantize-dequantize", [quantize], quantize.quantize_dequantize, (x, "rceil", torch.bfloat16), {}),
        ("quantize dual (transposed)", [dual], dual.quantize_dual, (x, "rceil"), {}),
        ("quantize dual, source layout", [dual], dual.quantize_dual_source, (x, "rceil"), {}),
        (
            "weight refresh fp32 -> MX + BF16",
            [dual],
            dual.quantize_dual_source,
            (x.float(), "rceil"),
            {"dequantized": torch.bfloat16},
        ),
        ("swiglu+quantize (gate, up)", [swiglu], swiglu.swiglu_quantize, (g, u, "rceil"), {}),
        (
            "swiglu+quantize (gate_up halves)",
            [swiglu],
            swiglu.swiglu_quantize,
            (gu[:, :2048], gu[:, 2048:], "rceil"),
            {},
        ),
        (
            "swiglu + values + saved pairs (halves)",
            [swiglu],
            swiglu.swiglu_quantize,
            (gu[:, :2048], gu[:, 2048:], "rceil", torch.bfloat16),
            {"save_inputs": True},
        ),
    ]


def main():
    print("| kernel (library launch) | SASS instructions | global / shared memory instructions | shared bytes |")
    print("|---|---|---|---|")
    for name, modules, fn, args, kwargs in cases():
        for launch in captured_launches(modules, fn, *args, **kwargs):
            c = compile_sm90(launch)
            mem = ", ".join(f"{n} {op}" for op, n in sorted(c.memory.items()))
            print(f"| {name} | {c.total} | {mem} | {c.shared} |", flush=True)


if __name__ == "__main__":
    main()
