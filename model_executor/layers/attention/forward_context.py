"""The forward context: the one place with process-level mutable state in duet.

Everywhere else the ForwardBatch is passed explicitly. The piecewise extend runner cannot do that: its
backbone is traced once by torch.compile and split at the attention op, and a ForwardBatch (host lists,
pools, the backend) cannot be an argument of a registered op. So while a piecewise pass runs, the batch
sits here, and the `duet::attention` op (model_executor/layers/attention/attention_op.py) reads it.

Set only through `forward_context(...)`, which restores the previous value on exit; nothing else writes
`_current`. RadixAttention asks `is_active()` to pick the op path; outside a piecewise pass the context
is empty and attention is the plain backend call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from model_executor.forward_batch import ForwardBatch
    from model_executor.layers.attention.base import AttentionLayer


@dataclass
class ForwardContext:
    forward_batch: ForwardBatch  # the real (unpadded) batch: lengths, KV slots, the attention backend
    attention_layers: dict[int, AttentionLayer]  # by layer_id: the op gets only the id


_current: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("duet::attention called outside a piecewise forward (no forward context set)")
    return _current


def is_active() -> bool:
    return _current is not None


@contextlib.contextmanager
def forward_context(fb: ForwardBatch,
                    attention_layers: dict[int, AttentionLayer]) -> Iterator[ForwardContext]:
    global _current
    previous, _current = _current, ForwardContext(fb, attention_layers)
    try:
        yield _current
    finally:
        _current = previous
