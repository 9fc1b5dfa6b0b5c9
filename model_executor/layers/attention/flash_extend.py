"""Long extends without a cached prefix in torch's flash-attention kernel (FA2, variable-length batches).

The triton backend's extend kernel (triton_ops/extend_attention.py) attends over a prefix gathered from the
token-level pool; a batch with no cached prefix needs none of that, and torch's flash kernel is faster on long
prompts (docs/benchmarks.md, thirty-fourth session). Such a batch's K/V are stored in the pool first (one
store kernel), then the new tokens attend to each other, request by request, through `cu_seqlens`.

Only eager calls take it (a prompt past the whole extend graphs' levels, or attention between piecewise
pieces, which runs on the real batch): `max_extend_len` must be a host value, and a whole extend graph
(ForwardBatch.max_extend_len_bound) keeps the Triton kernel it was captured with.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from model_executor.layers.attention.triton_ops.extend_attention import SHORT_EXTEND_MAX_TOKENS

if TYPE_CHECKING:
    from model_executor.forward_batch import ForwardBatch

# New tokens in the batch's longest request from which a prefix-free extend batch takes the flash kernel: past
# the Triton kernel's short-extend tiles.
FLASH_EXTEND_MIN_TOKENS = SHORT_EXTEND_MAX_TOKENS + 1
# FA2's head sizes (multiples of 8 up to 256) and input dtypes.
FLASH_MAX_HEAD_DIM = 256
FLASH_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def flash_supported(device_index: int) -> bool:
    """Whether this CUDA device runs torch's flash-attention kernels (built in, sm80 or newer)."""
    return (torch.backends.cuda.is_flash_attention_available()
            and torch.cuda.get_device_capability(device_index) >= (8, 0))


def batch_fits_flash(fb: ForwardBatch, dtype: torch.dtype, head_dim: int) -> bool:
    """The host half of the rule: 16-bit q, an FA2 head size, an eager batch (no static bound) whose longest
    request has at least FLASH_EXTEND_MIN_TOKENS new tokens, and no request with a cached prefix (host lengths
    only: no device sync)."""
    if dtype not in FLASH_DTYPES or head_dim % 8 or head_dim > FLASH_MAX_HEAD_DIM:
        return False
    if fb.max_extend_len_bound is not None or fb.max_extend_len < FLASH_EXTEND_MIN_TOKENS:
        return False
    return fb.seq_lens_cpu == fb.extend_seq_lens_cpu  # otherwise some request has a cached prefix


def use_flash_extend(fb: ForwardBatch, q: torch.Tensor, head_dim: int) -> bool:
    """Whether this extend batch's attention runs in the flash kernel: batch_fits_flash, on a CUDA device that
    has it."""
    return q.is_cuda and batch_fits_flash(fb, q.dtype, head_dim) and flash_supported(q.device.index or 0)


def cu_seqlens(fb: ForwardBatch, num_tokens: int) -> torch.Tensor:
    """int32 [bs + 1]: where each request's new tokens start, then num_tokens (made on the device: no sync)."""
    return torch.nn.functional.pad(fb.extend_start_loc.to(torch.int32), (0, 1), value=num_tokens)


def flash_varlen_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int,
                        scale: float) -> torch.Tensor:
    """Causal attention of each request's tokens cu[b]..cu[b+1] to themselves. q: [T, Hq, D], k, v: [T, Hk, D]
    (Hk dividing Hq: grouped-query heads are read in place); returns [T, Hq, D]."""
    return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, max_len, max_len, 0.0, True, False,
                                                   scale=scale)[0]
