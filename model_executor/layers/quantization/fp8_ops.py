"""Triton FP8 kernels: per-token-group activation quantization (alone, or inside RMSNorm / SiLU-and-mul) and the
W8A8 block-scaled GEMM.

    per_token_group_quant_fp8(x [M, K], group_size) -> (fp8 [M, K], float32 scales [M, K / group_size])
        group_size = K is per-token quantization (the scales then feed torch._scaled_mm's row-wise path)
    rmsnorm_quant_fp8(x, residual, weight, eps, group_size) -> (fp8, scales, x + residual or None)
    silu_and_mul_quant_fp8(x [M, 2I], group_size)          -> (fp8 [M, I], scales)
        the quantization of triton_ops.rmsnorm's / silu_and_mul's output, in their kernel, with the same bits
    w8a8_block_fp8_matmul(a fp8 [M, K], b fp8 [N, K], a_scale [M, K / bk], b_scale [ceil(N / bn), K / bk],
                          block (bn, bk), out_dtype) -> [M, N]

Each is a `duet::` custom op while something traces (the piecewise runner's dynamo pass), plain calls
otherwise. No host syncs and one output allocation of a shape fixed by the inputs: CUDA-graph safe once
compiled (warm-up runs before capture). The math is fp8_math.py's; the CPU tests run these kernels in
Triton's interpreter against it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model_executor.layers.quantization.fp8_math import FP8_DTYPE, FP8_MAX
from model_executor.layers.triton_ops.kernels import _num_warps, rmsnorm_row

_MIN_AMAX = 1e-12


@triton.jit
def _per_token_group_quant_kernel(
    X, Q, S, group_size, groups_per_row, stride_x, stride_q, stride_s,
    FP8_MAX_VAL: tl.constexpr, MIN_AMAX: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr,
):
    """One program per (token, group): the group's absolute maximum, then the scaled, saturated cast.
    ONE_PASS (BLOCK >= group_size): the group is loaded once and kept in registers; otherwise it is
    read twice in BLOCK-sized chunks (groups too wide for registers)."""
    pid = tl.program_id(0)
    row = (pid // groups_per_row).to(tl.int64)
    g = pid % groups_per_row
    x_row = X + row * stride_x + g * group_size
    q_row = Q + row * stride_q + g * group_size
    if ONE_PASS:
        offs = tl.arange(0, BLOCK)
        mask = offs < group_size
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), 0), MIN_AMAX) / FP8_MAX_VAL
        q = tl.clamp(x / scale, -FP8_MAX_VAL, FP8_MAX_VAL)
        tl.store(q_row + offs, q.to(Q.dtype.element_ty), mask=mask)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, group_size, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < group_size, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, 0), MIN_AMAX) / FP8_MAX_VAL
        for start in range(0, group_size, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < group_size
            x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            q = tl.clamp(x / scale, -FP8_MAX_VAL, FP8_MAX_VAL)
            tl.store(q_row + offs, q.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + row * stride_s + g, scale)


# Per-token quantization of a decode batch is one program per token: a whole row held in registers (one
# read of x) up to this width, two chunked reads beyond it.
MAX_ONE_PASS_BLOCK = 16384


def _per_token_group_quant_impl(x: torch.Tensor, group_size: int,
                                max_one_pass: int = MAX_ONE_PASS_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    if k % group_size:
        raise ValueError(f"K={k} is not a multiple of the group size {group_size}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    groups = k // group_size
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, s
    block = triton.next_power_of_2(group_size)
    one_pass = block <= max_one_pass
    if not one_pass:
        block = min(block, 2048)
    _per_token_group_quant_kernel[(m * groups,)](
        x, q, s, group_size, groups, x.stride(0), q.stride(0), s.stride(0),
        FP8_MAX_VAL=FP8_MAX, MIN_AMAX=_MIN_AMAX, BLOCK=block, ONE_PASS=one_pass,
        num_warps=max(1, min(block // 1024, 16)))
    return q, s


# ---------------------------------------------------------------- the quantization fused into RMSNorm / SiLU-and-mul


@triton.jit
def _quantize_groups(y, Q, S, q_row, s_row, N, FP8_MAX_VAL: tl.constexpr, MIN_AMAX: tl.constexpr,
                     BLOCK_N: tl.constexpr, GROUP_BLOCK: tl.constexpr):
    """Store y [BLOCK_N] float32 (columns >= N zero) as FP8 codes at Q + q_row and one scale per group of
    GROUP_BLOCK columns at S + s_row: the per-token-group kernel's math, group by group."""
    groups: tl.constexpr = BLOCK_N // GROUP_BLOCK
    y2 = tl.reshape(y, (groups, GROUP_BLOCK))
    scale = tl.maximum(tl.max(tl.abs(y2), 1), MIN_AMAX) / FP8_MAX_VAL
    q = tl.clamp(y2 / scale[:, None], -FP8_MAX_VAL, FP8_MAX_VAL)
    cols = tl.arange(0, BLOCK_N)
    tl.store(Q + q_row + cols, tl.reshape(q, (BLOCK_N,)).to(Q.dtype.element_ty), mask=cols < N)
    g = tl.arange(0, groups)
    tl.store(S + s_row + g, scale, mask=g * GROUP_BLOCK < N)


@triton.jit
def _rmsnorm_quant_kernel(
    X, R, W, H, Q, S, stride_x, stride_r, stride_h, stride_q, stride_s, N, eps,
    FP8_MAX_VAL: tl.constexpr, MIN_AMAX: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP_BLOCK: tl.constexpr,
):
    """One program per row: h = x (+ residual, rounded to x's dtype and stored to H), y = weight * norm(h)
    rounded as triton_ops' RMSNorm kernel rounds it (its rmsnorm_row), then y's FP8 codes and scales per
    group (the per-token-group kernel's math): the same bits as those two kernels, without y in memory."""
    row = tl.program_id(0).to(tl.int64)
    y = rmsnorm_row(X, R, W, H, row, stride_x, stride_r, stride_h, N, eps, HAS_RESIDUAL, BLOCK_N)
    y = y.to(X.dtype.element_ty).to(tl.float32)
    _quantize_groups(y, Q, S, row * stride_q, row * stride_s, N, FP8_MAX_VAL, MIN_AMAX, BLOCK_N, GROUP_BLOCK)


@triton.jit
def _silu_and_mul_quant_kernel(
    X, Q, S, stride_x, stride_q, stride_s, I, group_size,
    FP8_MAX_VAL: tl.constexpr, MIN_AMAX: tl.constexpr, BLOCK: tl.constexpr,
):
    """Grid (tokens, groups): silu(gate) * up over one group of `group_size` columns, rounded as
    triton_ops' SiLU-and-mul kernel rounds it (x's dtype), then that group's FP8 codes and scale."""
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    cols = g * group_size + tl.arange(0, BLOCK)
    mask = (tl.arange(0, BLOCK) < group_size) & (cols < I)
    gate = tl.load(X + t * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + t * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(X.dtype.element_ty).to(tl.float32)
    y = (act * up).to(X.dtype.element_ty).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(y), 0), MIN_AMAX) / FP8_MAX_VAL
    q = tl.clamp(y / scale, -FP8_MAX_VAL, FP8_MAX_VAL)
    tl.store(Q + t * stride_q + cols, q.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + t * stride_s + g, scale)


def fused_quant_fits(width: int, group_size: int) -> bool:
    """Whether the fused kernels take a row of `width` columns in groups of `group_size` (a whole row, or a
    whole group, in registers: up to MAX_ONE_PASS_BLOCK columns; RMSNorm's groups a power of two)."""
    if width % group_size or triton.next_power_of_2(width) > MAX_ONE_PASS_BLOCK:
        return False
    return group_size == width or group_size & (group_size - 1) == 0


def _rmsnorm_quant_impl(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                        group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m, n = x.shape
    assert fused_quant_fits(n, group_size) and x.stride(-1) == 1
    q = torch.empty((m, n), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((m, n // group_size), dtype=torch.float32, device=x.device)
    h = torch.empty((m, n) if residual is not None else (0, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return q, s, h
    block = triton.next_power_of_2(n)
    r, h_arg = (residual, h) if residual is not None else (x, x)  # (not accessed without a residual)
    _rmsnorm_quant_kernel[(m,)](
        x, r, weight, h_arg, q, s, x.stride(0), r.stride(0), h_arg.stride(0), q.stride(0), s.stride(0), n, eps,
        FP8_MAX_VAL=FP8_MAX, MIN_AMAX=_MIN_AMAX, HAS_RESIDUAL=residual is not None, BLOCK_N=block,
        GROUP_BLOCK=block if group_size == n else group_size,
        num_warps=_num_warps(block))  # the RMSNorm kernel's: the same sum of squares, bit for bit
    return q, s, h


def _silu_and_mul_quant_impl(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    m, two_i = x.shape
    inter = two_i // 2
    assert fused_quant_fits(inter, group_size) and x.stride(-1) == 1
    q = torch.empty((m, inter), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((m, inter // group_size), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, s
    block = triton.next_power_of_2(group_size)
    _silu_and_mul_quant_kernel[(m, inter // group_size)](
        x, q, s, x.stride(0), q.stride(0), s.stride(0), inter, group_size,
        FP8_MAX_VAL=FP8_MAX, MIN_AMAX=_MIN_AMAX, BLOCK=block, num_warps=max(1, min(block // 1024, 16)))
    return q, s


@triton.jit
def _w8a8_block_matmul_kernel(
    A, B, C, As, Bs, M, N, K,
    stride_am, stride_bn, stride_cm, stride_asm, stride_bsn,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """C[M, N] = sum over K blocks of (A_blk @ B_blk^T) x a_scale[m, kb] x b_scale[n // GROUP_N, kb].
    BLOCK_K == GROUP_K (one scale per K step); BLOCK_N divides GROUP_N (one weight scale per tile)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_ptrs = A + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    b_ptrs = B + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]  # B^T tile: [BLOCK_K, BLOCK_N]
    as_ptrs = As + offs_m.to(tl.int64) * stride_asm
    bs_ptrs = Bs + (offs_n // GROUP_N).to(tl.int64) * stride_bsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(tl.cdiv(K, BLOCK_K)):
        k_left = K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=mask_n[None, :] & (offs_k[:, None] < k_left), other=0.0)
        a_s = tl.load(as_ptrs + kb, mask=mask_m, other=0.0)
        b_s = tl.load(bs_ptrs + kb, mask=mask_n, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    c = acc.to(C.dtype.element_ty)
    tl.store(C + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :], c, mask=mask_m[:, None] & mask_n[None, :])


def _block_m(m: int) -> int:
    # Decode batches are a few rows: small M tiles waste less of each MMA (tl.dot needs M >= 16). Above 16 rows
    # one tile height for every M: the tile height changes the MMA's summation order, and a batch padded to a
    # piecewise graph's level must compute each row as the same batch run eagerly (with FP8 activations
    # re-quantized at every layer, a last-bit difference grows through the model: docs/cuda_graphs.md). Up to
    # 16 rows the model's linears take the weight-only small-M kernel anyway.
    return 16 if m <= 16 else 64


def _w8a8_block_matmul_impl(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                            block_n: int, block_k: int, out_dtype: torch.dtype) -> torch.Tensor:
    m, k = a.shape
    n = b.shape[0]
    assert b.shape[1] == k and a_scale.shape == (m, triton.cdiv(k, block_k))
    assert b_scale.shape == (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    assert a.stride(-1) == 1 and b.stride(-1) == 1 and a_scale.stride(-1) == 1 and b_scale.stride(-1) == 1
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return c
    tile_n = min(block_n, 128)
    assert block_n % tile_n == 0
    bm = _block_m(m)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, tile_n))
    _w8a8_block_matmul_kernel[grid](
        a, b, c, a_scale, b_scale, m, n, k,
        a.stride(0), b.stride(0), c.stride(0), a_scale.stride(0), b_scale.stride(0),
        GROUP_N=block_n, GROUP_K=block_k, BLOCK_M=bm, BLOCK_N=tile_n, BLOCK_K=block_k,
        num_warps=4, num_stages=3)
    return c


_quant_op = torch.library.custom_op("duet::fp8_per_token_group_quant", _per_token_group_quant_impl,
                                    mutates_args=())


@_quant_op.register_fake
def _(x, group_size):
    m, k = x.shape
    return (x.new_empty((m, k), dtype=FP8_DTYPE), x.new_empty((m, k // group_size), dtype=torch.float32))


_matmul_op = torch.library.custom_op("duet::w8a8_block_fp8_matmul", _w8a8_block_matmul_impl, mutates_args=())


@_matmul_op.register_fake
def _(a, b, a_scale, b_scale, block_n, block_k, out_dtype):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


_rmsnorm_quant_op = torch.library.custom_op("duet::fp8_rmsnorm_quant", _rmsnorm_quant_impl, mutates_args=())


@_rmsnorm_quant_op.register_fake
def _(x, residual, weight, eps, group_size):
    m, n = x.shape
    return (x.new_empty((m, n), dtype=FP8_DTYPE), x.new_empty((m, n // group_size), dtype=torch.float32),
            x.new_empty((m, n) if residual is not None else (0, n)))


_silu_quant_op = torch.library.custom_op("duet::fp8_silu_and_mul_quant", _silu_and_mul_quant_impl,
                                         mutates_args=())


@_silu_quant_op.register_fake
def _(x, group_size):
    m, inter = x.shape[0], x.shape[1] // 2
    return x.new_empty((m, inter), dtype=FP8_DTYPE), x.new_empty((m, inter // group_size), dtype=torch.float32)


def _tracing() -> bool:
    return torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0


def per_token_group_quant_fp8(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    if _tracing():
        return _quant_op(x, group_size)
    return _per_token_group_quant_impl(x, group_size)


def w8a8_block_fp8_matmul(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                          block: tuple[int, int], out_dtype: torch.dtype) -> torch.Tensor:
    if _tracing():
        return _matmul_op(a, b, a_scale, b_scale, block[0], block[1], out_dtype)
    return _w8a8_block_matmul_impl(a, b, a_scale, b_scale, block[0], block[1], out_dtype)


def rmsnorm_quant_fp8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                      group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(FP8 codes, scales [M, N / group_size], h) of y = weight * rmsnorm(h), h = x + residual (x without one;
    h is then None): triton_ops.rmsnorm then per_token_group_quant_fp8 in one kernel, bit for bit."""
    q, s, h = (_rmsnorm_quant_op if _tracing() else _rmsnorm_quant_impl)(x, residual, weight, eps, group_size)
    return q, s, (h if residual is not None else None)


def silu_and_mul_quant_fp8(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 codes, scales) of silu(x[:, :I]) * x[:, I:]: triton_ops.silu_and_mul then
    per_token_group_quant_fp8 in one kernel, bit for bit."""
    return (_silu_quant_op if _tracing() else _silu_and_mul_quant_impl)(x, group_size)
