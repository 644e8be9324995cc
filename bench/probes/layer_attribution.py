"""Attribute the MX layer's device time: opaque mxfx ops with input shapes, and the Inductor code."""
import os, sys, torch
sys.path.insert(0, "bench")
import mxfx
from moe_layer import routed_layer
from torch.profiler import profile, ProfilerActivity
torch.manual_seed(0)
dev, bf16 = "cuda", torch.bfloat16
T, d, E, k, h = 8192, 2048, 64, 8, 1024
x = torch.randn(T, d, device=dev, dtype=bf16, requires_grad=True)
ps = [(torch.randn(E, d, device=dev) * d**-0.5).to(bf16).requires_grad_(),
      (torch.randn(E, 2 * h, d, device=dev) * d**-0.5).to(bf16).requires_grad_(),
      (torch.randn(E, d, h, device=dev) * h**-0.5).to(bf16).requires_grad_()]
f = torch.compile(routed_layer(lambda m, b, o: torch._grouped_mm(m, b, offs=o)), backend="mxfp8",
                  options={"keep_dequantized_weights": True})
def step():
    f(x, *ps, k).float().square().mean().backward()
for _ in range(3): step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
    step(); torch.cuda.synchronize()
out = os.environ["OUT"]
with open(f"{out}/opaque_{os.environ.get('MXFX_OPAQUE_KERNELS','0')}.txt", "w") as fh:
    fh.write(prof.key_averages(group_by_input_shape=True).table(sort_by="self_device_time_total", row_limit=60, max_name_column_width=60, max_shapes_column_width=120))
    fh.write("\n\n")
    # kernel launches in order, to map kernels to graph positions
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            fh.write(f"{e.device_time_total:8.1f} us  {e.name[:100]}\n")
