"""A small OLMoE-style byte-level decoder: attention + (routed experts + one shared expert) per layer.

Plain PyTorch, written so that ``torch.compile`` traces it in one graph (no
``.tolist()``, no data-dependent shapes) and so that an MXFP8 backend finds the
ops it rewrites where an HF transformers / torchtitan MoE puts them:

* dense linears: ``qkv``, ``o_proj``, ``shared_gate``/``shared_up``/``shared_down``, ``lm_head``;
* routed experts: two ``torch._grouped_mm`` calls on stacked FP32 expert weights
  ``gate_up_proj [E, 2H, d]`` and ``down_proj [E, d, H]``, on tokens sorted by expert.

Parameters are FP32 (the main weights); run the forward under
``torch.autocast(dtype=torch.bfloat16)``. ``_grouped_mm`` is not covered by
autocast and its fake kernel accepts only BF16, so the expert path casts to the
autocast dtype (BF16) itself, or to BF16 when compiled; eager without autocast it
runs in the input's dtype (the FP32 reference arm of ``train_moe.py``). The router runs in FP32 with autocast off, as in
OLMoE.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class MoEConfig:
    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 2
    head_dim: int = 32
    n_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 128  # H of each routed expert
    shared_hidden: int = 128  # hidden size of the one shared expert
    max_seq: int = 128  # not used for positions (RoPE needs none); kept for the record

    def __post_init__(self):
        for name in ("d_model", "head_dim", "expert_hidden", "shared_hidden"):
            width = getattr(self, name)
            if width % 32:
                raise ValueError(
                    f"{name}={width} must be a multiple of 32 (every arm trains the same model, whose widths fit "
                    f"32-wide MX blocks), e.g. {32 * max(1, round(width / 32))}"
                )
        if self.d_model % self.head_dim:
            raise ValueError(f"d_model={self.d_model} must be a multiple of head_dim={self.head_dim}")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, n_experts={self.n_experts}]")


class RMSNorm(nn.Module):
    """RMSNorm computed in FP32, returned in the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight).to(x.dtype)


def rope(x, base: float = 10000.0):
    """Rotary position embedding on ``x [B, heads, T, head_dim]`` (rotate-half form)."""
    T, hd = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / base ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd)
    angles = torch.outer(torch.arange(T, device=x.device, dtype=torch.float32), inv_freq)
    cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
    x1, x2 = x.float().chunk(2, -1)
    return (x.float() * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.n_heads = cfg.d_model // cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.o_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x):
        B, T, d = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, d))


class MoE(nn.Module):
    """Top-k routed SwiGLU experts (grouped GEMMs on expert-sorted tokens) plus one shared SwiGLU expert."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        d, E, H, Hs = cfg.d_model, cfg.n_experts, cfg.expert_hidden, cfg.shared_hidden
        self.n_experts, self.top_k = E, cfg.top_k
        self.gate = nn.Linear(d, E, bias=False)  # the router
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * H, d))
        self.down_proj = nn.Parameter(torch.empty(E, d, H))
        self.shared_gate = nn.Linear(d, Hs, bias=False)
        self.shared_up = nn.Linear(d, Hs, bias=False)
        self.shared_down = nn.Linear(Hs, d, bias=False)

    def route(self, x):
        """Router in FP32: top-k expert ids ``[N, k]`` and their renormalised softmax weights ``[N, k]``."""
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.gate.weight.float())
        probs = logits.softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        return experts, weights / weights.sum(dim=-1, keepdim=True)

    def routed_experts(self, x, experts, weights):
        """Sum over each token's k experts of ``weight * SwiGLU_e(x)``, via two grouped GEMMs."""
        N, d = x.shape
        flat_experts = experts.reshape(-1)  # [N*k], slot i belongs to token i // k
        order = flat_experts.argsort(stable=True)  # expert-sorted slots
        token_of_slot = order // self.top_k
        # Per-expert row counts -> group end offsets. histc keeps a static shape [E] (bincount
        # would not), so torch.compile traces this without a graph break or a host sync.
        counts = torch.histc(flat_experts.float(), bins=self.n_experts, min=-0.5, max=self.n_experts - 0.5)
        offs = counts.cumsum(0).to(torch.int32).contiguous()

        # autocast does not cover _grouped_mm, and its compiled (fake) kernel takes BF16 only: cast here,
        # to the autocast dtype, or BF16 when compiled; eager without autocast keeps the input's dtype.
        dev = x.device.type
        dtype = (
            torch.get_autocast_dtype(dev)
            if torch.is_autocast_enabled(dev)
            else torch.bfloat16
            if torch.compiler.is_compiling()
            else x.dtype
        )
        x_sorted = x.to(dtype)[token_of_slot].contiguous()  # [N*k, d]
        gate_up = torch._grouped_mm(x_sorted, self.gate_up_proj.to(dtype).transpose(-2, -1), offs=offs)
        g, u = gate_up.chunk(2, dim=-1)
        h = (F.silu(g) * u).contiguous()  # [N*k, H]
        y = torch._grouped_mm(h, self.down_proj.to(dtype).transpose(-2, -1), offs=offs)  # [N*k, d]

        w_sorted = weights.reshape(-1)[order].to(dtype).contiguous()
        y = y * w_sorted[:, None]
        return torch.zeros(N, d, dtype=y.dtype, device=y.device).index_add(0, token_of_slot, y)

    def shared_expert(self, x):
        return self.shared_down(F.silu(self.shared_gate(x)) * self.shared_up(x))

    def forward(self, x):
        B, T, d = x.shape
        flat = x.reshape(B * T, d)
        experts, weights = self.route(flat)
        routed = self.routed_experts(flat, experts, weights)
        return (routed.to(x.dtype) + self.shared_expert(flat).to(x.dtype)).view(B, T, d)


class Block(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model)
        self.moe = MoE(cfg)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.moe(self.ffn_norm(x))


class MoETransformer(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self):
        """GPT-2-style init: N(0, 0.02), residual output projections scaled by 1/sqrt(2 * layers)."""
        out_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif name.endswith(("o_proj.weight", "down_proj", "shared_down.weight")):
                nn.init.normal_(p, std=out_std)
            else:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets=None):
        """Logits ``[B, T, vocab]``, and the mean next-byte cross-entropy (FP32) if ``targets`` is given."""
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss
