"""Runtime state under the compiled graphs: weight caches, FSDP2 operand forms, quantization statistics, gradients a
wgrad GEMM writes."""
