"""Causal attention for extend (prefill) batches over the token-level KV pool (page size 1).

The new tokens of all requests are concatenated in `q` / `k` / `v` / `o`. The cached prefix is gathered
from `k_buffer` / `v_buffer` through `req_to_token`; the new tokens' keys and values are read from `k` /
`v` directly, and the same kernel stores them in the pool at `out_cache_loc` (one launch per layer instead
of a store kernel and an attention kernel: each Triton launch costs host time).

Grid `(bs, num_heads, cdiv(max_extend_len, BLOCK_M))`, its last tiles (which attend to the most keys)
dispatched first: a program takes BLOCK_M new tokens of one request and one head and runs a flash-attention
loop (online softmax, fp32 accumulation) over the KV blocks: first the positions every row of the tile sees
(the prefix, then earlier new tokens; no causal mask), then the tile's own diagonal band with the causal mask.
Blocks past the tile's last position are never visited.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from model_executor.layers.attention.triton_ops.decode_attention import Q_PRESCALE, kv_dots_in_fp16
from model_executor.layers.triton_ops.kernels import to_f16_scaled

_LOG2E = 1.4426950408889634


def _dot_precision(dtype: torch.dtype) -> str:
    # float32: three tf32 MMAs per product (about fp32 accuracy, unlike plain tf32; far cheaper than "ieee")
    return "tf32x3" if dtype == torch.float32 else "tf32"


class ExtendConfig(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int  # the new tokens' loops (software pipelining of their K/V loads; 1: none)
    pool_stages: int = 0  # the cached prefix's loop (rows gathered from the pool); 0: num_stages


# Up to this many new tokens in the batch's longest request, 16-bit inputs of head_dim <= 128 take 64x64 tiles
# without pipelining the new tokens' loop; above it the new tokens' loop takes 3 stages (64x64 tiles for
# head_dim 64, 128x128 for 128): each is the faster on its side on the H200 (bench_attention,
# docs/benchmarks.md, "Kernel choices"). 512 is an extend graph level, so a batch and the level it pads to
# take the same tile.
SHORT_EXTEND_MAX_TOKENS = 512
# The cached prefix's loop gathers its rows through req_to_token and is pipelined in 3 stages, whatever the
# new tokens' tile: that makes a short extend behind a long prefix markedly faster on the H200
# (docs/benchmarks.md).
POOL_STAGES = 3


def shared_bytes(cfg: ExtendConfig, head_dim: int) -> int:
    """An upper bound on the kernel's shared memory at a 16-bit config: q's tile and each pipeline stage's K
    and V tiles (ptxas for sm_90, triton 3.6: 224 KiB estimated and used at 128x128 tiles of 128-wide heads in
    3 stages; 112 KiB estimated, 80.5 KiB used for 64x64 tiles with the prefix's loop in 3 stages)."""
    d = triton.next_power_of_2(head_dim)
    return 2 * d * (cfg.block_m + 2 * cfg.block_n * max(cfg.num_stages, cfg.pool_stages))


@functools.cache
def max_shared_bytes(device_index: int) -> int:
    """The shared memory a program may use on this CUDA device (the bound Triton checks at launch)."""
    return triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"]


def get_extend_config(head_dim: int, dtype: torch.dtype = torch.bfloat16,
                      max_extend_len: int | None = None, max_shared: int | None = None) -> ExtendConfig:
    """Tile sizes for `extend_attention_fwd` on Hopper/Ampere-class GPUs (the interpreter ignores warps).

    16-bit inputs of head_dim <= 128: 64x64 tiles up to SHORT_EXTEND_MAX_TOKENS new tokens per request, the
    new tokens' loop not pipelined; above (or when max_extend_len is not given) 3 stages, 64x64 tiles for
    head_dim 64 and 128x128 for 128; the prefix's loop in POOL_STAGES stages. Where a device's shared memory
    (max_shared, bytes a program) is below shared_bytes of those, the unpipelined tiles of before (64x64 up
    to SHORT_EXTEND_MAX_TOKENS, 128x64 above). float32 inputs (tests, not serving) use tf32x3 dots, whose
    operands need smaller tiles.
    """
    if dtype == torch.float32:
        return ExtendConfig(block_m=32, block_n=32, num_warps=4, num_stages=1)
    if head_dim > 128:
        return ExtendConfig(block_m=64, block_n=32, num_warps=8, num_stages=1)
    if max_extend_len is not None and max_extend_len <= SHORT_EXTEND_MAX_TOKENS:
        cfg = ExtendConfig(block_m=64, block_n=64, num_warps=4, num_stages=1, pool_stages=POOL_STAGES)
        unpipelined = ExtendConfig(block_m=64, block_n=64, num_warps=4, num_stages=1)
    elif head_dim <= 64:
        cfg = ExtendConfig(block_m=64, block_n=64, num_warps=4, num_stages=3, pool_stages=POOL_STAGES)
        unpipelined = ExtendConfig(block_m=128, block_n=64, num_warps=4, num_stages=1)
    else:
        cfg = ExtendConfig(block_m=128, block_n=128, num_warps=8, num_stages=3, pool_stages=POOL_STAGES)
        unpipelined = ExtendConfig(block_m=128, block_n=64, num_warps=8, num_stages=1)
    if max_shared is not None and shared_bytes(cfg, head_dim) > max_shared:
        return unpipelined
    return cfg


@triton.jit
def _attend_block_range(
    acc, e_sum, e_max, q, q_pos,
    K, V, stride_k, stride_v, slot_table, row_base,
    kv_start, kv_end, qk_scale, v_scale,
    offs_d, mask_d,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    FROM_POOL: tl.constexpr,
    IN_PRECISION: tl.constexpr,
    STAGES: tl.constexpr,
    FULL_BLOCKS: tl.constexpr = False,
    SLIDING: tl.constexpr = False,
    window=0,
):
    """Online softmax over key positions kv_start..kv_end, the loop software-pipelined in STAGES stages. K / V
    point at the KV head's first element; FROM_POOL: position p is row slot_table[p] (the pool); otherwise row
    row_base + p (the new tokens). qk_scale includes the pool's K scale and v_scale is its V scale (applied
    only FROM_POOL: the new tokens have none). FULL_BLOCKS (not CAUSAL): the caller guarantees that
    kv_end - kv_start is a multiple of BLOCK_N, so no key needs a mask. SLIDING: each row also masks the keys
    `window` or more positions before its own (a row may then see no key of a block: its running max stays
    -inf, and the block adds nothing).

    The per-key arithmetic is what bounds this loop on Hopper: the scale is folded into the exponent (one
    multiply-add a score), masks are applied only where a block can hold hidden keys, and P @ V accumulates
    into the rescaled acc inside the dot."""
    for start_n in tl.range(kv_start, kv_end, BLOCK_N, num_stages=STAGES):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < kv_end
        if FULL_BLOCKS:  # only the head dim can be masked
            mask_k = mask_d[:, None]
            mask_v = mask_d[None, :]
        else:
            mask_k = mask_n[None, :] & mask_d[:, None]
            mask_v = mask_n[:, None] & mask_d[None, :]
        if FROM_POOL:
            rows = tl.load(slot_table + offs_n, mask=mask_n, other=0).to(tl.int64)
        else:
            rows = row_base + offs_n.to(tl.int64)
        # K transposed: [BLOCK_D, BLOCK_N]
        k = tl.load(K + rows[None, :] * stride_k + offs_d[:, None], mask=mask_k, other=0.0)
        qk = tl.dot(q, k.to(q.dtype), input_precision=IN_PRECISION)  # unscaled
        if SLIDING:
            visible = mask_n[None, :] & (offs_n[None, :] > q_pos[:, None] - window)
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= q_pos[:, None])
            qk = tl.where(visible, qk, float("-inf"))
        elif CAUSAL:
            qk = tl.where(mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None]), qk, float("-inf"))
        elif not FULL_BLOCKS:
            qk = tl.where(mask_n[None, :], qk, float("-inf"))
        n_e_max = tl.maximum(tl.max(qk, 1) * qk_scale, e_max)  # log2 domain
        if SLIDING:  # (a row that has seen no key keeps -inf: exp2(-inf - -inf) would be NaN)
            n_e_max_or_0 = tl.where(n_e_max == float("-inf"), 0.0, n_e_max)
            re_scale = tl.exp2(e_max - n_e_max_or_0)
            p = tl.exp2(qk * qk_scale - n_e_max_or_0[:, None])
        else:
            re_scale = tl.exp2(e_max - n_e_max)
            p = tl.exp2(qk * qk_scale - n_e_max[:, None])
        v = tl.load(V + rows[:, None] * stride_v + offs_d[None, :], mask=mask_v, other=0.0)
        acc = acc * re_scale[:, None]
        if FROM_POOL:
            acc += tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=IN_PRECISION) * v_scale
        else:
            acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc, input_precision=IN_PRECISION)
        e_sum = e_sum * re_scale + tl.sum(p, 1)
        e_max = n_e_max
    return acc, e_sum, e_max


@triton.jit
def _extend_kernel(
    Q, K_New, V_New, O, K_Buffer, V_Buffer, Out_cache_loc, Sinks,
    Req_to_token, Req_pool_indices, Seq_lens, Extend_seq_lens, Extend_start_loc,
    qk_scale, k_scale, v_scale, window,
    stride_qbs, stride_qh,
    stride_knbs, stride_knh,
    stride_vnbs, stride_vnh,
    stride_obs, stride_oh,
    stride_kbs, stride_kh,
    stride_vbs, stride_vh,
    stride_req_b,
    KV_GROUP_NUM: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IN_PRECISION: tl.constexpr,
    POOL_F16: tl.constexpr,
    Q_PRESCALE: tl.constexpr,
    NEW_STAGES: tl.constexpr,
    POOL_STAGES: tl.constexpr,
    SLIDING: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    cur_batch = tl.program_id(0)
    cur_head = tl.program_id(1)
    # The last tiles of a request attend to the most keys: dispatched first, so that short ones fill the tail.
    block_m = tl.num_programs(2) - 1 - tl.program_id(2)

    extend_len = tl.load(Extend_seq_lens + cur_batch).to(tl.int32)
    if block_m * BLOCK_M >= extend_len:
        return
    seq_len = tl.load(Seq_lens + cur_batch).to(tl.int32)
    prefix_len = seq_len - extend_len
    start_loc = tl.load(Extend_start_loc + cur_batch).to(tl.int64)
    req_row = tl.load(Req_pool_indices + cur_batch).to(tl.int64)
    kv_head = (cur_head // KV_GROUP_NUM).to(tl.int64)

    offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < extend_len
    offs_d = tl.arange(0, BLOCK_D)
    if BLOCK_D == HEAD_DIM:  # all-true splat: keeps the loads vectorised
        mask_d = tl.full([BLOCK_D], 1, tl.int1)
    else:
        mask_d = offs_d < HEAD_DIM
    mask_md = mask_m[:, None] & mask_d[None, :]
    new_rows = start_loc + offs_m
    k_new = K_New + kv_head * stride_knh
    v_new = V_New + kv_head * stride_vnh
    k_pool = K_Buffer + kv_head * stride_kh
    v_pool = V_Buffer + kv_head * stride_vh

    # The tile's new K/V into the pool (the first query head of each KV group does it). Nothing in this
    # kernel reads new tokens from the pool, so the stores race with no load.
    if cur_head % KV_GROUP_NUM == 0:
        slots = tl.load(Out_cache_loc + new_rows, mask=mask_m, other=0).to(tl.int64)
        # In float32 on both sides of the (runtime) scale branch: Triton needs one type per variable there.
        kn = tl.load(k_new + new_rows[:, None] * stride_knbs + offs_d[None, :], mask=mask_md).to(tl.float32)
        if k_scale != 1.0:  # an FP8 pool with a scale holds K / k_scale
            kn = kn / k_scale
        tl.store(k_pool + slots[:, None] * stride_kbs + offs_d[None, :], kn.to(K_Buffer.dtype.element_ty),
                 mask=mask_md)
        vn = tl.load(v_new + new_rows[:, None] * stride_vnbs + offs_d[None, :], mask=mask_md).to(tl.float32)
        if v_scale != 1.0:
            vn = vn / v_scale
        tl.store(v_pool + slots[:, None] * stride_vbs + offs_d[None, :], vn.to(V_Buffer.dtype.element_ty),
                 mask=mask_md)

    q = tl.load(Q + new_rows[:, None] * stride_qbs + cur_head * stride_qh + offs_d[None, :], mask=mask_md, other=0.0)
    q_pos = prefix_len + offs_m

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    e_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    e_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    slot_table = Req_to_token + req_row * stride_req_b
    new_row_base = start_loc - prefix_len  # position p >= prefix_len is new row new_row_base + p
    # The first key any row of the tile sees: 0, or with a window, the window of the tile's first query
    if SLIDING:
        first_key = tl.maximum(prefix_len + block_m * BLOCK_M - window + 1, 0)
    else:
        first_key = 0

    # 1. The cached prefix, from the pool: visible to every row. An FP8 pool's dots run in fp16, q scaled by
    # Q_PRESCALE (decode_attention.kv_dots_in_fp16; the new tokens' dots below keep q's dtype).
    if POOL_F16:
        q_pool = to_f16_scaled(q, Q_PRESCALE)
        pool_qk_scale = qk_scale * k_scale / Q_PRESCALE
    else:
        q_pool = q
        pool_qk_scale = qk_scale * k_scale
    if prefix_len > first_key:  # (a pipelined loop's prologue costs even when it runs no step: 0.5-1.4 us at 128 tokens)
        acc, e_sum, e_max = _attend_block_range(
            acc, e_sum, e_max, q_pool, q_pos, k_pool, v_pool, stride_kbs, stride_vbs, slot_table, 0,
            first_key, prefix_len, pool_qk_scale, v_scale, offs_d, mask_d,
            BLOCK_N=BLOCK_N, CAUSAL=False, FROM_POOL=True, IN_PRECISION=IN_PRECISION, STAGES=POOL_STAGES,
            SLIDING=SLIDING, window=window)
    # 2. New tokens before the tile's first query: visible to every row (block_m * BLOCK_M keys: whole blocks
    # when BLOCK_N divides BLOCK_M).
    shared_end = prefix_len + block_m * BLOCK_M
    acc, e_sum, e_max = _attend_block_range(
        acc, e_sum, e_max, q, q_pos, k_new, v_new, stride_knbs, stride_vnbs, slot_table, new_row_base,
        tl.maximum(prefix_len, first_key), shared_end, qk_scale, 1.0, offs_d, mask_d,
        BLOCK_N=BLOCK_N, CAUSAL=False, FROM_POOL=False, IN_PRECISION=IN_PRECISION, STAGES=NEW_STAGES,
        FULL_BLOCKS=BLOCK_M % BLOCK_N == 0 and not SLIDING, SLIDING=SLIDING, window=window)
    # 3. The tile's own band, up to its last real query position: causal mask.
    band_end = prefix_len + tl.minimum((block_m + 1) * BLOCK_M, extend_len)
    acc, e_sum, e_max = _attend_block_range(
        acc, e_sum, e_max, q, q_pos, k_new, v_new, stride_knbs, stride_vnbs, slot_table, new_row_base,
        shared_end, band_end, qk_scale, 1.0, offs_d, mask_d,
        BLOCK_N=BLOCK_N, CAUSAL=True, FROM_POOL=False, IN_PRECISION=IN_PRECISION, STAGES=NEW_STAGES,
        SLIDING=SLIDING, window=window)

    if HAS_SINKS:  # the head's sink logit joins the denominator (log2 domain, relative to the running max)
        e_sum += tl.exp2(tl.load(Sinks + cur_head).to(tl.float32) * 1.4426950408889634 - e_max)
    if SLIDING:  # (rows past the request's last token may see no key: keep their unstored output finite)
        e_sum = tl.maximum(e_sum, 1e-30)
    out = acc / e_sum[:, None]
    tl.store(O + new_rows[:, None] * stride_obs + cur_head * stride_oh + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=mask_md)


def extend_attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out_cache_loc: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    max_extend_len: int,
    sm_scale: float,
    config: ExtendConfig | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Stores the new tokens' K/V in the pool and runs causal extend attention, in one kernel; writes `o`.

    q, o: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim] (unit stride in the
    last dim; any row / head strides), the new tokens of all requests; request b owns rows
    extend_start_loc[b] .. extend_start_loc[b] + extend_seq_lens[b]. out_cache_loc: [num_tokens] the slot
    each new token's K/V is stored at. k_buffer, v_buffer: [num_slots + 1, num_kv_heads, head_dim];
    req_to_token: int32 [rows, max_ctx]; req_pool_indices, seq_lens (total length, prefix + new),
    extend_seq_lens, extend_start_loc: [bs] on the device (int32 or int64). New token i of request b sits
    at position prefix_len + i, where prefix_len = seq_lens[b] - extend_seq_lens[b], and attends to
    positions 0 .. prefix_len + i: the prefix read from the pool through req_to_token, the new tokens
    straight from k / v (so the kernel never reads a slot it is writing).
    max_extend_len: host int >= every extend_seq_lens[b] (sizes the grid).
    config: tile override (default `get_extend_config(head_dim, q.dtype, max_extend_len, <the device's shared
    memory>)`).
    k_scale, v_scale: the pool's scales: an FP8 pool stores K / k_scale and V / v_scale (saturated casts)
    and the prefix read from it is scaled back; the new tokens are attended unquantized.
    sliding_window: each query at position p attends only to positions p - sliding_window + 1 .. p (None: all
    up to p); the keys before a tile's window are not read.
    sinks: [num_heads] sink logits (gpt-oss): exp(sinks[h]) joins the softmax denominator of every query of
    head h, as a key with no value (None: none).
    """
    num_tokens, num_heads, head_dim = q.shape
    bs = seq_lens.shape[0]
    num_kv_heads = k_buffer.shape[1]
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert k.shape == v.shape == (num_tokens, num_kv_heads, head_dim) and o.shape == q.shape
    assert k_buffer.shape[2] == head_dim and v_buffer.shape[2] == head_dim
    assert all(t.stride(-1) == 1 for t in (q, k, v, o, k_buffer, v_buffer, req_to_token))
    assert sliding_window is None or sliding_window >= 1
    assert sinks is None or sinks.shape == (num_heads,)
    if bs == 0 or num_tokens == 0 or max_extend_len <= 0:
        return
    cfg = config or get_extend_config(head_dim, q.dtype, max_extend_len,
                                      max_shared_bytes(q.device.index or 0) if q.is_cuda else None)

    grid = (bs, num_heads, triton.cdiv(max_extend_len, cfg.block_m))
    _extend_kernel[grid](
        q, k, v, o, k_buffer, v_buffer, out_cache_loc, q if sinks is None else sinks,
        req_to_token, req_pool_indices, seq_lens, extend_seq_lens, extend_start_loc,
        sm_scale * _LOG2E, k_scale, v_scale, sliding_window or 0,
        q.stride(0), q.stride(1),
        k.stride(0), k.stride(1),
        v.stride(0), v.stride(1),
        o.stride(0), o.stride(1),
        k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0),
        KV_GROUP_NUM=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        IN_PRECISION=_dot_precision(q.dtype),
        POOL_F16=kv_dots_in_fp16(q.dtype, k_buffer.dtype),
        Q_PRESCALE=Q_PRESCALE,
        NEW_STAGES=cfg.num_stages,
        POOL_STAGES=cfg.pool_stages or cfg.num_stages,
        SLIDING=sliding_window is not None,
        HAS_SINKS=sinks is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
