"""Kernel micro-benchmarks: attention, fused ops, quantization, sampler, all-reduce."""
