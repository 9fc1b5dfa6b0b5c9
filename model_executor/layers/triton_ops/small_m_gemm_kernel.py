"""The small-M GEMM's Triton kernels: the GEMM (tl.dot tiles or CUDA-core GEMV rows, split K, the fused
prologues and epilogues) and split K's second-kernel reduce. small_m_gemm.py's docstring describes the layouts,
the swapped dot, the fusions and split K; _small_m_gemm_kernel's says what each flag computes. small_m_gemm._launch
is the only caller.
"""

from __future__ import annotations

import triton
import triton.language as tl

from model_executor.layers.triton_ops.kernels import to_f16_scaled


@triton.jit
def _rope_operands(offs_n, rows_m, POS, LOC, COS, stride_cos, HALF: tl.constexpr):
    """The ROPE epilogue's loads, taken before the weights stream (their latency hides under it): each token's
    KV slot and the cos / sin of its position for the program's half rows offs_n ([1, BLOCK_M] int64, then
    [BLOCK_N, BLOCK_M] float32 twice)."""
    j = (offs_n % HALF)[:, None]
    pos = tl.load(POS + rows_m).to(tl.int64)[None, :]
    slot = tl.load(LOC + rows_m).to(tl.int64)[None, :]
    cos = tl.load(COS + pos * stride_cos + j).to(tl.float32)
    sin = tl.load(COS + pos * stride_cos + HALF + j).to(tl.float32)
    return slot, cos, sin


@triton.jit
def _add_norm_operands(R, G, rows_m, rows_n, N):
    """ADD_NORM's operands for rows rows_m and columns rows_n: the residual [BLOCK_N, BLOCK_M] (R: contiguous
    [M, N]) and the norm weight [BLOCK_N, 1], float32."""
    r_n = tl.load(R + rows_m[None, :] * N + rows_n[:, None]).to(tl.float32)
    return r_n, tl.load(G + rows_n).to(tl.float32)[:, None]


@triton.jit
def _rope_store(a, b, offs_n, rows_n, rows_b, offs_m, N, M, Y, stride_ym, slot, cos, sin, KB, VB,
                stride_kb_slot, stride_kb_head, stride_vb_slot, stride_vb_head, num_q_heads,
                num_kv_heads, k_scale, v_scale, HALF: tl.constexpr):
    """The ROPE epilogue: a, b [BLOCK_N, BLOCK_M] float32 sums of rows rows_n and rows_b = rows_n + HALF (half
    rows offs_n), a column per token (offs_m), with _rope_operands' slot, cos and sin. Rounded to y's dtype
    first, as the linear's output, then as rotary_store_kv computes."""
    a = a.to(Y.dtype.element_ty).to(tl.float32)
    b = b.to(Y.dtype.element_ty).to(tl.float32)
    valid = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    head = (offs_n // HALF)[:, None]
    j = (offs_n % HALF)[:, None]
    ra = a * cos - b * sin
    rb = b * cos + a * sin
    is_q = head < num_q_heads
    is_k = (head >= num_q_heads) & (head < num_q_heads + num_kv_heads)
    is_v = head >= num_q_heads + num_kv_heads
    # y: the q heads rotated (in place, as rotary_store_kv leaves q); k and v as the linear gives them
    y_row = Y + offs_m[None, :] * stride_ym
    tl.store(y_row + rows_n[:, None], tl.where(is_q, ra, a).to(Y.dtype.element_ty), mask=valid)
    tl.store(y_row + rows_b[:, None], tl.where(is_q, rb, b).to(Y.dtype.element_ty), mask=valid)
    k_off = slot * stride_kb_slot + (head - num_q_heads).to(tl.int64) * stride_kb_head + j
    ka = ra.to(Y.dtype.element_ty).to(tl.float32) / k_scale
    kb = rb.to(Y.dtype.element_ty).to(tl.float32) / k_scale
    tl.store(KB + k_off, ka.to(KB.dtype.element_ty), mask=valid & is_k)
    tl.store(KB + k_off + HALF, kb.to(KB.dtype.element_ty), mask=valid & is_k)
    v_off = slot * stride_vb_slot + (head - num_q_heads - num_kv_heads).to(tl.int64) * stride_vb_head + j
    tl.store(VB + v_off, (a / v_scale).to(VB.dtype.element_ty), mask=valid & is_v)
    tl.store(VB + v_off + HALF, (b / v_scale).to(VB.dtype.element_ty), mask=valid & is_v)


@triton.jit
def _gemv_row_step(acc2, up2, sq, wf, wf_up, g, x_ptrs, r_ptrs, h_ptrs, k_mask, store_h,
                   EVEN_K: tl.constexpr, PAIRED: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """One row's K step of the GEMV: its input (NORM: h = x (+ r, rounded to x's dtype as torch adds them;
    stored to H where store_h), whose squares go into sq, times the norm weight g) times the float32 weight
    tile into acc2, and the paired tile into up2. (Unmasked loads where K is even: masked loads of a runtime
    bound are not vectorized.)"""
    xt = tl.load(x_ptrs) if EVEN_K else tl.load(x_ptrs, mask=k_mask, other=0.0)
    if NORM:
        if HAS_RESIDUAL:
            r = tl.load(r_ptrs) if EVEN_K else tl.load(r_ptrs, mask=k_mask, other=0.0)
            xt = (xt.to(tl.float32) + r.to(tl.float32)).to(xt.dtype)
            if store_h:
                if EVEN_K:
                    tl.store(h_ptrs, xt)
                else:
                    tl.store(h_ptrs, xt, mask=k_mask)
        xf = xt.to(tl.float32)
        sq += xf * xf
        xf = xf * g
    else:
        xf = xt.to(tl.float32)
    acc2 += wf * xf
    if PAIRED:
        up2 += wf_up * xf
    return acc2, up2, sq


@triton.jit
def _gemv_column(acc2, sq, K, eps, NORM: tl.constexpr):
    """A row's [BLOCK_N, 1] sums from its [BLOCK_N, BLOCK_K] tile of them, scaled by 1 / rms(h) with NORM."""
    acc = tl.sum(acc2, axis=1)[:, None]
    if NORM:
        acc = acc * (1.0 / tl.sqrt(tl.sum(sq) / K + eps))
    return acc


# M and the workspace stride (a multiple of M) are not specialized on: one compile serves every row count
# (a GEMV of several rows compiles per row count: ROWS).
@triton.jit(do_not_specialize=["M", "stride_yk"])
def _small_m_gemm_kernel(
    X, W, S, BIAS, Y, YF, CNT, R, G, H, P, POS, LOC, COS, KB, VB, XS, M, N, K, k_per_split, eps, num_p,
    stride_xm, stride_wn, stride_ym, stride_sn, stride_yk,
    stride_cos, stride_kb_slot, stride_kb_head, stride_vb_slot, stride_vb_head, num_q_heads, num_kv_heads,
    k_scale, v_scale,
    SCALE: tl.constexpr,  # 0: none, 1: per output channel, 2: per (SCALE_BN x SCALE_BK) block
    SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
    HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, SPLITS: tl.constexpr, REDUCE: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr, GEMV: tl.constexpr,
    F16_DOT: tl.constexpr, X_PRESCALE: tl.constexpr, ONE_ROW: tl.constexpr, SILU_MUL: tl.constexpr,
    PAIR_DOT: tl.constexpr,
    NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ROPE: tl.constexpr, HALF: tl.constexpr,
    ADD_NORM: tl.constexpr, PRENORMED: tl.constexpr, NUM_P: tl.constexpr, X_FP8: tl.constexpr, ROWS: tl.constexpr,
    PRELOAD: tl.constexpr, ONE_STEP: tl.constexpr, PDL: tl.constexpr, PDL_SIGNAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """Program (n, s): columns [n * BLOCK_N, +BLOCK_N) over K range [s * k_per_split, +k_per_split).
    PARTIAL (SPLITS > 1 programs along K): store fp32 sums to Y + s * stride_yk (the workspace); with REDUCE,
    then count the arrival on the column tile's int32 counter CNT[n]: the split that arrives last adds the
    tile's partials in split order (0, 1, ..), adds the bias, stores YF in its dtype and puts the counter back
    to 0 (split K's reduce without a second launch; without REDUCE, _split_k_reduce_kernel does it).
    Otherwise add the bias and store in Y's dtype. GEMV (ROWS = M <= 4 rows): no tensor cores, the
    products accumulate elementwise in a [BLOCK_N, BLOCK_K] fp32 tile per row summed over K once at the end
    (every fusion below takes every row; one row has a loop of its own). SILU_MUL, ROPE, ADD_NORM and
    PRENORMED run in any single-split weight-only config, a GEMV or a tl.dot tile; NORM in a GEMV only.
    SILU_MUL (one split, no bias): W is [gate; up] with 2N rows; the program also sums the up rows
    n + N and stores silu(gate) * up, rounded as the linear followed by SiluAndMul would round them.
    NORM (GEMV, one split, not with SILU_MUL): each input row is G * rmsnorm(h) for h = x (+ R, rounded to
    x's dtype, as torch adds them; program 0 stores h to H): each step multiplies h by G and sums h^2 as it
    goes, and the sums are scaled by 1 / rms(h) at the end (no pass over x before the weights stream, no
    normed row in memory; one rounding fewer than RMSNorm then the GEMM, which rounds the normed row).
    ROPE (one split; the qkv projection of decode tokens, a row each, heads of 2 * HALF rows): N
    counts half rows; index t is row j = t % HALF of head t // HALF, paired like the SiLU's up rows with row
    j + HALF of the same head. The epilogue stores y with the q heads rotated (NeoX halves, cos/sin of row
    r's position POS[r] from COS), and writes the rotated k heads and the v heads into the KV pool KB / VB
    at slot LOC[r] (divided by k_scale / v_scale), rounded as the rotary_store_kv kernel rounds them.
    ADD_NORM (one split, not paired; decode tokens' o_proj or down, whose output feeds an RMSNorm):
    h = y + R (y rounded to its dtype first, as the linear's output; h rounded as torch adds) goes to H, each
    row's sum of h^2 over the program's columns to P[row * programs + pid_n], and Y receives G * h (rounded):
    the next GEMV's input before the 1 / rms(h) that only the sum of the row's P gives. PRENORMED (one split): x
    holds such G * h rows and P their partial sums, num_p a row (NUM_P: a power of two >= num_p); each row's
    sums are scaled by 1 / sqrt(sum(its P) / K + eps) at the end, as NORM scales them. X_FP8 (tl.dot): x holds
    FP8 codes and XS their float32 scales, one per row (per-channel or no weight scales: the sums are scaled by
    it at the end) or one per row and 1 x SCALE_BK group (block scales: each step's dot is scaled by its
    column); the dot runs on FP8 operands (the W8A8 GEMM's math).
    PAIR_DOT (a tl.dot tile with SILU_MUL or ROPE): the BLOCK_N rows and their BLOCK_N paired rows are one
    [2 * BLOCK_N, BLOCK_K] weight tile and one dot, whose sums are split into the two after the loop (the same
    products; a 64-row dot stays on sm_90's wgmma where two 32-row dots do not).
    PRELOAD (a one-row plain GEMV: not paired, x not normed in the kernel): the first K step's weight tile is
    loaded before anything else and the step taken outside the loop (the same sums in the same order). PDL
    (with PRELOAD; launched with programmatic dependent launch): the kernel may start while the kernel before
    it still runs, and waits for it (gdc_wait) after that load and before it reads x or anything else that
    kernel may have written: a decode token's o_proj loads its weights while decode attention, which reads
    little, runs (see pdl_supported). PDL_SIGNAL (ROPE): decode attention launched with PDL after this kernel
    may start now; it loads the pool's older positions before it waits for this kernel (decode_attention.py)."""
    if PDL_SIGNAL:
        tl.extra.cuda.gdc_launch_dependents()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    PAIRED: tl.constexpr = SILU_MUL or ROPE  # a second row per output: up (n + N), or the head's other half
    # Out-of-range columns re-read a valid one (loads need no mask; their results are not stored); rows_m keeps
    # the padding rows' pointers in range (the dot's loads of x mask them).
    if ROPE:
        rows_n = tl.where(offs_n < N, (offs_n // HALF) * (2 * HALF) + offs_n % HALF, 0).to(tl.int64)
        rows_b = rows_n + HALF
    else:
        rows_n = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
        rows_b = rows_n + N
    rows_m = tl.where(offs_m < M, offs_m, 0)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    w_ptrs = W + rows_n[:, None] * stride_wn + (k_start + offs_k)[None, :]
    if SCALE == 2:
        s_ptrs = S + (rows_n // SCALE_BN) * stride_sn
    # What the epilogue reads besides the sums, loaded before the weights stream so that its latency hides under
    # them rather than following them (none of it is written by a kernel this one may overlap: PDL).
    if SCALE == 1:
        scale_n = tl.load(S + rows_n)[:, None]
        if PAIRED:
            scale_b = tl.load(S + rows_b)[:, None]
    if ROPE:
        rope_slot, rope_cos, rope_sin = _rope_operands(offs_n, rows_m, POS, LOC, COS, stride_cos, HALF)
    # A wgmma tile (tl.dot, 64 or more rows a warpgroup) loads ADD_NORM's residual after its loop: held in registers
    # across it, ptxas serializes the tile's wgmma chain (C7514, "non wgmma instructions reading accumulator
    # registers"; tests/sm90_compile.py checks it, docs/kernels.md).
    LATE_ADD_NORM: tl.constexpr = ADD_NORM and not GEMV and BLOCK_N >= 64
    if not (GEMV and ROWS == 1):  # (the one-row GEMV loads them after its PDL wait, below)
        if ADD_NORM and not LATE_ADD_NORM:
            r_n, g_n = _add_norm_operands(R, G, rows_m, rows_n, N)
        if PRENORMED:  # each row's partial sums of h^2 [BLOCK_M, NUM_P], summed after the loop
            offs_p = tl.arange(0, NUM_P)
            p_sums = tl.load(P + rows_m[:, None] * num_p + offs_p[None, :], mask=(offs_p < num_p)[None, :],
                             other=0.0)
    if GEMV and ROWS == 1:  # (its own loop, faster than the multi-row form below at one row: docs/kernels.md)
        x_ptrs = X + (k_start + offs_k)[None, :]  # row 0 as [1, BLOCK_K]
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        if NORM:
            g_ptrs = G + (k_start + offs_k)[None, :]
            sumsq = tl.zeros([1, BLOCK_K], dtype=tl.float32)
            if HAS_RESIDUAL:
                r_ptrs = R + (k_start + offs_k)[None, :]
                h_ptrs = H + (k_start + offs_k)[None, :]  # (program 0 stores h)
        if PAIRED:
            up_ptrs = W + rows_b[:, None] * stride_wn + (k_start + offs_k)[None, :]
            acc2_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            if SCALE == 2:
                s_up_ptrs = S + (rows_b // SCALE_BN) * stride_sn
        if PRELOAD:  # the first step's weight tile: weights never depend on the kernel before
            if EVEN_K:
                w_first = tl.load(w_ptrs)
            else:
                w_first = tl.load(w_ptrs, mask=(k_start + offs_k)[None, :] < k_end, other=0.0)
        if PDL:  # what follows may read what the kernel before wrote: wait for it (griddepcontrol.wait)
            tl.extra.cuda.gdc_wait()
        if ADD_NORM:  # this program's columns of the residual and the norm weight, before the weights stream
            r_n = tl.load(R + rows_n).to(tl.float32)[:, None]
            g_n = tl.load(G + rows_n).to(tl.float32)[:, None]
        if PRENORMED:  # the row's partial sums of h^2 (L2-resident: the kernel before wrote them), summed after
            # the loop: a program's weights start streaming before they arrive
            offs_p = tl.arange(0, NUM_P)
            p_sums = tl.load(P + offs_p, mask=offs_p < num_p, other=0.0)
        k_loop = k_start
        if PRELOAD:  # the loop's first step, taken with the tile loaded above (the loop's arithmetic)
            if EVEN_K:
                xt = tl.load(x_ptrs)
            else:
                xt = tl.load(x_ptrs, mask=(k_start + offs_k)[None, :] < k_end, other=0.0)
            prod = w_first.to(tl.float32) * xt.to(tl.float32)
            if SCALE == 2:
                prod = prod * tl.load(s_ptrs + k_start // SCALE_BK)[:, None]
            if ONE_STEP:  # (0 + prod: the same sums; no [BLOCK_N, BLOCK_K] float32 tile held across a loop)
                acc2 = prod
            else:
                acc2 += prod
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
            k_loop = k_start + BLOCK_K
        # An explicit stage count: Triton software-pipelines a loop's loads only when they feed a tl.dot,
        # or when the loop itself asks for stages; without it each step waits for its own loads.
        for k in tl.range(k_loop, k_end if not ONE_STEP else k_loop, BLOCK_K, num_stages=NUM_STAGES):
            k_mask = (k + offs_k)[None, :] < k_end
            if EVEN_K:
                w = tl.load(w_ptrs)
                xt = tl.load(x_ptrs)
            else:
                w = tl.load(w_ptrs, mask=k_mask, other=0.0)
                xt = tl.load(x_ptrs, mask=k_mask, other=0.0)
            if NORM:  # (unmasked where K is even: masked loads of a runtime bound are not vectorized)
                if HAS_RESIDUAL:
                    r = tl.load(r_ptrs) if EVEN_K else tl.load(r_ptrs, mask=k_mask, other=0.0)
                    xt = (xt.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
                    if pid_n == 0:
                        if EVEN_K:
                            tl.store(h_ptrs, xt)
                        else:
                            tl.store(h_ptrs, xt, mask=k_mask)
                    r_ptrs += BLOCK_K
                    h_ptrs += BLOCK_K
                xf = xt.to(tl.float32)
                sumsq += xf * xf
                g = tl.load(g_ptrs) if EVEN_K else tl.load(g_ptrs, mask=k_mask, other=0.0)
                xf = xf * g.to(tl.float32)
                g_ptrs += BLOCK_K
            else:
                xf = xt.to(tl.float32)
            prod = w.to(tl.float32) * xf
            if SCALE == 2:
                prod = prod * tl.load(s_ptrs + k // SCALE_BK)[:, None]
            acc2 += prod
            if PAIRED:
                if EVEN_K:
                    w_up = tl.load(up_ptrs)
                else:
                    w_up = tl.load(up_ptrs, mask=k_mask, other=0.0)
                prod_up = w_up.to(tl.float32) * xf
                if SCALE == 2:
                    prod_up = prod_up * tl.load(s_up_ptrs + k // SCALE_BK)[:, None]
                acc2_up += prod_up
                up_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        acc = tl.sum(acc2, axis=1)[:, None]  # [BLOCK_N, 1]
        if PAIRED:
            acc_up = tl.sum(acc2_up, axis=1)[:, None]
        if NORM:  # (one split: this program saw all of K)
            rstd = 1.0 / tl.sqrt(tl.sum(sumsq) / K + eps)
        if PRENORMED:
            rstd = 1.0 / tl.sqrt(tl.sum(p_sums) / K + eps)
        if NORM or PRENORMED:
            acc = acc * rstd
            if PAIRED:
                acc_up = acc_up * rstd
    elif GEMV:  # 2-4 rows
        # Row r of x (and of the residual and h: contiguous [M, K] with NORM) at the K step: ptrs + r * stride.
        x_ptrs = X + (k_start + offs_k)[None, :]
        r_ptrs = R + (k_start + offs_k)[None, :]
        h_ptrs = H + (k_start + offs_k)[None, :]  # (NORM with a residual: program 0 stores h)
        g_ptrs = G + (k_start + offs_k)[None, :]
        zeros = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        zeros_k = tl.zeros([1, BLOCK_K], dtype=tl.float32)
        # per row (up to 4): the sums of products, of the paired rows' products, of h^2 (NORM)
        acc2_0, up2_0, sq_0 = zeros, zeros, zeros_k
        acc2_1, up2_1, sq_1 = zeros, zeros, zeros_k
        acc2_2, up2_2, sq_2 = zeros, zeros, zeros_k
        acc2_3, up2_3, sq_3 = zeros, zeros, zeros_k
        if PAIRED:
            up_ptrs = W + rows_b[:, None] * stride_wn + (k_start + offs_k)[None, :]
            if SCALE == 2:
                s_up_ptrs = S + (rows_b // SCALE_BN) * stride_sn
        # An explicit stage count: Triton software-pipelines a loop's loads only when they feed a tl.dot,
        # or when the loop itself asks for stages; without it each step waits for its own loads.
        for k in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
            k_mask = (k + offs_k)[None, :] < k_end
            # the weight tile (and the paired one) converted and block-scaled once, then a product per row
            wf = (tl.load(w_ptrs) if EVEN_K else tl.load(w_ptrs, mask=k_mask, other=0.0)).to(tl.float32)
            if SCALE == 2:
                wf = wf * tl.load(s_ptrs + k // SCALE_BK)[:, None]
            wf_up = wf
            if PAIRED:
                wf_up = (tl.load(up_ptrs) if EVEN_K else tl.load(up_ptrs, mask=k_mask, other=0.0)).to(tl.float32)
                if SCALE == 2:
                    wf_up = wf_up * tl.load(s_up_ptrs + k // SCALE_BK)[:, None]
                up_ptrs += BLOCK_K
            g = 1.0
            if NORM:
                g = (tl.load(g_ptrs) if EVEN_K else tl.load(g_ptrs, mask=k_mask, other=0.0)).to(tl.float32)
            acc2_0, up2_0, sq_0 = _gemv_row_step(acc2_0, up2_0, sq_0, wf, wf_up, g, x_ptrs, r_ptrs, h_ptrs,
                                                 k_mask, pid_n == 0, EVEN_K, PAIRED, NORM, HAS_RESIDUAL)
            if ROWS > 1:
                acc2_1, up2_1, sq_1 = _gemv_row_step(acc2_1, up2_1, sq_1, wf, wf_up, g, x_ptrs + stride_xm,
                                                     r_ptrs + K, h_ptrs + K, k_mask, pid_n == 0, EVEN_K, PAIRED,
                                                     NORM, HAS_RESIDUAL)
            if ROWS > 2:
                acc2_2, up2_2, sq_2 = _gemv_row_step(acc2_2, up2_2, sq_2, wf, wf_up, g, x_ptrs + 2 * stride_xm,
                                                     r_ptrs + 2 * K, h_ptrs + 2 * K, k_mask, pid_n == 0, EVEN_K,
                                                     PAIRED, NORM, HAS_RESIDUAL)
            if ROWS > 3:
                acc2_3, up2_3, sq_3 = _gemv_row_step(acc2_3, up2_3, sq_3, wf, wf_up, g, x_ptrs + 3 * stride_xm,
                                                     r_ptrs + 3 * K, h_ptrs + 3 * K, k_mask, pid_n == 0, EVEN_K,
                                                     PAIRED, NORM, HAS_RESIDUAL)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
            r_ptrs += BLOCK_K
            h_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
        # [BLOCK_N, BLOCK_M]: row r's sums in column r, scaled by its 1 / rms (NORM: one split, so this
        # program saw all of K)
        acc = _gemv_column(acc2_0, sq_0, K, eps, NORM)
        acc_up = _gemv_column(up2_0, sq_0, K, eps, NORM)
        if ROWS > 1:
            acc = tl.where(offs_m[None, :] == 1, _gemv_column(acc2_1, sq_1, K, eps, NORM), acc)
            acc_up = tl.where(offs_m[None, :] == 1, _gemv_column(up2_1, sq_1, K, eps, NORM), acc_up)
        if ROWS > 2:
            acc = tl.where(offs_m[None, :] == 2, _gemv_column(acc2_2, sq_2, K, eps, NORM), acc)
            acc_up = tl.where(offs_m[None, :] == 2, _gemv_column(up2_2, sq_2, K, eps, NORM), acc_up)
        if ROWS > 3:
            acc = tl.where(offs_m[None, :] == 3, _gemv_column(acc2_3, sq_3, K, eps, NORM), acc)
            acc_up = tl.where(offs_m[None, :] == 3, _gemv_column(up2_3, sq_3, K, eps, NORM), acc_up)
    else:
        x_ptrs = X + rows_m[None, :] * stride_xm + (k_start + offs_k)[:, None]  # x^T tile [BLOCK_K, BLOCK_M]
        x1_ptrs = X + k_start + offs_k  # ONE_ROW: row 0 as [BLOCK_K]
        # The padding rows (M to BLOCK_M) load nothing: zeros. (Re-reading a real row there would put up to
        # BLOCK_M - M requests a step on the same L2 lines from every program at once.)
        x_rows = (offs_m < M)[None, :]
        ONE_DOT: tl.constexpr = PAIRED and PAIR_DOT
        TWO_DOTS: tl.constexpr = PAIRED and not PAIR_DOT
        if ONE_DOT:  # the tile's rows: rows_n, then rows_b (as above, for 2 * BLOCK_N gathered rows)
            second = tl.arange(0, 2 * BLOCK_N) >= BLOCK_N
            offs_2 = pid_n * BLOCK_N + tl.arange(0, 2 * BLOCK_N) % BLOCK_N
            if ROPE:
                rows_2 = tl.where(offs_2 < N, (offs_2 // HALF) * (2 * HALF) + offs_2 % HALF, 0)
                rows_2 += tl.where(second, HALF, 0)
            else:
                rows_2 = tl.where(offs_2 < N, offs_2, 0) + tl.where(second, N, 0)
            rows_2 = rows_2.to(tl.int64)
            w_ptrs = W + rows_2[:, None] * stride_wn + (k_start + offs_k)[None, :]
            if SCALE == 2:
                s_ptrs = S + (rows_2 // SCALE_BN) * stride_sn
            acc = tl.zeros([2 * BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        if TWO_DOTS:  # (not with X_FP8) the paired rows' tile and sums, as the GEMVs pair them
            up_ptrs = W + rows_b[:, None] * stride_wn + (k_start + offs_k)[None, :]
            acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            if SCALE == 2:
                s_up_ptrs = S + (rows_b // SCALE_BN) * stride_sn
        for k in range(k_start, k_end, BLOCK_K):  # (loads feeding tl.dot: pipelined with num_stages)
            if EVEN_K:
                w = tl.load(w_ptrs)
                if TWO_DOTS:
                    w_up = tl.load(up_ptrs)
                if ONE_ROW:
                    xt = tl.load(x1_ptrs)
                else:
                    xt = tl.load(x_ptrs, mask=x_rows, other=0.0)
            else:
                k_mask = (k + offs_k) < k_end
                w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0)
                if TWO_DOTS:
                    w_up = tl.load(up_ptrs, mask=k_mask[None, :], other=0.0)
                if ONE_ROW:
                    xt = tl.load(x1_ptrs, mask=k_mask, other=0.0)
                else:
                    xt = tl.load(x_ptrs, mask=k_mask[:, None] & x_rows, other=0.0)
            if F16_DOT and not X_FP8:  # FP8 weights: float8 -> fp16 is one packed conversion (-> bf16: another)
                w = w.to(tl.float16)
                if TWO_DOTS:
                    w_up = w_up.to(tl.float16)
                if xt.dtype != tl.float16:  # bf16 x, scaled by a power of two into fp16's range: exact there
                    xt = to_f16_scaled(xt, X_PRESCALE)
            if ONE_ROW:  # converted once, then the same column BLOCK_M times (padding columns: never stored)
                xt = tl.broadcast_to(xt[:, None], [BLOCK_K, BLOCK_M])
            if DOT_F32:  # the interpreter's bfloat16 tl.dot is wrong; float32 operands give the same products
                w = w.to(tl.float32)
                xt = xt.to(tl.float32)
                if TWO_DOTS:
                    w_up = w_up.to(tl.float32)
            if TWO_DOTS:
                if SCALE == 2:
                    acc_up += (tl.dot(w_up, xt, input_precision=DOT_PRECISION)
                               * tl.load(s_up_ptrs + k // SCALE_BK)[:, None])
                else:
                    acc_up = tl.dot(w_up, xt, acc_up, input_precision=DOT_PRECISION)
                up_ptrs += BLOCK_K
            if SCALE == 2:  # BLOCK_K divides SCALE_BK and steps are aligned: one scale column per step
                part = tl.dot(w, xt, input_precision=DOT_PRECISION) * tl.load(s_ptrs + k // SCALE_BK)[:, None]
                if X_FP8:  # x's scales per 1 x SCALE_BK group: the step's column of them
                    part = part * tl.load(XS + rows_m * tl.cdiv(K, SCALE_BK) + k // SCALE_BK)[None, :]
                acc += part  # (a fresh dot each step: its FP8 sums go into float32 every BLOCK_K)
            elif X_FP8:  # sm_90's FP8 MMA accumulates with fewer mantissa bits than float32 (Triton's default
                # leaves all of K to it: over 4096-14336 the sums drift past a bf16 ulp); each step's BLOCK_K
                # products go into the float32 acc instead (DeepSeek-V3's FP8 GEMMs promote every 128)
                acc = tl.dot(w, xt, acc, input_precision=DOT_PRECISION, max_num_imprecise_acc=BLOCK_K)
            else:
                acc = tl.dot(w, xt, acc, input_precision=DOT_PRECISION)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
            x1_ptrs += BLOCK_K
        if ONE_DOT:  # [2 * BLOCK_N, BLOCK_M] -> the rows_n sums and the rows_b sums
            acc, acc_up = tl.split(tl.permute(tl.reshape(acc, [2, BLOCK_N, BLOCK_M]), (1, 2, 0)))
        if F16_DOT and X_PRESCALE != 1.0:
            acc = acc * (1.0 / X_PRESCALE)  # a power of two: exact
            if PAIRED:
                acc_up = acc_up * (1.0 / X_PRESCALE)
        if X_FP8 and SCALE != 2:
            acc = acc * tl.load(XS + rows_m)[None, :]
    if PRENORMED and not (GEMV and ROWS == 1):  # each row (column of acc) by its 1 / rms
        rstd = (1.0 / tl.sqrt(tl.sum(p_sums, axis=1) / K + eps))[None, :]
        acc = acc * rstd
        if PAIRED:
            acc_up = acc_up * rstd
    if SCALE == 1:
        acc = acc * scale_n
        if PAIRED:
            acc_up = acc_up * scale_b
    out_mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    y_ptrs = offs_m[None, :] * stride_ym + offs_n[:, None]
    if PARTIAL:
        tl.store(Y + pid_k * stride_yk + y_ptrs, acc, mask=out_mask)
        if REDUCE:
            tl.debug_barrier()  # every thread's partial stored before the one thread's atomic releases them
            # acq_rel at gpu scope (the default): the last arrival sees every other split's partial. In Triton's
            # CPU interpreter the programs run one after another, so there the last split always adds them;
            # on a GPU any split may (tests/kernels/test_small_m_gemm_kernel.py, compiled there, checks the bits).
            if tl.atomic_add(CNT + pid_n, 1) == SPLITS - 1:
                total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
                # Unrolled: every split's loads in flight at once, then added in order. .cg: from L2, past this
                # SM's L1, which the other programs' stores did not update.
                for s in tl.static_range(SPLITS):
                    total += tl.load(Y + s * stride_yk + y_ptrs, mask=out_mask, other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    total += tl.load(BIAS + rows_n).to(tl.float32)[:, None]
                tl.store(YF + y_ptrs, total.to(YF.dtype.element_ty), mask=out_mask)
                tl.store(CNT + pid_n, 0)  # every split has arrived: zero for the next call (or graph replay)
    elif ROPE:
        if HAS_BIAS:
            acc += tl.load(BIAS + rows_n).to(tl.float32)[:, None]
            acc_up += tl.load(BIAS + rows_b).to(tl.float32)[:, None]
        _rope_store(acc, acc_up, offs_n, rows_n, rows_b, offs_m, N, M, Y, stride_ym, rope_slot, rope_cos,
                    rope_sin, KB, VB, stride_kb_slot, stride_kb_head, stride_vb_slot, stride_vb_head, num_q_heads,
                    num_kv_heads, k_scale, v_scale, HALF)
    else:
        if HAS_BIAS:
            acc += tl.load(BIAS + rows_n).to(tl.float32)[:, None]
        if SILU_MUL:  # gate and up rounded to y's dtype, then SiLU rounded, then the product (SiluAndMul's steps)
            gate = acc.to(Y.dtype.element_ty).to(tl.float32)
            silu = (gate / (1.0 + tl.exp(-gate))).to(Y.dtype.element_ty).to(tl.float32)
            acc = silu * acc_up.to(Y.dtype.element_ty).to(tl.float32)
        if ADD_NORM:  # (H has Y's layout: contiguous [M, N])
            if LATE_ADD_NORM:
                r_n, g_n = _add_norm_operands(R, G, rows_m, rows_n, N)
            h = (acc.to(Y.dtype.element_ty).to(tl.float32) + r_n).to(Y.dtype.element_ty)
            tl.store(H + y_ptrs, h, mask=out_mask)
            hf = h.to(tl.float32)
            tl.store(P + offs_m * tl.num_programs(0) + pid_n, tl.sum(tl.where(out_mask, hf * hf, 0.0), axis=0),
                     mask=offs_m < M)
            acc = hf * g_n
        tl.store(Y + y_ptrs, acc.to(Y.dtype.element_ty), mask=out_mask)


@triton.jit
def _split_k_reduce_kernel(WS, BIAS, Y, N, splits, stride_wsk, stride_wsm, stride_ym,
                           HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """y[m, n] = the sum over s = 0, 1, .., splits - 1 (in that order) of ws[s, m, n] (+ bias), in y's
    dtype."""
    m = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    ptrs = WS + m * stride_wsm + offs
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(splits):
        acc += tl.load(ptrs + s * stride_wsk, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(BIAS + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + m * stride_ym + offs, acc.to(Y.dtype.element_ty), mask=mask)
