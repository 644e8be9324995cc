cd bench && python - <<'PY'
import sys, os
sys.path.insert(0, "probes")
import dual_hints, kernels
dual_hints.VARIANTS = dual_hints.VARIANTS[:1]
dual_hints.time_all()
dual_hints.time_all()
os.environ["MXFX_BENCH_SWEEP"] = "columnwise_group,dual_group,dual_blocked_group,dual_source_group"
kernels.sweep(kernels.copy_bandwidth())
PY
