"""Shared pieces of the small-M GEMM tests (test_small_m_gemm_kernel.py, _table.py, _wiring.py): weights of each
kind with their float32 dequantization, the references, configs, and a table where the loader reads it.

The kernel's modules are imported inside the functions: a test module collects before anything imports
triton (tests/triton_mode.py).
"""

from __future__ import annotations

import json

import torch

from tests.triton_mode import DEVICE

FP8 = torch.float8_e4m3fn

# Configs as dicts (GemmConfig(**c)): the modules must collect without importing the kernel (triton_mode).
SPLIT = {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 3, "num_warps": 4, "num_stages": 2}
NO_SPLIT = {"BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 1, "num_warps": 4, "num_stages": 2}
GEMV = {"BLOCK_N": 8, "BLOCK_K": 32, "SPLIT_K": 1, "GEMV": True}
GEMV_SPLIT = {"BLOCK_N": 4, "BLOCK_K": 32, "SPLIT_K": 3, "GEMV": True}
TUNED = {"BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 2, "num_warps": 8, "num_stages": 3}


def make_weight(kind: str, n: int, k: int, seed: int, dtype=torch.bfloat16):
    """(weight as the kernel takes it, scale or None, block or None, the dequantized weight in float32)."""
    from model_executor.layers.quantization import fp8_math as fm

    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1
    if kind == "fp8":
        q, s = fm.quantize_fp8_per_channel(w)
        return q, s, None, q.float() * s[:, None]
    if kind == "fp8_block":
        block = (32, 32)
        q, s = fm.quantize_fp8_block(w, block)
        return q, s, block, fm.dequantize_fp8_block(q, s, block)
    w = w.to(dtype)
    return w, None, None, w.float()


def reference(x: torch.Tensor, w_deq: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.float() @ w_deq.t()
    return out + bias.float() if bias is not None else out


def rmsnorm_reference(h, g, eps):
    """weight * rmsnorm(h) in float32, with no rounding of the normed row."""
    hf = h.float()
    return hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * g.float()


def run(x, w, s, bias, block, cfg):
    from model_executor.layers.triton_ops import small_m_gemm as sm

    dev = lambda t: None if t is None else t.to(DEVICE)
    return sm.small_m_linear(dev(x), dev(w), dev(s), dev(bias), block, config=sm.GemmConfig(**cfg)).cpu()


def assert_matches_reference(out, ref, dtype):
    # One rounding to the output dtype: up to an ulp (the interpreter truncates float32 -> bfloat16 where a
    # GPU rounds to nearest), 2^-7 relative for bf16, 2^-10 for fp16; plus float32 summation order.
    rtol = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, rtol=rtol, atol=1e-4)


def install_table(tmp_path, monkeypatch):
    """For a fixture (`yield from`): write(dict) puts a config table for this device ("cpu" here) where the
    loader looks; the tables read before are forgotten, before and after."""
    from model_executor.layers.triton_ops import small_m_gemm_config as smc

    monkeypatch.setattr(smc, "CONFIG_DIR", tmp_path)

    def write(content: dict):
        (tmp_path / smc.table_path(smc.device_name("cpu")).name).write_text(json.dumps(content))
        smc.forget_tables()

    smc.forget_tables()
    yield write
    smc.forget_tables()


def kernel_on_cpu(monkeypatch) -> None:
    """Let the layers take the small-M kernel on CPU tensors (it runs in Triton's interpreter)."""
    from model_executor.layers.triton_ops import small_m_gemm_dispatch as dispatch

    monkeypatch.setattr(dispatch, "DEVICES", ("cuda", "cpu"))
