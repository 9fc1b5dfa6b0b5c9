"""Split-KV (flash-decoding) attention for decode batches over the token-level KV pool (page size 1).

One query token per request. Keys and values (the new token's included: it is written into the pool
before attention runs) are gathered from `k_buffer` / `v_buffer` through `req_to_token`.

Stage 1 (grid `(bs, num_kv_heads * head_blocks, num_kv_splits)`): one program takes every query head of a
KV head (GQA-grouped, up to BLOCK_H query heads per program) and one chunk of the positions; it writes the
chunk's normalised partial output and its log-sum-exp into the workspace. A program's warps either share
each step's positions (a running max and sum exchanged through shared memory every step: 9 barriers a step at
Llama-3.1-8B heads in the sm_90 SASS) or, with warp splits (stage1_tile: large batches), each walk their own
sub-split of the chunk and merge once at the end. Stage 2 (grid `(bs, num_kv_heads * head_blocks)`, stage 1's
without the splits) merges the chunks. With num_kv_splits == 1 there is one stage:
each program walks all its request's positions and writes the output itself (no workspace, no second
launch).

The merge (_merge_block) loads every chunk of a head block's query heads at once, a [heads,
next_pow2(num_kv_splits), head_dim] tile and its log-sum-exps (the splits that hold no partial of the request
masked out), and weights each head's chunks by exp2(lse - its max lse): one round trip to memory, not one per
chunk as a walk over them would take.

Fused combine (at one request, see fused_combine_default): stage 1 merges the chunks itself and there is
no stage-2 launch. Each program of a (request, kv-head block) that owns a chunk, once its partial is stored,
increments that pair's int32 counter; the one that brings it to the request's chunk count merges the pair's
heads as a stage-2 program would (the same helper at the same num_warps), then puts the counter back to 0,
so the next call (or graph replay) finds it zeroed with no memset.

After the qkv kernel (after_qkv, at one or two requests: preload_after_qkv): stage 1 is launched with PDL
(triton_ops/pdl.py) and loads its first step's K/V, but the newest position's, before it waits for that
kernel; after the wait it reads q and the newest position's K/V and takes that step as the loop would.

A sliding window W (a layer's, decode_attention_fwd's sliding_window) keeps a request to its last W positions:
the chunks below cover seq_len - W .. seq_len - 1 as they would a request of W tokens (the window is a runtime
argument, one compiled kernel for windowed and global layers; NO_WINDOW stands for none).

Chunking, from `seq_lens` read on the device: a request of length L uses n = min(cdiv(L, min_chunk),
num_kv_splits) chunks of `round_up(cdiv(L, n), BLOCK_N)` positions, so a short request uses few splits
and their programs do real work; the programs of splits past a request's last chunk only exit, and stage 2
merges only the chunks that were written. The grid, the workspace and every launch argument depend on the
batch size and num_kv_splits alone: the call is CUDA-graph capturable, and a graph replays correctly for
any lengths (`decode_split_plan` picks num_kv_splits from the batch size and, on the host, the longest
request).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from model_executor.layers.triton_ops.kernels import to_f16_scaled
from model_executor.layers.triton_ops.pdl import pdl_supported

# Stage-1 tile: query heads per program (tl.dot needs M >= 16); the KV positions per loop step, warps, pipeline
# stages and warp splits come from stage1_tile (stage 2 takes the same warps, see decode_attention_fwd).
BLOCK_H = 16


# A band (lo, hi] of a bf16 pool's stage-1 programs along requests and kv heads (one program a request and kv
# head there: the split plan stops splitting from 528). Above lo stage 1 takes warp splits; in the band
# 64-wide heads take (32, 1, 3) warp-split tiles, above it (16, 1, 3): measured fastest there on the H200
# (docs/benchmarks.md, "Kernel choices").
NARROW_TILE_PROGRAMS = (800, 1024)


def on_capture_schedule(n: int) -> int:
    """n rounded down to a size of the default capture schedule (runners/capture_lists.py: steps of 8 up to
    256, of 16 up to 512, of 32 beyond), so that a batch run eagerly and the graph it pads to fall on the same
    side of a threshold."""
    step = 8 if n <= 256 else 16 if n <= 512 else 32
    return n // step * step


def narrow_tile_batches(num_kv_heads: int) -> tuple[int, int]:
    """(lo, hi): NARROW_TILE_PROGRAMS in requests, on the capture schedule."""
    lo, hi = NARROW_TILE_PROGRAMS
    return on_capture_schedule(lo // num_kv_heads), on_capture_schedule(hi // num_kv_heads)


class Stage1Tile(NamedTuple):
    """Stage 1's tile: BLOCK_N positions a step, num_warps, num_stages, and how the warps share the work. With
    warp_splits, each warp walks its own sub-split of the program's positions (BLOCK_N a step per warp) and
    the warps merge once at the end; without, the warps share each step's BLOCK_N positions (a running max and
    sum exchanged through shared memory every step)."""

    block_n: int
    num_warps: int
    num_stages: int
    warp_splits: bool = False


def _on_or_below(batch_size: int, programs: int, num_kv_heads: int) -> bool:
    """Whether a batch has at most `programs` stage-1 programs a split, rounded down to a size of the default
    capture schedule (so that a batch and the graph it pads to fall on the same side)."""
    return batch_size <= on_capture_schedule(programs // num_kv_heads)


def stage1_tile(batch_size: int, head_dim: int, num_kv_heads: int, kv_f16: bool = False) -> Stage1Tile:
    """Stage 1's tile for a batch of this size (num_kv_heads: the pool's, per rank): a function of what a
    graph is captured for (never of the lengths, which change between replays). Each rule takes the tile that
    the sweeps of benchmarks/kernels/bench_attention.py measure fastest on the H200 (docs/benchmarks.md,
    "Kernel choices"); "programs" are requests x kv heads, the stage-1 programs a split (the requests at
    Llama's 8 kv heads in brackets).

    Warp splits, where they are faster than shared steps:
    - an FP8 pool, 128-wide heads, above 64 programs (from 9 requests): (32, 1, 3) up to 256 programs,
      (16, 2, 3) up to 512, (16, 1, 3) beyond; fewer requests keep the shared steps (warp splits are slower
      there);
    - bf16 pools from the band NARROW_TILE_PROGRAMS up (more than 800 programs, from 97 requests): 128-wide
      heads (32, 1, 3); 64-wide heads (32, 1, 3) in the band and (16, 1, 3) above it.
      Smaller batches keep the shared steps (warp splits are mixed there). Other kv-head counts follow by the
      program count;
    - an FP8 pool of 64-wide heads keeps the shared steps (warp splits are slower at few requests and no
      better above).
    Shared steps otherwise: up to 4 requests (64, 8, 2) for 128-wide heads and (64, 4, 2) for 64-wide; from 5,
    (64, 4, 3); an FP8 pool (fp16 dots) from 2 to 24 requests (64, 4, 2) (one request keeps the bf16 pool's
    tile).

    The thresholds sit on sizes of the default capture list, so a batch run eagerly takes the tile of the
    graph it would be padded to."""
    lo, hi = narrow_tile_batches(num_kv_heads)
    if kv_f16 and head_dim >= 128 and not _on_or_below(batch_size, 64, num_kv_heads):  # (from 9 requests)
        if _on_or_below(batch_size, 256, num_kv_heads):  # (up to 32 requests)
            return Stage1Tile(32, 1, 3, True)
        if _on_or_below(batch_size, 512, num_kv_heads):  # (33-64)
            return Stage1Tile(16, 2, 3, True)
        return Stage1Tile(16, 1, 3, True)
    if kv_f16 and batch_size > 1:
        return Stage1Tile(64, 4, 2) if batch_size <= 24 else Stage1Tile(64, 4, 3)
    if batch_size > max(lo, 1):  # a bf16 pool from the narrow band up (from 97 requests)
        return Stage1Tile(32, 1, 3, True) if head_dim >= 128 or batch_size <= hi else Stage1Tile(16, 1, 3, True)
    if batch_size <= 4:
        return Stage1Tile(64, 8, 2) if head_dim >= 128 else Stage1Tile(64, 4, 2)
    return Stage1Tile(64, 4, 3)


# The split plan (decode_split_plan). Tunables, measured on the H200 with benchmarks/kernels/bench_attention.py (it
# also sweeps the stage-1 tile above): the fewest positions a split is given; the most splits a request may use (the workspace
# size); the stage-1 programs per SM at which splitting stops paying (the GPU is full without it); the
# longest request that still takes the single-stage kernel at a batch size where splits would be used.
MIN_CHUNK = 64
MAX_KV_SPLITS = 16
PROGRAMS_PER_SM = 4
SINGLE_STAGE_MAX_LEN = 128
# An FP8 pool's stage 1 (fp16 dots, half the bytes a position) keeps gaining from splits up to twice the programs
# per SM ...
PROGRAMS_PER_SM_FP16_DOTS = 8
# ... but not from two: where that cap is 2, one split is faster (docs/benchmarks.md, "Kernel choices"),
# likely because two splits put more programs on each SM than fit at once, so a second, mostly empty wave
# follows. bf16 pools keep two, which is faster than one for them.
MIN_SPLITS_FP16_DOTS = 3

_LOG2E = 1.4426950408889634
# The window a layer without one passes: longer than any context, so its first position is always 0.
NO_WINDOW = 1 << 30
# Triton's CPU interpreter (chosen by the environment before triton is first imported) cannot run the inline PTX
# of _e4m3_words_to_f16; read once, not per call.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# An FP8 pool's dots run in fp16 (e4m3 -> fp16 is one packed conversion per two values; -> bf16 needs a second
# instruction per value, and at long contexts those conversions, not the pool's bytes, bound stage 1). bf16 q
# goes to fp16 times this power of two (exact for |q| from ~2^-10 to ~1e6; qk_scale takes it back out), the
# probabilities p in [0, 1] as they are (fp16 keeps more of them than bf16 does).
Q_PRESCALE = 2.0**-4


def kv_dots_in_fp16(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    """Whether stage 1 runs its dots in fp16: an FP8 pool under bf16 / fp16 queries (float32 queries keep
    float32 dots)."""
    return kv_dtype == torch.float8_e4m3fn and q_dtype in (torch.bfloat16, torch.float16)


def programs_per_sm(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> int:
    """decode_split_cap's programs per SM for a pool of kv_dtype read by q_dtype queries."""
    return PROGRAMS_PER_SM_FP16_DOTS if kv_dots_in_fp16(q_dtype, kv_dtype) else PROGRAMS_PER_SM


def min_splits(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> int:
    """decode_split_cap's fewest splits worth a split (a cap below it is 1) for a pool of kv_dtype read by
    q_dtype queries."""
    return MIN_SPLITS_FP16_DOTS if kv_dots_in_fp16(q_dtype, kv_dtype) else 2


def get_num_kv_splits(max_context_len: int, min_chunk: int = MIN_CHUNK, max_splits: int = MAX_KV_SPLITS) -> int:
    """The most splits a request reaching `max_context_len` tokens can use: the workspace's split count.

    cdiv(max_context_len, min_chunk) clamped to [1, max_splits].
    """
    return max(1, min(triton.cdiv(max_context_len, min_chunk), max_splits))


def stage1_programs_per_split(batch_size: int, num_heads: int, num_kv_heads: int) -> int:
    return batch_size * num_kv_heads * triton.cdiv(num_heads // num_kv_heads, BLOCK_H)


def decode_split_cap(batch_size: int, num_heads: int, num_kv_heads: int, num_sms: int, max_splits: int,
                     programs_per_sm: int = PROGRAMS_PER_SM, min_splits: int = 2) -> int:
    """The split count (grid size) for a batch of this size: splits until the stage-1 grid fills the GPU
    (programs_per_sm programs per SM), at most max_splits; 1 (one stage) where that is below min_splits."""
    per_split = stage1_programs_per_split(batch_size, num_heads, num_kv_heads)
    cap = min(max_splits, programs_per_sm * num_sms // per_split)
    return cap if cap >= min_splits else 1


def decode_split_plan(cap: int, max_seq_len: int, single_stage_max_len: int = SINGLE_STAGE_MAX_LEN) -> int:
    """num_kv_splits for a batch whose decode_split_cap is `cap` and whose longest request has
    max_seq_len tokens: 1 (one stage) when the batch is short, else cap."""
    return 1 if max_seq_len <= single_stage_max_len else cap


# The largest batch for which fused_combine_default merges in stage 1.
FUSED_COMBINE_MAX_BS = 1


def fused_combine_default(batch_size: int) -> bool:
    """Whether stage 1 merges the chunks itself (no stage-2 launch) for a batch of this size: a function of
    what a graph is captured for, never of the lengths. Both paths give the same bits.

    Fused at one request only: it saves a fraction of a microsecond a call there, is mixed at a few requests
    and slower at many (the last program of each block merges alone while the rest of the GPU idles).
    Measured by benchmarks/kernels/bench_attention.py --combine on the H200 (docs/benchmarks.md, "Kernel
    choices")."""
    return batch_size <= FUSED_COMBINE_MAX_BS


# The smallest batch for which v_words_default reads an FP8 pool's V as 32-bit words.
V_WORDS_MIN_BS = 2


def v_words_default(batch_size: int, tile: Stage1Tile) -> bool:
    """Whether stage 1 over an FP8 pool (fp16 dots) loads V as 32-bit words converted in that layout
    (_load_e4m3_rows_as_f16) rather than as fp8 bytes, for a batch of this size and stage 1's tile: a function
    of what a graph is captured for. Same values either way.

    With warp splits, always: their loops take fewer instructions with words (sm_90 SASS), and their tiles
    are chosen with words. With shared steps, from two requests and only with tiles of 64 positions or more:
    words are faster there, as fast or slower at one request, and slower with narrower tiles (a tile passed by
    the caller may be narrower). Measured by benchmarks/kernels/bench_attention.py --decode-only --kv-dtype
    fp8_e4m3 on the H200 (docs/benchmarks.md)."""
    return tile.warp_splits or (batch_size >= V_WORDS_MIN_BS and tile.block_n >= 64)


# The largest batch whose stage 1 preload_after_qkv lets start during the qkv kernel (PDL).
PRELOAD_AFTER_QKV_MAX_BS = 2


def preload_after_qkv(batch_size: int, tile: Stage1Tile, v_words: bool) -> bool:
    """Whether stage 1 after the qkv projection's kernel (decode_attention_fwd's after_qkv) loads its first step
    before it waits for that kernel: a function of what a graph is captured for. Shared steps with V as plain
    loads only (the tiles of one to four requests, but V as words over an FP8 pool from two). On at one and
    two requests, where it is faster (docs/benchmarks.md, "Kernel choices"); at three and four it makes no
    difference."""
    return batch_size <= PRELOAD_AFTER_QKV_MAX_BS and not tile.warp_splits and not v_words


class DecodeWorkspace(NamedTuple):
    """What `decode_attention_fwd` needs besides its inputs, allocated once (a graph bakes the addresses in).

    attn_logits, attn_lse: float32 partial outputs and log-sum-exps of the chunks, contents never need
    initialising. counters: int32 [max_bs, num_heads], zeros, the fused combine's arrival counters, one per
    (request, stage-1 program along the heads); a kv head's query heads come in blocks of up to BLOCK_H, so
    there are at most num_heads such programs. Every call leaves them at zero again.
    """

    attn_logits: torch.Tensor
    attn_lse: torch.Tensor
    counters: torch.Tensor


def alloc_decode_workspace(max_bs: int, num_heads: int, head_dim: int, num_kv_splits: int,
                           device: torch.device | str) -> DecodeWorkspace:
    """The workspace for `decode_attention_fwd`, sized for `max_bs` rows."""
    attn_logits = torch.empty((max_bs, num_heads, num_kv_splits, head_dim), dtype=torch.float32, device=device)
    attn_lse = torch.empty((max_bs, num_heads, num_kv_splits), dtype=torch.float32, device=device)
    counters = torch.zeros((max_bs, num_heads), dtype=torch.int32, device=device)
    return DecodeWorkspace(attn_logits, attn_lse, counters)


@triton.jit
def _window_start(seq_len, window):
    """The first position a sliding window of `window` positions keeps of a request of seq_len tokens."""
    return tl.maximum(seq_len - window, 0)


@triton.jit
def _split_bounds(seq_len, split_id, num_kv_splits, min_chunk, SPLIT_ALIGN: tl.constexpr):
    """Positions [start, end) of chunk split_id of a request of seq_len tokens (empty past its last chunk)."""
    num_chunks = tl.minimum(tl.cdiv(seq_len, min_chunk), num_kv_splits)
    per_split = tl.cdiv(tl.cdiv(seq_len, tl.maximum(num_chunks, 1)), SPLIT_ALIGN) * SPLIT_ALIGN
    start = per_split * split_id
    end = tl.minimum(start + per_split, seq_len)
    return start, end, num_chunks


@triton.jit
def _written_splits(seq_len, num_kv_splits, min_chunk, SPLITS_P2: tl.constexpr, SPLIT_ALIGN: tl.constexpr):
    """[SPLITS_P2] split ids and which of them hold a partial of the request: the chunks with positions.
    That leaves out the splits past its last chunk (they start at or past seq_len: the workspace there is
    stale) and a last chunk emptied by the rounding to SPLIT_ALIGN (its program wrote nothing)."""
    splits = tl.arange(0, SPLITS_P2)
    start, end, _ = _split_bounds(seq_len, splits, num_kv_splits, min_chunk, SPLIT_ALIGN)
    return splits, end > start


@triton.jit
def _merge_block(Att_Out, Att_Lse, O, cur_batch, kv_head, head_block, seq_len, num_kv_splits, min_chunk,
                 stride_mid_ob, stride_mid_oh, stride_mid_os, stride_lse_b, stride_lse_h, stride_ob, stride_oh,
                 offs_d, mask_d, KV_GROUP_NUM: tl.constexpr, BLOCK_H: tl.constexpr, MERGE_HEADS: tl.constexpr,
                 SPLITS_P2: tl.constexpr, SPLIT_ALIGN: tl.constexpr, CACHE: tl.constexpr, Sinks,
                 HAS_SINKS: tl.constexpr):
    """Merges the chunks of the query heads of one (request, kv head, head block) and stores their output:
    every head's chunks in one [MERGE_HEADS, SPLITS_P2, BLOCK_D] tile (one round trip to memory), each chunk
    weighted by exp2(lse - the head's max lse). Stage 2 and the fused combine both call it with the same
    num_warps (a reduction's order follows the tile's layout, which follows num_warps). HAS_SINKS: each head's
    sink logit (Sinks[head], natural-log units) joins its softmax denominator."""
    offs_g = head_block * BLOCK_H + tl.arange(0, MERGE_HEADS)
    mask_h = offs_g < KV_GROUP_NUM
    heads = kv_head * KV_GROUP_NUM + offs_g
    splits, written = _written_splits(seq_len, num_kv_splits, min_chunk, SPLITS_P2, SPLIT_ALIGN)
    mask_hs = mask_h[:, None] & written[None, :]
    part = tl.load(Att_Out + cur_batch * stride_mid_ob + heads[:, None, None] * stride_mid_oh
                   + splits[None, :, None] * stride_mid_os + offs_d[None, None, :],
                   mask=mask_hs[:, :, None] & mask_d[None, None, :], other=0.0, cache_modifier=CACHE)
    lse = tl.load(Att_Lse + cur_batch * stride_lse_b + heads[:, None] * stride_lse_h + splits[None, :],
                  mask=mask_hs, other=float("-inf"), cache_modifier=CACHE)
    e_max = tl.max(lse, 1)
    # No chunk at all (seq_len 0, never produced by the engine; or a head past the group): every weight
    # exp2(-inf) = 0 and the output zeros, rather than exp2(-inf - -inf) = NaN.
    e_max = tl.where(e_max == float("-inf"), 0.0, e_max)
    w = tl.exp2(lse - e_max[:, None])
    denom = tl.sum(w, 1)
    if HAS_SINKS:
        denom += tl.exp2(tl.load(Sinks + heads, mask=mask_h, other=0.0).to(tl.float32) * 1.4426950408889634 - e_max)
    out = tl.sum(w[:, :, None] * part, 1) / tl.maximum(denom, 1e-30)[:, None]
    tl.store(O + cur_batch.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=mask_h[:, None] & mask_d[None, :])


@triton.jit
def _e4m3_words_to_f16(words, INTERPRET: tl.constexpr):
    """int32 words [..., W] of four e4m3 values each (the lowest byte first) -> fp16 [..., W, 2, 2], the four
    values of a word in byte order along the two new minor axes (a reshape to [..., 4 W] gives the row): two
    packed conversions a word on a GPU (inline PTX, opaque to the compiler's layout choices); the same values
    by byte arithmetic in Triton's interpreter, which cannot run PTX."""
    if INTERPRET:
        a = (words & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        b = ((words >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        c = ((words >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        d = ((words >> 24) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    else:
        # cvt.rn.f16x2.e4m3x2 puts the lower byte's value in the lower half
        a, b, c, d = tl.inline_asm_elementwise(
            asm="{ .reg .b16 lo, hi; .reg .b32 x, y; mov.b32 {lo, hi}, $4; cvt.rn.f16x2.e4m3x2 x, lo; "
                "cvt.rn.f16x2.e4m3x2 y, hi; mov.b32 {$0, $1}, x; mov.b32 {$2, $3}, y; }",
            constraints="=h,=h,=h,=h,r", args=[words], dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True, pack=1)
    return tl.join(tl.join(a, c), tl.join(b, d))  # (join adds the minor axis: [..., i, j] is byte 2 i + j)


@triton.jit
def _load_e4m3_rows_as_f16(Buf, slots, head_off, stride_slot, mask_n, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                           INTERPRET: tl.constexpr):
    """An FP8 pool's rows [BLOCK_N, BLOCK_D] (slot `slots`, head offset `head_off` elements) as fp16, loaded
    as 32-bit words and converted in that layout. For V, the operand tl.dot reduces over its rows: loaded as
    fp8 it is read back from shared memory one byte per instruction (no 8-bit transposing ldmatrix on sm_90);
    in fp16 the transpose runs through shared memory as 16-bit ldmatrix, and the loop has ~30% fewer
    instructions (628 -> 439 a step at Llama-3.1-8B heads and 128 requests, 146 -> 96 registers: the sm_90
    SASS, not a measurement)."""
    offs_w = tl.arange(0, BLOCK_D // 4)
    words = tl.load(Buf.to(tl.pointer_type(tl.int32)) + slots[:, None] * (stride_slot // 4) + head_off // 4
                    + offs_w[None, :], mask=mask_n[:, None], other=0)
    return tl.reshape(_e4m3_words_to_f16(words, INTERPRET), (BLOCK_N, BLOCK_D))


@triton.jit
def _load_e4m3_warp_rows_as_f16(Buf, slots, head_off, stride_slot, mask_n, WARPS: tl.constexpr, BLOCK_N: tl.constexpr,
                                BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr):
    """_load_e4m3_rows_as_f16 for slots [WARPS, BLOCK_N]: rows [WARPS, BLOCK_N, BLOCK_D] as fp16."""
    offs_w = tl.arange(0, BLOCK_D // 4)
    words = tl.load(Buf.to(tl.pointer_type(tl.int32)) + slots[:, :, None] * (stride_slot // 4) + head_off // 4
                    + offs_w[None, None, :], mask=mask_n[:, :, None], other=0)
    return tl.reshape(_e4m3_words_to_f16(words, INTERPRET), (WARPS, BLOCK_N, BLOCK_D))


@triton.jit
def _step_scores(q, k, mask_n, e_max, qk_scale, IN_PRECISION: tl.constexpr):
    """A shared step's (p, re_scale, new e_max) for q [BLOCK_H, BLOCK_D] and k [BLOCK_D, BLOCK_N] (positions
    outside mask_n masked out)."""
    # (an FP8 pool is cast up here; its K scale is folded into qk_scale, its V scale applied at the end)
    qk = tl.dot(q, k.to(q.dtype), input_precision=IN_PRECISION) * qk_scale  # log2 domain
    qk = tl.where(mask_n[None, :], qk, float("-inf"))
    n_e_max = tl.maximum(tl.max(qk, 1), e_max)
    re_scale = tl.exp2(e_max - n_e_max)
    p = tl.exp2(qk - n_e_max[:, None])
    return p, re_scale, n_e_max


@triton.jit
def _step_accumulate(acc, e_sum, p, v, re_scale, q_dtype: tl.constexpr, IN_PRECISION: tl.constexpr):
    """A shared step's (acc, e_sum) after its weights p [BLOCK_H, BLOCK_N] and v [BLOCK_N, BLOCK_D]."""
    acc = acc * re_scale[:, None] + tl.dot(p.to(q_dtype), v.to(q_dtype), input_precision=IN_PRECISION)
    return acc, e_sum * re_scale + tl.sum(p, 1)


@triton.jit
def _attend_in_warp_splits(q, K_Buffer, V_Buffer, Req_to_token, req_row, stride_req_b, kv_head, stride_kbs, stride_kh,
                           stride_vbs, stride_vh, split_start, split_end, qk_scale, offs_d, mask_d,
                           BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, WARPS: tl.constexpr,
                           IN_PRECISION: tl.constexpr, V_WORDS: tl.constexpr, INTERPRET: tl.constexpr):
    """(acc, e_sum, e_max) of q [BLOCK_H, BLOCK_D] over positions [split_start, split_end), each warp with its
    own sub-split: a step takes BLOCK_N positions per warp (warp w the w-th BLOCK_N of the step), one batched
    dot over the warps ([WARPS, BLOCK_H, BLOCK_D] x [WARPS, BLOCK_D, BLOCK_N]: Triton puts the warps along the
    batch axis), so no step exchanges a running max or sum between warps; the warps' partials are merged
    once at the end. Expects num_warps == WARPS."""
    q = tl.broadcast_to(q[None, :, :], (WARPS, BLOCK_H, BLOCK_D))
    offs_w = tl.arange(0, WARPS)
    e_max = tl.full([WARPS, BLOCK_H], float("-inf"), dtype=tl.float32)
    e_sum = tl.zeros([WARPS, BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([WARPS, BLOCK_H, BLOCK_D], dtype=tl.float32)
    for start_n in range(split_start, split_end, WARPS * BLOCK_N):
        offs_n = start_n + offs_w[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]  # [WARPS, BLOCK_N]
        mask_n = offs_n < split_end
        slots = tl.load(Req_to_token + req_row * stride_req_b + offs_n, mask=mask_n, other=0).to(tl.int64)
        # K gathered transposed: [WARPS, BLOCK_D, BLOCK_N]
        k = tl.load(K_Buffer + slots[:, None, :] * stride_kbs + kv_head * stride_kh + offs_d[None, :, None],
                    mask=mask_n[:, None, :] & mask_d[None, :, None], other=0.0)
        qk = tl.dot(q, k.to(q.dtype), input_precision=IN_PRECISION) * qk_scale  # log2 domain
        qk = tl.where(mask_n[:, None, :], qk, float("-inf"))
        n_e_max = tl.maximum(tl.max(qk, 2), e_max)
        # (a warp whose positions so far are all masked keeps -inf: exp2(-inf - -inf) would be NaN)
        n_e_max_or_0 = tl.where(n_e_max == float("-inf"), 0.0, n_e_max)
        re_scale = tl.exp2(e_max - n_e_max_or_0)
        p = tl.exp2(qk - n_e_max_or_0[:, :, None])
        if V_WORDS:
            v = _load_e4m3_warp_rows_as_f16(V_Buffer, slots, kv_head * stride_vh, stride_vbs, mask_n, WARPS,
                                            BLOCK_N, BLOCK_D, INTERPRET)
        else:
            v = tl.load(V_Buffer + slots[:, :, None] * stride_vbs + kv_head * stride_vh + offs_d[None, None, :],
                        mask=mask_n[:, :, None] & mask_d[None, None, :], other=0.0)
        acc = acc * re_scale[:, :, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=IN_PRECISION)
        e_sum = e_sum * re_scale + tl.sum(p, 2)
        e_max = n_e_max
    # The warps' partials merged: weights exp2(e_max - max), 0 for a warp that saw no position.
    max_all = tl.max(e_max, 0)
    weights = tl.exp2(e_max - tl.where(max_all == float("-inf"), 0.0, max_all)[None, :])
    return tl.sum(acc * weights[:, :, None], 0), tl.sum(e_sum * weights, 0), max_all


@triton.jit
def _decode_stage1_kernel(
    Q, K_Buffer, V_Buffer, Req_to_token, Req_pool_indices, Seq_lens, Att_Out, Att_Lse, O, Counters, Sinks,
    qk_scale, v_scale, num_kv_splits, min_chunk, window,
    stride_qb, stride_qh,
    stride_kbs, stride_kh,
    stride_vbs, stride_vh,
    stride_req_b,
    stride_mid_ob, stride_mid_oh, stride_mid_os,
    stride_lse_b, stride_lse_h,
    stride_ob, stride_oh,
    stride_cnt_b,
    KV_GROUP_NUM: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WARP_SPLITS: tl.constexpr,
    WARPS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    MERGE_HEADS: tl.constexpr,
    SINGLE_STAGE: tl.constexpr,
    FUSED_COMBINE: tl.constexpr,
    IN_PRECISION: tl.constexpr,
    KV_F16: tl.constexpr,
    Q_PRESCALE: tl.constexpr,
    V_WORDS: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL_SIGNAL: tl.constexpr,
    PRELOAD: tl.constexpr,
    PDL_WAIT: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    if PDL_SIGNAL:  # a kernel launched with PDL after this one (o_proj) may start now (triton_ops/pdl.py)
        tl.extra.cuda.gdc_launch_dependents()
    cur_batch = tl.program_id(0)
    pid_h = tl.program_id(1)
    split_id = tl.program_id(2)
    kv_head = pid_h // HEAD_BLOCKS
    head_block = pid_h % HEAD_BLOCKS

    offs_g = head_block * BLOCK_H + tl.arange(0, BLOCK_H)  # index within the kv head's query group
    mask_h = offs_g < KV_GROUP_NUM
    heads = kv_head * KV_GROUP_NUM + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    if BLOCK_D == HEAD_DIM:  # all-true splat: keeps the loads vectorised
        mask_d = tl.full([BLOCK_D], 1, tl.int1)
    else:
        mask_d = offs_d < HEAD_DIM

    seq_len = tl.load(Seq_lens + cur_batch).to(tl.int32)
    req_row = tl.load(Req_pool_indices + cur_batch).to(tl.int64)
    kv_start = _window_start(seq_len, window)
    kept = seq_len - kv_start  # the positions the window keeps, chunked from kv_start
    if SINGLE_STAGE:  # every position; a request of no tokens still writes its output (zeros)
        split_start = kv_start
        split_end = seq_len
        has_work = split_end >= split_start
    else:
        split_start, split_end, num_chunks = _split_bounds(kept, split_id, num_kv_splits, min_chunk, BLOCK_N)
        has_work = split_end > split_start
        split_start += kv_start
        split_end += kv_start
    if PRELOAD:  # the first step's tile but the newest position: the qkv kernel before stores only that one
        offs_n0 = split_start + tl.arange(0, BLOCK_N)
        mask_n0 = offs_n0 < split_end
        slots0 = tl.load(Req_to_token + req_row * stride_req_b + offs_n0, mask=mask_n0, other=0).to(tl.int64)
        old = mask_n0 & (offs_n0 < seq_len - 1)
        k0 = tl.load(K_Buffer + slots0[None, :] * stride_kbs + kv_head * stride_kh + offs_d[:, None],
                     mask=old[None, :] & mask_d[:, None], other=0.0)
        v0 = tl.load(V_Buffer + slots0[:, None] * stride_vbs + kv_head * stride_vh + offs_d[None, :],
                     mask=old[:, None] & mask_d[None, :], other=0.0)
    if PDL_WAIT:  # q and the newest K/V come from the kernel before: wait for it (griddepcontrol.wait)
        tl.extra.cuda.gdc_wait()

    if has_work:
        q = tl.load(Q + cur_batch.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=mask_h[:, None] & mask_d[None, :], other=0.0)
        if KV_F16:  # an FP8 pool: every dot in fp16 (Q_PRESCALE); k, p and v follow q's dtype below
            q = to_f16_scaled(q, Q_PRESCALE)
        if WARP_SPLITS:
            acc, e_sum, e_max = _attend_in_warp_splits(
                q, K_Buffer, V_Buffer, Req_to_token, req_row, stride_req_b, kv_head, stride_kbs, stride_kh,
                stride_vbs, stride_vh, split_start, split_end, qk_scale, offs_d, mask_d, BLOCK_H, BLOCK_D, BLOCK_N,
                WARPS, IN_PRECISION, V_WORDS, INTERPRET)
        else:  # the warps share each step's positions (a 3-D dot of one batch entry would run on every warp)
            e_max = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
            e_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
            acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
            loop_start = split_start
            if PRELOAD:  # the first step, with the tile loaded before the wait and the newest position read now
                new = mask_n0 & (offs_n0 == seq_len - 1)
                k0 = tl.where(new[None, :], tl.load(K_Buffer + slots0[None, :] * stride_kbs + kv_head * stride_kh
                                                    + offs_d[:, None], mask=new[None, :] & mask_d[:, None],
                                                    other=0.0), k0)
                v0 = tl.where(new[:, None], tl.load(V_Buffer + slots0[:, None] * stride_vbs + kv_head * stride_vh
                                                    + offs_d[None, :], mask=new[:, None] & mask_d[None, :],
                                                    other=0.0), v0)
                p, re_scale, e_max_step = _step_scores(q, k0, mask_n0, e_max, qk_scale, IN_PRECISION)
                acc, e_sum = _step_accumulate(acc, e_sum, p, v0, re_scale, q.dtype, IN_PRECISION)
                e_max = e_max_step
                loop_start = split_start + BLOCK_N
            for start_n in range(loop_start, split_end, BLOCK_N):
                offs_n = start_n + tl.arange(0, BLOCK_N)
                mask_n = offs_n < split_end
                slots = tl.load(Req_to_token + req_row * stride_req_b + offs_n, mask=mask_n, other=0).to(tl.int64)
                # K gathered transposed: [BLOCK_D, BLOCK_N]
                k = tl.load(K_Buffer + slots[None, :] * stride_kbs + kv_head * stride_kh + offs_d[:, None],
                            mask=mask_n[None, :] & mask_d[:, None], other=0.0)
                p, re_scale, e_max_step = _step_scores(q, k, mask_n, e_max, qk_scale, IN_PRECISION)
                if V_WORDS:
                    v = _load_e4m3_rows_as_f16(V_Buffer, slots, kv_head * stride_vh, stride_vbs, mask_n, BLOCK_N,
                                               BLOCK_D, INTERPRET)
                else:
                    v = tl.load(V_Buffer + slots[:, None] * stride_vbs + kv_head * stride_vh + offs_d[None, :],
                                mask=mask_n[:, None] & mask_d[None, :], other=0.0)
                acc, e_sum = _step_accumulate(acc, e_sum, p, v, re_scale, q.dtype, IN_PRECISION)
                e_max = e_max_step

        mask_hd = mask_h[:, None] & mask_d[None, :]
        if SINGLE_STAGE:
            if HAS_SINKS:  # the head's sink logit joins the denominator (log2 domain, relative to the max)
                e_sum += tl.exp2(tl.load(Sinks + heads, mask=mask_h, other=0.0).to(tl.float32) * 1.4426950408889634
                                 - e_max)
            out = acc * (v_scale / tl.maximum(e_sum, 1e-30))[:, None]
            tl.store(O + cur_batch.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                     out.to(O.dtype.element_ty), mask=mask_hd)
        else:
            mid_o = (cur_batch * stride_mid_ob + heads[:, None] * stride_mid_oh + split_id * stride_mid_os
                     + offs_d[None, :])
            tl.store(Att_Out + mid_o, acc * (v_scale / e_sum)[:, None], mask=mask_hd)
            mid_lse = cur_batch * stride_lse_b + heads * stride_lse_h + split_id
            tl.store(Att_Lse + mid_lse, e_max + tl.log2(e_sum), mask=mask_h)

    if FUSED_COMBINE:
        # The programs that arrive are those of the request's chunks, the count the merge walks (a chunk
        # left empty by the alignment arrives too); those past its last chunk exit as before, untouched.
        # A request of no tokens has no chunk: its split 0 arrives alone and writes zeros, as stage 2 does.
        arrivals = tl.maximum(num_chunks, 1)
        if split_id < arrivals:
            counter = Counters + cur_batch * stride_cnt_b + pid_h
            # One thread does the atomic: every thread's stores above must precede its release.
            tl.debug_barrier()
            # acq_rel at gpu scope (the default): the last arrival sees every other program's partial.
            if tl.atomic_add(counter, 1) == arrivals - 1:
                # In Triton's CPU interpreter the programs run one after another, so there the highest
                # split always combines; tests/kernels/test_decode_combine_gpu.py covers any arrival order.
                # .cg: from L2, past this SM's L1, which other programs' stores did not update
                _merge_block(Att_Out, Att_Lse, O, cur_batch, kv_head, head_block, kept, num_kv_splits,
                             min_chunk, stride_mid_ob, stride_mid_oh, stride_mid_os, stride_lse_b, stride_lse_h,
                             stride_ob, stride_oh, offs_d, mask_d, KV_GROUP_NUM, BLOCK_H, MERGE_HEADS, SPLITS_P2,
                             BLOCK_N, ".cg", Sinks, HAS_SINKS)
                tl.store(counter, 0)  # every program of the pair has arrived: zero for the next call


@triton.jit
def _decode_stage2_kernel(
    Att_Out, Att_Lse, O, Seq_lens, Sinks,
    num_kv_splits, min_chunk, window,
    stride_mid_ob, stride_mid_oh, stride_mid_os,
    stride_lse_b, stride_lse_h,
    stride_ob, stride_oh,
    KV_GROUP_NUM: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    MERGE_HEADS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    SPLIT_ALIGN: tl.constexpr,
    PDL_SIGNAL: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """Program (request, kv head x head block), as stage 1's: merges that block's heads (_merge_block)."""
    if PDL_SIGNAL:
        tl.extra.cuda.gdc_launch_dependents()
    cur_batch = tl.program_id(0)
    pid_h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    if BLOCK_D == HEAD_DIM:  # all-true splat: keeps the loads vectorised
        mask_d = tl.full([BLOCK_D], 1, tl.int1)
    else:
        mask_d = offs_d < HEAD_DIM
    seq_len = tl.load(Seq_lens + cur_batch).to(tl.int32)
    kept = seq_len - _window_start(seq_len, window)
    _merge_block(Att_Out, Att_Lse, O, cur_batch, pid_h // HEAD_BLOCKS, pid_h % HEAD_BLOCKS, kept, num_kv_splits,
                 min_chunk, stride_mid_ob, stride_mid_oh, stride_mid_os, stride_lse_b, stride_lse_h,
                 stride_ob, stride_oh, offs_d, mask_d, KV_GROUP_NUM, BLOCK_H, MERGE_HEADS, SPLITS_P2,
                 SPLIT_ALIGN, "", Sinks, HAS_SINKS)


def decode_attention_fwd(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    attn_logits: torch.Tensor,
    attn_lse: torch.Tensor,
    num_kv_splits: int,
    sm_scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    min_chunk: int = MIN_CHUNK,
    tile: tuple[int, int, int] | None = None,
    counters: torch.Tensor | None = None,
    fused_combine: bool | None = None,
    v_words: bool | None = None,
    after_qkv: bool = False,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Decode attention; writes `o` in place.

    q, o: [bs, num_heads, head_dim] (last dim contiguous; other strides free).
    k_buffer, v_buffer: [num_slots + 1, num_kv_heads, head_dim] (last dim contiguous).
    req_to_token: int32 [num_rows, max_context_len]; req_pool_indices: [bs] row of each request;
    seq_lens: [bs] int32/int64 KV length of each request, the new token included (read on the device).
    attn_logits: float32 [>= bs, num_heads, >= num_kv_splits, head_dim]; attn_lse: float32
    [>= bs, num_heads, >= num_kv_splits] - workspace, contents need not be initialised (unused when
    num_kv_splits is 1).
    num_kv_splits: the most chunks a request is split into (the grid; see decode_split_plan); 1: one stage.
    min_chunk: a request of L tokens uses min(cdiv(L, min_chunk), num_kv_splits) chunks.
    sm_scale: softmax scale; k_scale, v_scale: the pool's dequantization scales (an FP8 pool holds
    K / k_scale, V / v_scale).
    tile: stage 1's Stage1Tile (or a tuple of its fields: (BLOCK_N, num_warps, num_stages[, warp_splits])); default
    stage1_tile(bs, head_dim, num_kv_heads, fp16 dots).
    counters: the workspace's int32 arrival counters (DecodeWorkspace.counters: zeros, left zeros); needed
    when the chunks are merged by stage 1.
    fused_combine: merge the chunks in stage 1 (True) or in a second launch (False, stage 2); default
    fused_combine_default(bs) when counters are given, else False. Same bits either way; unused
    when num_kv_splits is 1.
    v_words: over an FP8 pool with fp16 dots, load V as 32-bit words (True) or as bytes (False); default
    v_words_default(bs, tile). Same values either way; unused otherwise (and when the pool is not 4-byte aligned).
    after_qkv: the kernel just before wrote q and the batch's newest K/V (the qkv projection's kernel with the
    rotary and KV store) and nothing else this call reads. Where preload_after_qkv says so, stage 1 loads its
    first step's K/V but the newest position's before it reads q, and on sm_90+ is launched with PDL and waits
    for that kernel only then (triton_ops/pdl.py). Same bits either way.
    sliding_window: attend only to each request's last sliding_window positions (None: all of them).
    sinks: [num_heads] sink logits (gpt-oss): exp(sinks[h]) joins head h's softmax denominator, as a key with
    no value (None: none); applied where the output is normalised (the single stage or the merge).
    No host reads of device data, no allocations: safe to capture in a CUDA graph. On sm_90+ each kernel
    signals at its start that a kernel launched with PDL after it may start (triton_ops/pdl.py).
    """
    bs, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert k_buffer.shape[2] == head_dim and v_buffer.shape[2] == head_dim and o.shape == q.shape
    assert q.stride(-1) == 1 and o.stride(-1) == 1 and k_buffer.stride(-1) == 1 and v_buffer.stride(-1) == 1
    assert req_to_token.stride(-1) == 1
    assert num_kv_splits >= 1 and min_chunk >= 1
    assert sliding_window is None or 1 <= sliding_window < NO_WINDOW
    assert sinks is None or sinks.shape == (num_heads,)
    window = NO_WINDOW if sliding_window is None else sliding_window
    assert attn_logits.dtype == torch.float32 and attn_lse.dtype == torch.float32
    assert attn_logits.shape[0] >= bs and attn_logits.shape[1] == num_heads
    assert attn_logits.shape[2] >= num_kv_splits and attn_logits.shape[3] == head_dim
    assert attn_logits.stride(-1) == 1 and attn_lse.stride(-1) == 1
    assert attn_lse.shape[0] >= bs and attn_lse.shape[2] >= num_kv_splits
    if bs == 0:
        return

    group = num_heads // num_kv_heads
    head_blocks = triton.cdiv(group, BLOCK_H)
    block_d = triton.next_power_of_2(head_dim)
    splits_p2 = triton.next_power_of_2(num_kv_splits)  # the merge's tile: chunks ...
    merge_heads = triton.next_power_of_2(min(group, BLOCK_H))  # ... of a block's heads (all of a small group)
    in_precision = "tf32x3" if q.dtype == torch.float32 else "tf32"  # fp32: ~fp32 accuracy
    single_stage = num_kv_splits == 1
    kv_f16 = kv_dots_in_fp16(q.dtype, k_buffer.dtype)
    qk_scale = sm_scale * k_scale * _LOG2E / (Q_PRESCALE if kv_f16 else 1.0)
    tile = Stage1Tile(*tile) if tile else stage1_tile(bs, head_dim, num_kv_heads, kv_f16)
    block_n, num_warps, num_stages, warp_splits = tile
    if v_words is None:
        v_words = v_words_default(bs, tile)
    v_words = (v_words and kv_f16 and block_d == head_dim  # (V read as 32-bit words: _load_e4m3_rows_as_f16)
               and v_buffer.data_ptr() % 4 == 0 and v_buffer.stride(1) % 4 == 0 and v_buffer.stride(0) % 4 == 0)
    pdl_signal = pdl_supported(q.device)
    preload = after_qkv and preload_after_qkv(bs, tile, v_words)
    pdl_wait = preload and pdl_signal
    if fused_combine is None:  # (the default needs the counters: without them, two stages)
        fused_combine = counters is not None and fused_combine_default(bs)
    fused = fused_combine and not single_stage
    if fused:
        assert counters is not None, "the fused combine needs the workspace's counters (alloc_decode_workspace)"
        assert counters.dtype == torch.int32 and counters.dim() == 2 and counters.stride(-1) == 1
        assert counters.shape[0] >= bs and counters.shape[1] >= num_kv_heads * head_blocks

    _decode_stage1_kernel[(bs, num_kv_heads * head_blocks, num_kv_splits)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, attn_logits, attn_lse, o,
        counters if fused else attn_lse,  # (a placeholder pointer when there is no combine in stage 1)
        q if sinks is None else sinks,  # (a placeholder pointer without sinks)
        qk_scale, v_scale, num_kv_splits, min_chunk, window,
        q.stride(0), q.stride(1),
        k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0),
        attn_logits.stride(0), attn_logits.stride(1), attn_logits.stride(2),
        attn_lse.stride(0), attn_lse.stride(1),
        o.stride(0), o.stride(1),
        counters.stride(0) if fused else 0,
        KV_GROUP_NUM=group,
        HEAD_BLOCKS=head_blocks,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_H=BLOCK_H,
        BLOCK_N=block_n,
        WARP_SPLITS=warp_splits,
        WARPS=num_warps if warp_splits else 1,
        SPLITS_P2=splits_p2,
        MERGE_HEADS=merge_heads,
        SINGLE_STAGE=single_stage,
        FUSED_COMBINE=fused,
        IN_PRECISION=in_precision,
        KV_F16=kv_f16,
        Q_PRESCALE=Q_PRESCALE,
        V_WORDS=v_words,
        INTERPRET=_INTERPRET,
        PDL_SIGNAL=pdl_signal,
        PRELOAD=preload,
        PDL_WAIT=pdl_wait,
        HAS_SINKS=sinks is not None,
        num_warps=num_warps,
        num_stages=num_stages,
        **({"launch_pdl": True} if pdl_wait else {}),
    )
    if single_stage or fused:
        return
    _decode_stage2_kernel[(bs, num_kv_heads * head_blocks)](
        attn_logits, attn_lse, o, seq_lens, q if sinks is None else sinks,
        num_kv_splits, min_chunk, window,
        attn_logits.stride(0), attn_logits.stride(1), attn_logits.stride(2),
        attn_lse.stride(0), attn_lse.stride(1),
        o.stride(0), o.stride(1),
        KV_GROUP_NUM=group,
        HEAD_BLOCKS=head_blocks,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_H=BLOCK_H,
        MERGE_HEADS=merge_heads,
        SPLITS_P2=splits_p2,
        SPLIT_ALIGN=block_n,
        PDL_SIGNAL=pdl_signal,
        HAS_SINKS=sinks is not None,
        # Stage 1's warps: the fused combine merges the same tiles inside stage 1, and a reduction's order
        # follows the tile's layout, which follows num_warps.
        num_warps=num_warps,
    )
