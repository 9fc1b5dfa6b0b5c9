"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous block of vocabulary rows.

The vocabulary is padded to a multiple of tp_size; rank r holds rows [r * per_rank, (r + 1) * per_rank)
(padding rows zero). The embedding looks up the ids in its block (others read as zero) and all-reduces;
the LM head computes its block of logits and all-gathers them, dropping the padding columns.

With weight-only quantization (`--quantization int8` or `int4`, CPU) the table is int8 with one scale per
vocabulary row: that is the LM head's per-output-channel scale and the embedding's per-row one, so a tied
table stays one int8 tensor and one scale vector; the head runs the int8 GEMM, a lookup dequantizes its
rows. The head is the largest single weight of a small model, read whole at every step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model_executor.distributed import parallel_state as ps
from model_executor.layers.linear import _copy_into, _tp
from model_executor.layers.norm import PrenormedRow
from model_executor.layers.quantization import fp8_math
from model_executor.layers.quantization.base import current_quant_config, set_kept_dtype, small_m_kernel
from model_executor.lazy_slice import materialize


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp_rank: int | None = None, tp_size: int | None = None):
        super().__init__()
        self.tp_rank, self.tp_size = _tp(tp_rank, tp_size)
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // self.tp_size)
        self.vocab_start = self.tp_rank * self.per_rank
        self.vocab_end = min(self.vocab_start + self.per_rank, vocab_size)  # real rows of this rank end here
        quant = current_quant_config()
        self.int8 = quant is not None and quant.method in ("int8", "int4")  # the table is int8 for both
        if self.int8:  # quantized as it loads (quantized models run without tensor parallelism)
            self.weight = nn.Parameter(torch.empty(self.per_rank, hidden_size, dtype=torch.int8),
                                       requires_grad=False)
            self.weight.load_dtype = torch.float32
            set_kept_dtype(self, "weight", torch.int8)
            # In the model dtype (the lookups' output dtype); the head's GEMM takes a bfloat16 copy.
            self.register_buffer("weight_scale", torch.empty(self.per_rank))
        else:
            self.weight = nn.Parameter(torch.empty(self.per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        # The module whose table this one uses (itself, or the embedding a tied head shares): its
        # weight_scale belongs to the table. A plain attribute in a tuple, not a registered submodule.
        self._table = (self,)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if self.int8:
            loaded = materialize(loaded)
            if param.shape != loaded.shape:
                raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint "
                                 f"{tuple(loaded.shape)}")
            q, scale = fp8_math.quantize_int8_per_channel(loaded.to(param.device),
                                                          scale_dtype=self.weight_scale.dtype)
            param.data.copy_(q)
            self.weight_scale.copy_(scale)
            return
        if self.tp_size == 1:
            _copy_into(param, loaded)
            return
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(f"shape mismatch: vocabulary {self.vocab_size} vs checkpoint {tuple(loaded.shape)}")
        real = max(0, self.vocab_end - self.vocab_start)
        param.data[real:].zero_()
        _copy_into(param.data[:real], loaded.narrow(0, self.vocab_start, real))

    def init_random(self, generator: torch.Generator, std: float) -> set[str]:
        """Random weights for benchmarks: an int8 table draws float32 rows and quantizes them (a tied head
        has nothing of its own to draw); returns the names of the parameters it filled."""
        if not self.int8 or self._table[0] is not self:
            return set()
        full = torch.empty(self.weight.shape, device=self.weight.device).normal_(0.0, std, generator=generator)
        self.weight_loader(self.weight, full)
        return {"weight"}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.int8:  # the rows' codes times their scales, in the model dtype
            scale = self.weight_scale
            return F.embedding(input_ids, self.weight).to(scale.dtype) * scale[input_ids].unsqueeze(-1)
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        out = F.embedding((input_ids - self.vocab_start) * mine, self.weight)
        return ps.tensor_model_parallel_all_reduce(out * mine.unsqueeze(-1).to(out.dtype))


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection; shares the embedding's weight when the model ties them."""

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        """Use the embedding's table: its weight, and for an int8 table its scales, read through the
        embedding at each call so the two can never drift apart."""
        self.weight = embedding.weight
        if self.int8:
            del self.weight_scale  # not loaded, never read: the table's scales are the embedding's
        self._table = (embedding,)

    def small_m_operands(self) -> tuple[torch.Tensor, None, None] | None:
        """(weight, scale, scale block) as the small-M kernel takes them (linear.linear_add_rmsnorm's consumer);
        None for an int8 table, which has a GEMM of its own."""
        return None if self.int8 else (self.weight, None, None)

    def forward(self, hidden: torch.Tensor | PrenormedRow, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [rows, vocab]: float32 where the small-M kernel runs (it stores its float32 sums; no
        conversion kernel after it) or `out` is given, else in hidden's dtype. hidden may be a PrenormedRow
        (the last layer's down projection made it, linear.linear_add_rmsnorm): the final norm's 1 / rms goes
        into the GEMV. out: a float32 [rows, vocab] tensor to write the logits into (and return): the small-M
        kernel stores there directly; other paths' logits are converted into it by one copy."""
        direct = out if self.tp_size == 1 else None
        if isinstance(hidden, PrenormedRow):
            kernel = small_m_kernel(hidden.weighted, self.weight)
            logits = None if kernel is None else kernel.small_m_prenormed_linear(hidden, self.weight,
                                                                                 out_dtype=torch.float32, y_out=direct)
            if logits is None:  # (linear_add_rmsnorm checked this weight's config before it made the row)
                raise RuntimeError("the LM head was given a PrenormedRow that its GEMV cannot take")
        elif self.int8:
            scale = self._table[0].weight_scale.to(fp8_math.INT8_COMPUTE_DTYPE)
            logits = fp8_math.int8_weight_only_mm(hidden, self.weight, scale)
        elif kernel := small_m_kernel(hidden, self.weight):  # decode-sized CUDA batches, where the table says so
            logits = kernel.small_m_linear(hidden, self.weight, out_dtype=torch.float32, y_out=direct)
        else:
            logits = F.linear(hidden, self.weight)
        if self.tp_size > 1:
            logits = ps.tensor_model_parallel_all_gather(logits)[:, : self.vocab_size]
        if out is None or logits is out:
            return logits
        return out.copy_(logits)
