"""What a low-precision format is to the rest of mxfx: :class:`ScaleRule` and the :class:`Format` contract.

A format is one object (:mod:`mxfx.formats.mxfp8`, :mod:`mxfx.formats.fp8_block`). The policy picks one per op;
the passes, the autograd ops (:mod:`mxfx.ops`), the weight caches and FSDP2 ask it for facts (scale rules,
block shapes, feature multiple, bytes per value) and for operands and GEMMs, and never branch on its name.

Operands are opaque tuples of tensors owned by the format that made them (e.g. ``(qdata, scales, values)``):
the ops save them for backward and hand them back to the same format. Every ``rule`` argument is a
:class:`ScaleRule` or its string value; ``save`` and ``wgrad`` are "mxfp8" (low precision, in this format) or
"bf16".
"""

from __future__ import annotations

import enum

import torch

from mxfx import device as devices
from mxfx.kernels.common.gemm import accumulate_into
from mxfx.kernels.common.silu import swiglu_fp32
from mxfx.runtime import stats


class ScaleRule(str, enum.Enum):
    """How a block's scale is chosen from its absolute maximum (amax).

    * ``RCEIL``: the smallest power of two 2^e with amax / 2^e <= 448 (no value saturates).
    * ``FLOOR``: 2^(floor(log2 amax) - 8), OCP MX v1.0 §6.3 (values above 448 x 2^e saturate).
    * ``AMAX``: amax / 448 as a float32 scale (FP32-scaled formats only).
    """

    RCEIL = "rceil"
    FLOOR = "floor"
    AMAX = "amax"

    def __str__(self) -> str:
        return self.value


Operand = tuple
"""A GEMM operand as a format makes it: a tuple of tensors (entries may be None), read only by that format."""

GEMM_OPS = ("mm", "grouped_mm", "grouped_mm_wgrad")
"""A format's GEMMs: dense (a linear's forward, dgrad and wgrad), grouped (routed experts' forward and dgrad), and
the grouped wgrad (a reduction over each expert's tokens)."""


def route_weighted(dout: torch.Tensor, route_weight: torch.Tensor | None) -> torch.Tensor:
    """The gradient a routed grouped GEMM's output rows receive: ``dout [S, N] * route_weight[:, None]`` formed in
    FP32 (``route_weight`` ``[S]`` or ``[S, 1]``), or ``dout`` itself without route weights."""
    if route_weight is None:
        return dout
    return dout.float() * route_weight.reshape(-1, 1).float()


def described(operand) -> str:
    """An operand as an error message shows it: each tensor's dtype and shape (None as None), or its type."""
    if not isinstance(operand, (tuple, list)):
        return type(operand).__name__
    parts = [f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else repr(t) for t in operand]
    return "(" + ", ".join(parts) + ")"


def stats_views(*tensors):
    """``tensors`` (None kept) as they are when all have the same 2 or 3 dims, else each as a 2-D ``[-1, last dim]``
    view (a copy where strides allow none): the ``[R, C]`` / ``[B, R, C]`` views a fused statistics kernel reads of an
    operand blocked along its last dim."""
    dims = {t.dim() for t in tensors if t is not None}
    if len(dims) == 1 and dims <= {2, 3}:
        return tensors
    return tuple(None if t is None else t.reshape(-1, t.shape[-1]) for t in tensors)


class Format:
    """A block-scaled FP8 format: its facts, and the operands and GEMMs of a linear and a grouped expert GEMM.

    Facts (class attributes): ``name`` (as policies spell it), ``scale_rules`` (the :class:`ScaleRule` it
    takes, default first), ``block`` (values per activation/gradient scale, along the reduction dim),
    ``weight_block`` (rows x cols of a weight's scale block), ``feature_multiple`` (in/out features a GEMM
    needs a multiple of) and ``feature_multiple_from`` (what that multiple comes from where it is not the scale
    blocks, as messages say it: :attr:`feature_multiple_source`), ``token_multiple`` (tokens a linear's
    low-precision wgrad operand, the copy it saves of its input, is zero-padded to a multiple of; 1: none),
    ``bytes_per_value`` (payload plus scale, amortized), ``scale_dtype``, ``transport`` (the format its
    expert-parallel all-to-all payload travels in: a format name), ``native_gemms``
    (per GPU architecture, as :func:`mxfx.device.arch_of` names it, the GEMMs of :data:`GEMM_OPS` its
    tensor cores run in this format; every other architecture and GEMM is emulated; :attr:`native_archs` lists those
    architectures and :meth:`runs_natively` asks it per device), ``dequantized_weight_forms`` (whether its weight
    cache has BF16 dequantized forms for emulated GEMMs, ``Policy.keep_dequantized_weights``),
    ``description`` and ``colour`` (how reports show it), ``gather_row_multiple`` (rows of a weight shard that FSDP2
    can gather exactly: whole scale blocks down N; 0: no gather forms, FSDP2 gathers the parameter as stored).

    Operand methods (the autograd ops in :mod:`mxfx.ops` call them in this order):

    * forward: :meth:`input_operand` (inference) or :meth:`forward_operands` (training), :meth:`weight_operand`
      ("forward"), :meth:`mm` / :meth:`grouped_mm`;
    * dgrad: :meth:`grad_operands` / :meth:`grouped_grad_operand`, :meth:`weight_operand` ("dgrad"), the same GEMM,
      :meth:`swiglu_backward` for a fused SwiGLU input;
    * wgrad: :meth:`tokens_operand` and :meth:`wgrad_mm` / :meth:`grouped_tokens_operand` and
      :meth:`grouped_wgrad` (low precision; :meth:`wgrad_mm_into` / :meth:`grouped_wgrad_into` where the GEMM writes
      the parameter's gradient itself), or :meth:`dequantize` of the forward's saved copy for a BF16 wgrad.

    Statistics (:mod:`mxfx.runtime.stats`, on sampled steps): :meth:`stats_vector` reduces one quantize to a sample,
    from the format's fused statistics kernel where it has one (:meth:`fused_stats`, CUDA), else from
    :meth:`quant_stats` (the plain-torch reference, which compares an operand with the values it was made from).
    """

    name: str = ""
    scale_rules: tuple[ScaleRule, ...] = ()
    block: int = 0
    weight_block: tuple[int, int] = (0, 0)
    feature_multiple: int = 0
    feature_multiple_from: str = ""
    token_multiple: int = 1
    bytes_per_value: float = 0.0
    scale_dtype: torch.dtype = torch.float32
    transport: str = ""
    native_gemms: dict[str, frozenset[str]] = {}
    dequantized_weight_forms: bool = False
    gather_row_multiple: int = 0
    description: str = ""
    colour: str = "#dddddd"

    def __repr__(self) -> str:
        return f"mxfx.formats.{self.name}"

    def __reduce__(self):  # one object per format, also across pickling (policies, compiled-graph caches)
        return (_by_name, (self.name,))

    # --- facts -------------------------------------------------------------------------------------

    @property
    def native_archs(self) -> tuple[str, ...]:
        """The GPU architectures whose tensor cores run some of this format's GEMMs (keys of ``native_gemms``)."""
        return tuple(self.native_gemms)

    def runs_natively(self, op: str, device: torch.device) -> bool:
        """Whether GEMM ``op`` (one of :data:`GEMM_OPS`) runs on ``device``'s tensor cores in this format (else it is
        emulated: operands dequantized, FP32 accumulation).

        Raises:
            ValueError: ``op`` is not a GEMM op.
        """
        if op not in GEMM_OPS:
            raise ValueError(f"mxfx.gemm: op={op!r} is not a GEMM op; choose one of {GEMM_OPS}")
        return op in self.native_gemms.get(devices.arch_of(devices.capability(device)), ())

    def grouped_kernel(self, device: torch.device, k: int, n: int, out_dtype: torch.dtype) -> str:
        """The name of the kernel this format's grouped GEMM of reduction length ``k`` and ``n`` output columns runs
        on ``device``, where the format has more than one ("" where it has one: the precision map adds nothing)."""
        return ""

    def rule(self, rule, where: str) -> ScaleRule:
        """``rule`` as a :class:`ScaleRule` of this format.

        Raises:
            ValueError: not a rule of this format; the message starts with ``where`` and lists the valid rules.
        """
        value = rule.value if isinstance(rule, ScaleRule) else rule
        if not self.scale_rules and value in ScaleRule._value2member_map_:  # no scales: any rule, changing nothing
            return ScaleRule(value)
        for r in self.scale_rules:
            if r.value == value:
                return r
        raise ValueError(
            f"{where}: scale_rule={value!r} is not a rule of format={self.name!r}; choose one of "
            f"{', '.join(repr(r.value) for r in self.scale_rules)} ({self.description})"
        )

    def rule_shown(self, rule) -> str | None:
        """``rule`` as the precision map names an op's scale rule: its value; None for a format without scales
        (every rule is accepted and none applies)."""
        return self.rule(rule, f"format {self.name}").value if self.scale_rules else None

    @property
    def low_precision(self) -> bool:
        """Whether a value takes fewer bytes than BF16's two (a scaled 8-bit format, not BF16 GEMMs)."""
        return self.bytes_per_value < 2

    @property
    def feature_multiple_source(self) -> str:
        """What ``feature_multiple`` comes from, as messages say it after the number: "<name> blocks" (its scale
        blocks), or the format's own ``feature_multiple_from`` (bf16_gemm: its GEMM's alignment)."""
        return self.feature_multiple_from or f"{self.name} blocks"

    def unfit_reason(self, k: int, n: int) -> str:
        """Why a GEMM of ``k`` in / ``n`` out features cannot run in this format ("" when it can)."""
        m = self.feature_multiple
        if k % m or n % m:
            return f"features {k}->{n} are not multiples of {m} ({self.feature_multiple_source})"
        return ""

    def check_features(self, op: str, k: int, n: int) -> None:
        """Raise ValueError naming ``op`` unless in/out features ``k``/``n`` are multiples of ``feature_multiple``."""
        if self.unfit_reason(k, n):
            raise ValueError(
                f"{op}: format={self.name!r} needs in/out features that are multiples of "
                f"{self.feature_multiple} ({self.feature_multiple_source}), got {k}->{n}; pad the layer "
                f"or keep this GEMM in BF16 "
                f"(a policy rule with precision='bf16')"
            )

    def saved_bytes(self, numel: int, tokens: int | None = None, k: int | None = None) -> int:
        """Bytes of this format's copy of a saved activation of ``numel`` values (``tokens`` x ``k`` when it is
        a linear input whose wgrad blocks the tokens: padded to a multiple of ``token_multiple`` tokens)."""
        if tokens is not None and k is not None:
            numel = -(-tokens // self.token_multiple) * self.token_multiple * k
        return numel + int(numel * (self.bytes_per_value - 1))

    # --- operands (implemented per format) ------------------------------------------------------------

    def input_operand(self, x, up, rule, op: str) -> Operand:
        """The forward GEMM's A operand of ``x`` (``silu(x) * up`` when ``up`` is given);
        ``op``: "mm" or "grouped_mm"."""
        raise NotImplementedError

    def check_input_operand(self, op: str, operand, x: torch.Tensor) -> None:
        """Raise ``ValueError`` naming ``op`` unless ``operand`` has the tensors :meth:`input_operand` makes of the
        2D ``x`` in this format (their dtypes, and x's rows and features): an operand made once for several GEMMs
        (``mx_linear``'s ``x_mx``), perhaps in another format."""
        raise NotImplementedError

    def forward_operands(self, x, up, rule, save: str, tokens: bool, offs=None, given: Operand | None = None):
        """``(a, tokens or None, packed)``: the forward's A operand, the token-blocked wgrad operand of the GEMM
        input when ``tokens`` (per expert group when ``offs`` is given), and what the SwiGLU backward needs of
        gate and up (``()`` without ``up``). ``given``: A already made (rows quantized before a gather)."""
        raise NotImplementedError

    def weight_operand(self, weight, rule, orientation: str, keep_dequantized: bool = False) -> Operand:
        """The cached operand of ``weight`` (``[N, K]`` or ``[E, N, K]``) for "forward" or "dgrad"."""
        raise NotImplementedError

    def mm(self, a: Operand, b: Operand, out_dtype: torch.dtype):
        """``A [M, K] @ B [N, K]^T`` with FP32 accumulation, in ``out_dtype``."""
        raise NotImplementedError

    def grouped_mm(self, a: Operand, b: Operand, offs, out_dtype: torch.dtype):
        """Per expert group g: ``A[offs[g-1]:offs[g]] @ B[g]^T`` -> ``[S, N]``. Rows past ``offs[-1]`` belong to no
        group: the low-precision formats write zeros there; bf16_gemm, as ``torch._grouped_mm``, leaves them
        undefined (a model must not read them, as it must not with the op it wrote)."""
        raise NotImplementedError

    def grad_operands(self, dy, rule, rows: bool, tokens: bool):
        """``(dgrad A operand or None, token-blocked wgrad operand or None)`` of a linear's ``dy [M, N]``."""
        raise NotImplementedError

    def grouped_grad_operand(self, dout, route_weight, rule):
        """``(dgrad A operand, dy)`` of a grouped GEMM's output gradient: ``dy`` is ``dout`` times the route
        weights when given (FP32), the tensor the wgrad reads."""
        raise NotImplementedError

    def route_grad_operands(self, dout, route_weight, y_unweighted, rule):
        """``(dgrad A operand, dy, d_route_weight)`` of a route-weighted grouped GEMM's output gradient:
        :meth:`grouped_grad_operand`'s pair and ``dy``, and the route weights' gradient ``sum(dout * y_unweighted,
        -1)`` in fp32 ``[S]``. A format whose kernel makes them from one read of ``dout`` overrides this (its ``dy``
        may come in BF16, the precision the BF16 wgrad reads it in)."""
        rows, dy = self.grouped_grad_operand(dout, route_weight, rule)
        return rows, dy, (dout.float() * y_unweighted.float()).sum(-1)

    def grouped_grad_operands(self, dout, route_weight, offs, rule) -> tuple[Operand, Operand]:
        """``(dgrad A operand, wgrad operand)`` of a grouped GEMM's output gradient, both of ``dout`` times the route
        weights when given: :meth:`grouped_grad_operand`'s first and :meth:`grouped_tokens_operand` of its ``dy``.
        A format whose kernel makes both from one read of ``dout`` overrides this."""
        rows, dy = self.grouped_grad_operand(dout, route_weight, rule)
        return rows, self.grouped_tokens_operand(dy, offs, rule)

    def tokens_operand(self, x, rule) -> Operand:
        """Token-blocked wgrad operand of a linear input ``x [M, K]`` kept in high precision."""
        raise NotImplementedError

    def wgrad_mm(self, dy_tokens: Operand, x_tokens: Operand, out_dtype: torch.dtype):
        """``dW = dY^T @ X`` of a linear from both token-blocked operands."""
        raise NotImplementedError

    def grouped_tokens_operand(self, t, offs, rule) -> Operand:
        """Wgrad operand of routed rows ``t [S, D]`` blocked along the tokens of each expert group (``offs``: int32
        cumulative group ends), no block mixing two groups' rows; :meth:`forward_operands` makes x's the same way."""
        raise NotImplementedError

    def grouped_wgrad(self, dy_tokens: Operand, x_tokens: Operand, offs, out_dtype: torch.dtype):
        """``dW[g] = dY[g]^T @ X[g]`` per expert group from both operands as :meth:`grouped_tokens_operand` makes
        them."""
        raise NotImplementedError

    def wgrad_mm_into(self, dy_tokens: Operand, x_tokens: Operand, out: torch.Tensor, accumulate: bool) -> None:
        """:meth:`wgrad_mm` written into ``out [N, K]`` (``accumulate=False``) or added to it (``True``), in ``out``'s
        dtype: the weight gradient of a fused accumulation (:mod:`mxfx.runtime.main_grad`). Default: the GEMM in
        ``out``'s dtype, then one copy or add (a format whose GEMM has no accumulating epilogue)."""
        accumulate_into(out, self.wgrad_mm(dy_tokens, x_tokens, out.dtype), accumulate)

    def grouped_wgrad_into(
        self, dy_tokens: Operand, x_tokens: Operand, offs, out: torch.Tensor, accumulate: bool
    ) -> None:
        """:meth:`grouped_wgrad` written into ``out [E, N, K]`` or added to it, as :meth:`wgrad_mm_into`."""
        accumulate_into(out, self.grouped_wgrad(dy_tokens, x_tokens, offs, out.dtype), accumulate)

    def dequantize(self, a: Operand, dtype: torch.dtype):
        """The values of a rowwise operand ``a`` (the forward's saved copy) in ``dtype``."""
        raise NotImplementedError

    def saved_rows(self, a: Operand) -> Operand:
        """What the forward keeps of its A operand ``a`` for a BF16 wgrad (read back by :meth:`dequantize`)."""
        raise NotImplementedError

    def swiglu_backward(self, dh, packed: tuple):
        """FP32 ``(d gate, d up)`` of ``silu(gate) * up`` from ``dh`` and :meth:`forward_operands`' ``packed``."""
        raise NotImplementedError

    def rows_quantize_call(self, rule, device: torch.device) -> tuple:
        """``(op, extra args, outputs)`` of the graph call that quantizes token rows ``x [S, K]`` into the A operand
        of a grouped GEMM on ``device`` (``op(x, *extra args)``, a tuple of ``outputs`` tensors): what a pass inserts
        before a row gather so that the gathered rows arrive quantized (:mod:`mxfx.passes.dispatch_mx`); None where
        that saves nothing."""
        raise NotImplementedError

    # --- quantization statistics (mxfx.runtime.stats) ------------------------------------------------

    def stats_values(self, source, combine: str, layout: str = "rows") -> torch.Tensor:
        """The float32 values a quantize read, formed from ``source`` as ``combine`` says
        (:data:`mxfx.runtime.stats.COMBINES`): ``source[0]`` itself, ``silu(gate) * up`` in fp32 ("swiglu": the one
        product the forward and wgrad operands of a SwiGLU are quantized from,
        :func:`mxfx.kernels.common.silu.swiglu_fp32`), or rows times route weights in fp32 ("route_weight").

        Raises:
            ValueError: an unknown ``combine``.
        """
        if combine == "":
            return source[0].detach().float()
        if combine == "swiglu":
            return swiglu_fp32(source[0].detach(), source[1].detach())
        if combine == "route_weight":
            return source[0].detach().float() * source[1].detach().reshape(-1, 1).float()
        raise ValueError(f"mxfx.formats: combine={combine!r} is not valid; choose one of {stats.COMBINES}")

    def stats_sources(self, source, combine: str) -> tuple:
        """``(a, b, w)``, the tensors :meth:`stats_values` forms its values from, each of ``source[0]``'s shape: the
        values ``a`` ("": ``source[0]``; "swiglu": the gate), the SwiGLU ``up`` or None, the route weights expanded
        along the last dim or None. What a fused statistics kernel reads in place of the formed values.

        Raises:
            ValueError: an unknown ``combine``.
        """
        a = source[0].detach()
        if combine == "":
            return a, None, None
        if combine == "swiglu":
            return a, source[1].detach(), None
        if combine == "route_weight":
            return a, None, source[1].detach().reshape(*a.shape[:-1], 1).expand(a.shape)
        raise ValueError(f"mxfx.formats: combine={combine!r} is not valid; choose one of {stats.COMBINES}")

    def stats_vector(self, source, combine: str, operand: Operand, rule, layout: str, offs=None) -> torch.Tensor:
        """One sample of one quantize (the arguments of :meth:`quant_stats`): the float64 vector of
        :func:`mxfx.runtime.stats.reduce_parts`, on the operand's device, what :func:`mxfx.runtime.stats.observe`
        queues. On CUDA (Triton importable, :func:`mxfx.runtime.stats.fused_enabled`) from :meth:`fused_stats`
        where it covers the operand; else ``reduce_parts`` of :meth:`quant_stats`."""
        if devices.triton_available(source[0]) and stats.fused_enabled():
            vector = self.fused_stats(source, combine, operand, rule, layout, offs)
            if vector is not None:
                return vector
        return stats.reduce_parts(self.quant_stats(source, combine, operand, rule, layout, offs))

    def fused_stats(self, source, combine: str, operand: Operand, rule, layout: str, offs=None) -> torch.Tensor | None:
        """:meth:`stats_vector` from this format's fused statistics kernel (Triton, one launch reading the values'
        sources and the operand once, and a finishing launch; no host sync), or None where it has none for
        ``layout`` or this operand (the caller falls back to the reference). Runs on CUDA, or on any device under
        Triton's interpreter. Equal to the reference: counts, amax and exponents exactly, the fp64 sums to a
        relative 1e-9 (summed in another order). Default: None (no fused kernel)."""
        return None

    def quant_stats(self, source, combine: str, operand: Operand, rule, layout: str, offs=None) -> stats.Parts:
        """What the statistics of one quantize are computed from: ``operand`` (as this format made it, any of its
        layouts: blocked or plain scales, values only where an emulated GEMM reads nothing else) against the
        values it was made from (:meth:`stats_values` of ``source`` and ``combine``), laid out per ``layout``
        (:data:`mxfx.runtime.stats.LAYOUTS`; ``offs``: the group ends of a ``group_tokens`` operand, whose padding
        rows and rows past the last group end are left out). Where the operand holds no qdata or scales, they are
        those of this format's reference quantize of the values with scale rule ``rule`` (the bytes its kernels
        write).

        Returns:
            :class:`mxfx.runtime.stats.Parts`, on the operand's device.

        Raises:
            ValueError: an unknown ``layout``.
        """
        raise NotImplementedError

    # --- FSDP2 all-gather forms (mxfx.fsdp) ---------------------------------------------------------

    def gather_forms(self, w, rule) -> dict:
        """The forms a shard ``w [..., N/world, K]`` sends in FSDP2's all-gather, by name: ``(qdata as uint8,
        scales)`` each, laid out so that concatenating shards along dim 0 gives the whole weight's forms."""
        raise NotImplementedError

    def gather_which(self, reshards_after_forward: bool, in_backward: bool) -> tuple[str, ...]:
        """Which :meth:`gather_forms` one gather sends: what the GEMMs until the next gather read."""
        raise NotImplementedError

    def gathered_pairs(self, which, outputs, shape) -> dict:
        """The weight-cache forms (:func:`mxfx.runtime.cache.install_forms`) of the whole weight of ``shape`` from the
        gathered ``outputs`` (two per name of ``which``)."""
        raise NotImplementedError

    def gathered_values(self, pairs: dict, dtype: torch.dtype):
        """The weight ``[..., N, K]`` in ``dtype``, dequantized from :meth:`gathered_pairs`."""
        raise NotImplementedError

    def given_input(self, given, x, up) -> Operand | None:
        """``given`` (the ``x_mx`` argument of :func:`mxfx.grouped_mm`: x's quantized rows) checked against ``x``.

        Raises:
            ValueError: a pair of another format, other shapes, or combined with ``up``.
        """
        raise NotImplementedError


_REGISTRY: dict[str, Format] = {}


def register(fmt: Format) -> Format:
    """Add ``fmt`` to the formats policies can name, and its :meth:`Format.stats_vector` to the statistics
    (:func:`mxfx.runtime.stats.register_format`); returns it."""
    if fmt.name in _REGISTRY:
        raise ValueError(f"mxfx.formats: a format named {fmt.name!r} is already registered")
    _REGISTRY[fmt.name] = fmt
    stats.register_format(fmt.name, fmt.stats_vector)
    return fmt


def _by_name(name: str) -> Format:
    return _REGISTRY[name]


def registered() -> dict[str, Format]:
    """The registered formats by name."""
    return dict(_REGISTRY)
