"""Probe: does CUDA ``torch._grouped_mm`` compute token-reduction (wgrad) GEMMs correctly with group
ends that are not multiples of 16/32, in the operand layouts torch's own backward uses?

If so, the routed BF16 wgrad needs no per-group padding on CUDA. Prints max relative error per case
against an fp32 per-group loop, and the time of the padded vs the unpadded call.
"""

import torch
import triton

from mxfx.kernels.common.custom_ops import hp_grouped_wgrad
from mxfx.numerics.layout import group_padding


def pad_groups(t, dest, capacity):
    """``t``'s rows at ``dest`` of a zero tensor of ``capacity`` rows (each group zero-padded, group_padding)."""
    return t.new_zeros(capacity, t.shape[1]).index_copy(0, dest, t)


def ref(dy, x, offs):
    out, start = [], 0
    for end in offs.tolist():
        out.append(dy[start:end].float().t() @ x[start:end].float())
        start = end
    return torch.stack(out)


def main():
    torch.manual_seed(0)
    for s, e, n, k in [(1000, 8, 256, 128), (32768, 64, 2048, 2048), (65536, 64, 2048, 1024)]:
        sizes = torch.multinomial(torch.ones(e), s, replacement=True).bincount(minlength=e)
        sizes[3] = 0  # an empty group
        offs = sizes.cumsum(0).to(torch.int32).cuda()
        s_used = int(offs[-1])
        dy = torch.randn(s, n, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(s, k, device="cuda", dtype=torch.bfloat16)
        r = ref(dy, x, offs)
        unpadded = hp_grouped_wgrad(dy, x, offs, torch.float32)

        def padded_call():
            dest, w_offs, cap = group_padding(offs, s)
            return hp_grouped_wgrad(pad_groups(dy, dest, cap), pad_groups(x, dest, cap), w_offs, torch.float32)

        padded = padded_call()

        def err(a):
            return ((a - r).norm() / r.norm()).item()

        t_u = triton.testing.do_bench(lambda: hp_grouped_wgrad(dy, x, offs, torch.float32), return_mode="median")
        t_p = triton.testing.do_bench(padded_call, return_mode="median")
        print(
            f"S={s} E={e} N={n} K={k} used={s_used} odd_ends={int((offs % 16 != 0).sum())}: "
            f"rel err unpadded {err(unpadded):.2e} padded {err(padded):.2e}; {t_u:.3f} ms vs padded {t_p:.3f} ms"
        )


if __name__ == "__main__":
    main()
