"""Tuning tools: the small-M GEMM and fused-MoE tuners and the tables' A/B (see README.md here)."""
