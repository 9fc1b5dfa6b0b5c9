"""VerifyGraphRunner: speculative verify batches replayed from whole-backbone CUDA graphs per batch size.

A verify batch is an extend of a few tokens per request (the last sampled token and its drafts, at most
`tokens_per_request`), with logits at every token. Its work is a decode step's: a few tokens per weight read,
so host time decides it, and the piecewise runner's eager attention between pieces (one host launch per layer)
would cost what speculation saves. Like FullExtendGraphRunner (which this runner is, keyed differently), it
captures the backbone with attention inside (a backend whose extend kernel reads every length from device
tensors, AttentionBackend.supports_extend_cuda_graph), here at each decode batch size bs of the capture list:
bs request rows and bs * tokens_per_request tokens.

A replay bisects to the smallest captured bs >= the batch's requests. Padding rows get no new tokens (their
attention programs exit at once) and padding tokens belong to no request (never attended to or stored; their
hidden states are cut off). The attention grid is sized for tokens_per_request tokens per request, not the
level. The logits head runs eagerly on every real token. An EAGLE-3 target's aux hidden states come out too.
"""

from __future__ import annotations

import logging

from model_executor.forward_batch import ForwardBatch
from runners.capture_lists import pick_size
from runners.full_extend_graph_runner import FullExtendGraphRunner
from runners.graph_seam import GraphCapturer

logger = logging.getLogger("duet.verify_graph_runner")


class VerifyGraphRunner(FullExtendGraphRunner):
    capture_desc = "capturing verify graphs"

    def __init__(self, model_runner, batch_sizes: list[int], tokens_per_request: int,
                 capturer: GraphCapturer | None = None):
        self.batch_sizes = sorted(set(batch_sizes))
        self.tokens_per_request = tokens_per_request
        super().__init__(model_runner, [bs * tokens_per_request for bs in self.batch_sizes],
                         max_requests=self.batch_sizes[-1], capturer=capturer)

    def graph_keys(self) -> list[tuple[int, int]]:
        return [(bs * self.tokens_per_request, bs) for bs in self.batch_sizes]

    def static_batch(self, key: tuple[int, int]) -> ForwardBatch:
        fb = super().static_batch(key)
        fb.max_extend_len_bound = self.tokens_per_request  # no request extends by more
        return fb

    def key(self, fb: ForwardBatch) -> tuple[int, int]:
        bs = pick_size(self.batch_sizes, fb.batch_size)
        return bs * self.tokens_per_request, bs

    def can_run(self, fb: ForwardBatch) -> bool:
        return (fb.all_token_logits and fb.batch_size <= self.batch_sizes[-1]
                and max(fb.extend_seq_lens_cpu) <= self.tokens_per_request)

    def log_capture(self) -> None:
        logger.info("captured %d verify graphs (%d tokens a request, up to %d requests) in %.1f s, %.2f GiB",
                    len(self.graphs), self.tokens_per_request, self.batch_sizes[-1], self.capture_seconds,
                    self.capture_bytes / 2**30)

    def info(self) -> dict:
        return {"verify_graph_bs": list(self.batch_sizes), "verify_graph_tokens": self.tokens_per_request,
                "verify_capture_seconds": round(self.capture_seconds, 2),
                "verify_capture_gib": round(self.capture_bytes / 2**30, 3)}
