"""Linear layers as tensor-parallel classes (Megatron's column/row split).

Each parameter carries a `weight_loader(param, loaded, shard_id)` so HF checkpoints (separate q/k/v and
gate/up tensors) load into the fused layers, each rank copying only its shard. `loaded` is a tensor or a
lazy safetensors slice (model_executor/lazy_slice.py): narrowing it reads nothing, so a rank reads only its
part of the file. tp_rank/tp_size default to the process's tensor-parallel group
(model_executor/distributed/parallel_state.py), so model code never passes them.

A decoder block's norms, activation and residual adds go into the GEMMs around them where the kernels allow.
Each fusion choice is one method here, so a model reads as its plain chain:

    QKVParallelLinear.forward_qkv                  input norm -> qkv (-> rotary + KV store)
    MergedColumnParallelLinear.forward_silu_and_mul  post-attention norm -> gate_up -> SiLU-and-mul
    RowParallelLinear.forward_residual             o_proj / down -> + residual (-> the next norm's first step)

Their inputs are a residual stream's (x, residual): h = x + residual, normed by the layer that takes it (x is
a PrenormedRow where the GEMM before prepared the norm in its epilogue; residual is then h).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from model_executor.distributed import parallel_state as ps
from model_executor.layers.activation import SiluAndMul
from model_executor.layers.norm import PrenormedRow, RMSNorm
from model_executor.layers.quantization import current_linear_method
from model_executor.layers.quantization.base import copy_into, small_m_kernel, small_m_linear_add_rmsnorm
from model_executor.layers.rotary_store_kv import RopeStore
from model_executor.lazy_slice import materialize


def _shard(loaded: torch.Tensor, dim: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    if tp_size == 1:
        return loaded
    if loaded.shape[dim] % tp_size:
        raise ValueError(f"checkpoint dimension {dim} of {tuple(loaded.shape)} does not split over {tp_size} ranks")
    size = loaded.shape[dim] // tp_size
    return loaded.narrow(dim, tp_rank * size, size)


def _copy_into(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    copy_into(param, materialize(loaded))


def _tp(tp_rank: int | None, tp_size: int | None) -> tuple[int, int]:
    """Explicit values, else this process's tensor-parallel rank and size."""
    return (ps.get_tp_rank() if tp_rank is None else tp_rank), (ps.get_tp_size() if tp_size is None else tp_size)


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    """For parameters with no sharding (norms): a checked copy."""
    _copy_into(param, loaded)


@dataclass(frozen=True)
class GateUp:
    """A [gate; up] GEMM's output whose SiLU-and-mul has not run: the down projection runs it, inside its FP8
    activation quantization where it can (RowParallelLinear.forward_residual)."""
    out: torch.Tensor
    # The GEMM's input was quantized inside the norm's kernel (FP8 rows on the W8A8 path): down then runs
    # without the next norm's epilogue.
    quantized_input: bool = False


_silu_and_mul = SiluAndMul()


class LinearBase(nn.Module):
    # A LoRA layer (model_executor/lora/layer.py) when the server serves adapters and this projection is a
    # target: forward adds each row's adapter update, and the fused paths that keep the GEMM's input or output
    # inside one kernel step aside (None) so the update sees both.
    lora = None

    def __init__(self, input_size: int, output_size: int, bias: bool, tp_rank: int | None = None,
                 tp_size: int | None = None):
        super().__init__()
        self.tp_rank, self.tp_size = _tp(tp_rank, tp_size)
        self.input_size = input_size  # this rank's
        self.output_size = output_size  # this rank's
        # The quantization method (layers/quantization) creates the parameters, stores each loaded shard
        # (quantizing it, for online quantization) and runs the GEMM; unquantized: weight, bias, F.linear.
        self.quant_method = current_linear_method()
        self.quant_method.create_weights(self, input_size, output_size, bias)

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, offset: int = 0, size: int | None = None) -> None:
        """Store `loaded` (this rank's shard, a tensor or a lazy slice) as output rows offset .. offset + size
        (default: all of them) of the layer; the method maps rows to its tensor's layout (a block scale's rows
        are blocks)."""
        self.quant_method.load(self, param, materialize(loaded), offset, self.output_size if size is None else size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        self._load(param, loaded)

    def lora_shard(self, part: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (A, B) of a LoRA adapter's whole A [r, in] and B [out, r] for output part `part` (q, k, v;
        gate, up), cut the way the weight is: no communication beyond the layer's own. ValueError naming the
        shapes that fit when A and B do not."""
        return _check_lora(a, b, self.input_size, self.output_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x)
        return y if self.lora is None else self.lora.apply(x, y)

    def small_m_operands(self) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, int] | None] | None:
        """(weight, scale, scale block) as the small-M kernel takes them, or None: a method with a GEMM of
        its own (no fused one-row paths then)."""
        return self.quant_method.small_m_operands(self)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """For a [gate; up] layer: silu(gate) * up in one kernel where its method can (a decode row), else
        None (the caller runs forward and SiluAndMul)."""
        if self.lora is not None:
            return None
        return self.quant_method.apply_silu_and_mul(self, x)

    def forward_normed(self, norm: RMSNorm, x: torch.Tensor | PrenormedRow,
                       residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(norm(h)), h) for h = x + residual (x when residual is None; residual when x is a
        PrenormedRow of it). At a decode row where the method can, the norm runs inside the layer's GEMV:
        one kernel instead of two (with a PrenormedRow, the kernel that made h did the norm's sums)."""
        fused = None if self.lora is not None else self.quant_method.apply_rmsnorm(self, x, norm.weight, norm.eps,
                                                                                  residual)
        if fused is not None:
            return fused
        if isinstance(x, PrenormedRow):
            return self(norm(residual)), residual
        h, residual = _add_norm(norm, x, residual)
        return self(h), residual

    def forward_normed_quantized(self, norm: RMSNorm, x: torch.Tensor,
                                 residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """forward_normed's (y, h) where the method quantizes its input inside the norm's kernel (FP8 rows above
        the small-M kernel's), else None: there the caller keeps its own path (a decode row's GEMV fusions)."""
        if self.lora is not None:
            return None
        return self.quant_method.apply_rmsnorm_quant(self, x, norm.weight, norm.eps, residual)

    def forward_normed_rope(self, norm: RMSNorm, x: torch.Tensor | PrenormedRow, residual: torch.Tensor | None,
                            rope: RopeStore) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For a qkv layer at a decode token: forward_normed's (y, h) with the rotary and the KV store run in
        the same kernel (y's q heads rotated; k and v in the pool, as `rope` says), or None where the method
        cannot: the caller then runs forward_normed and attention's own rotary and store. Where the norm cannot
        go into the kernel (a tl.dot tile: above 4 rows, or the table's choice) but the rotary can, the norm runs
        as its own kernel first."""
        if self.lora is not None:
            return None
        fused = self.quant_method.apply_rmsnorm(self, x, norm.weight, norm.eps, residual, rope)
        if fused is not None or isinstance(x, PrenormedRow):
            return fused
        config = self.quant_method.rope_config(self, x)
        if config is None:
            return None
        h, residual = _add_norm(norm, x, residual)
        return self.quant_method.apply_rope(self, h, rope, config), residual


def _check_lora(a: torch.Tensor, b: torch.Tensor, in_size: int, out_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, b), or ValueError when A [r, in] and B [out, r] are not in_size in and out_size out."""
    if a.shape[1] != in_size or b.shape[0] != out_size:
        raise ValueError(f"({in_size} in, {out_size} out)")
    return a, b


def _add_norm(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(h), h) for h = x + residual (x without one)."""
    return (norm(x), x) if residual is None else norm(x, residual)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp_rank: int | None = None,
                 tp_size: int | None = None):
        tp_rank, tp_size = _tp(tp_rank, tp_size)
        assert output_size % tp_size == 0
        super().__init__(input_size, output_size // tp_size, bias, tp_rank, tp_size)

    def weight_loader(self, param, loaded, shard_id=None):
        self._load(param, _shard(loaded, 0, self.tp_rank, self.tp_size))

    def _part_rows(self, part: int) -> tuple[int, int, int]:
        """Output part `part`'s (rows in the whole layer, this rank's first row of them, this rank's count)."""
        return self.output_size * self.tp_size, self.tp_rank * self.output_size, self.output_size

    def lora_shard(self, part, a, b):
        """A whole, B cut by output rows (per part, as the weight: a rank's q heads, k and v heads, gate, up)."""
        full, start, size = self._part_rows(part)
        _check_lora(a, b, self.input_size, full)
        return a, b.narrow(0, start, size)


class RowParallelLinear(LinearBase):
    """Input features split across ranks: each computes a partial sum, an all-reduce adds them up."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp_rank: int | None = None,
                 tp_size: int | None = None):
        tp_rank, tp_size = _tp(tp_rank, tp_size)
        assert input_size % tp_size == 0
        super().__init__(input_size // tp_size, output_size, bias, tp_rank, tp_size)

    def weight_loader(self, param, loaded, shard_id=None):
        if param is self.bias and self.tp_rank != 0:
            # The bias is whole on every rank: only rank 0 keeps it, or the all-reduce would add it tp_size
            # times (the others hold zeros, so every quantization method's GEMM + bias stays as it is).
            loaded = torch.zeros(tuple(loaded.shape), dtype=param.dtype)
        dim = 1 if param.dim() == 2 else None
        self._load(param, loaded if dim is None else _shard(loaded, dim, self.tp_rank, self.tp_size))

    def lora_shard(self, part, a, b):
        """A cut by input columns (as the weight), B whole: each rank's update B (A_r x_r) is a partial sum that
        forward adds before the all-reduce, which sums them to B (A x)."""
        _check_lora(a, b, self.input_size * self.tp_size, self.output_size)
        return a.narrow(1, self.tp_rank * self.input_size, self.input_size), b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x)
        if self.lora is not None:  # this rank's partial update, summed with the partial output
            y = self.lora.apply(x, y)
        return ps.tensor_model_parallel_all_reduce(y)

    def forward_gated(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """self(silu(gate) * up) for gate_up = [gate; up] where the method makes its input in the activation's
        kernel (FP8 rows above the small-M kernel's: the activation quantization goes there), else None: the
        caller runs SiluAndMul, then the layer."""
        if self.lora is not None:
            return None
        out = self.quant_method.apply_gated(self, gate_up)
        return None if out is None else ps.tensor_model_parallel_all_reduce(out)

    def forward_residual(self, x: torch.Tensor | GateUp, residual: torch.Tensor,
                         next_input: tuple[RMSNorm, nn.Module] | None = None,
                         after_attention: bool = False) -> tuple[torch.Tensor | PrenormedRow, torch.Tensor]:
        """(y, residual) for y = self(x) (x a GateUp: self(silu(gate) * up)), the residual stream the next norm
        takes (h = y + residual). next_input, the (norm, layer) h goes into next (a linear, or the LM head):
        where the kernels can, the residual add and the sums of h^2 run in this GEMM's epilogue
        (linear_add_rmsnorm) and the result is (PrenormedRow of norm(h), h). after_attention (o_proj): x is
        decode attention's output; where all of K fits one tile its GEMV loads its weights while attention runs,
        and with tensor parallelism the add and the sums run in the all-reduce's kernel (all_reduce_add_rmsnorm)."""
        if isinstance(x, GateUp):
            out = self.forward_gated(x.out)  # (FP8 W8A8 rows: the activation quantized in the SiLU's kernel)
            if out is not None:
                return out, residual
            act = _silu_and_mul(x.out)
            if x.quantized_input:
                return self(act), residual
            x = act
        if next_input is not None:
            fused = linear_add_rmsnorm(self, x, residual, *next_input, after_attention=after_attention)
            if fused is None and after_attention:
                fused = all_reduce_add_rmsnorm(self, x, residual, *next_input)
            if fused is not None:
                return fused
        return self(x), residual


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused into one matmul (gate_up_proj); shard_id is the index."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, tp_rank: int | None = None,
                 tp_size: int | None = None):
        tp_rank, tp_size = _tp(tp_rank, tp_size)
        self.output_sizes = [s // tp_size for s in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias, tp_rank, tp_size)

    def weight_loader(self, param, loaded, shard_id=None):
        offset = sum(self.output_sizes[:shard_id])
        size = self.output_sizes[shard_id]
        self._load(param, _shard(loaded, 0, self.tp_rank, self.tp_size), offset, size)

    def _part_rows(self, part):
        size = self.output_sizes[part]
        return size * self.tp_size, self.tp_rank * size, size

    def forward_silu_and_mul(self, norm: RMSNorm, x: torch.Tensor | PrenormedRow,
                             residual: torch.Tensor | None) -> tuple[torch.Tensor | GateUp, torch.Tensor]:
        """(silu(gate) * up, h) of this [gate; up] layer on norm(h), h = x + residual (residual when x is a
        PrenormedRow of it), in the kernels that fit the rows: at decode rows where the small-M kernel fuses, the
        GEMV and the SiLU-and-mul in one (after a PrenormedRow, the norm's 1 / rms too); FP8 rows on the W8A8
        path quantize the GEMM's input inside the norm's kernel and leave the SiLU-and-mul to down's
        quantization kernel (a GateUp); elsewhere norm, GEMM, then the SiLU-and-mul in down's call (a GateUp)."""
        if not isinstance(x, PrenormedRow):
            quantized = self.forward_normed_quantized(norm, x, residual)
            if quantized is not None:
                gate_up, residual = quantized
                return GateUp(gate_up, quantized_input=True), residual
            x, residual = _add_norm(norm, x, residual)
        act = self.silu_and_mul(x)
        if act is not None:
            return act, residual
        if isinstance(x, PrenormedRow):  # (not expected: the kernel before checked this layer's config)
            x = norm(residual)
        return GateUp(self(x)), residual


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection split by heads; shard_id is "q", "k" or "v". With more ranks than KV heads,
    each rank holds one KV head, replicated over tp_size / num_kv_heads ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 tp_rank: int | None = None, tp_size: int | None = None):
        tp_rank, tp_size = _tp(tp_rank, tp_size)
        self.num_heads = ps.heads_per_rank(num_heads, tp_size)
        self.num_kv_heads = ps.kv_heads_per_rank(num_kv_heads, tp_size)
        self.kv_head_start = ps.kv_head_start(num_kv_heads, tp_rank, tp_size)
        self.total_sizes = {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim}
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        total = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size  # the per-rank size, times tp
        super().__init__(hidden_size, total, bias, tp_rank, tp_size)

    def weight_loader(self, param, loaded, shard_id=None):
        offset, size = {"q": (0, self.q_size), "k": (self.q_size, self.kv_size),
                        "v": (self.q_size + self.kv_size, self.kv_size)}[shard_id]
        if param is not self.weight and param is not self.bias:
            # A quantization scale: its method maps the shard's rows to its layout (block rows, one per-tensor
            # value); quantized models run at tp 1 (weight_loader refuses tp > 1 for them).
            self._load(param, loaded, offset, size)
            return
        if loaded.shape[0] != self.total_sizes[shard_id]:
            raise ValueError(f"shape mismatch: {shard_id} rows {self.total_sizes[shard_id]} vs checkpoint "
                             f"{tuple(loaded.shape)}")
        start = self.tp_rank * self.q_size if shard_id == "q" else self.kv_head_start * self.head_dim
        self._load(param, loaded.narrow(0, start, size), offset, size)

    def _part_rows(self, part):
        if part == 0:
            return self.total_sizes["q"], self.tp_rank * self.q_size, self.q_size
        return self.total_sizes["k"], self.kv_head_start * self.head_dim, self.kv_size

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)

    def forward_qkv(self, norm: RMSNorm, x: torch.Tensor | PrenormedRow, residual: torch.Tensor | None,
                    rope: RopeStore | None) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(qkv, h, stored) for qkv = self(norm(h)), h = x + residual (forward_normed: the norm inside the GEMV
        where the method can). rope (a decode batch whose attention backend lets this GEMM store its KV):
        where the method can, the rotary and the KV store run in the same kernel (forward_normed_rope): qkv's q
        heads come out rotated, k and v are in the pool, and stored is True."""
        fused = None if rope is None else self.forward_normed_rope(norm, x, residual, rope)
        if fused is not None:
            return fused[0], fused[1], True
        qkv, residual = self.forward_normed(norm, x, residual)
        return qkv, residual, False


def all_reduce_add_rmsnorm(linear: RowParallelLinear, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm,
                           consumer) -> tuple[PrenormedRow, torch.Tensor] | None:
    """linear_add_rmsnorm's tensor-parallel twin: (row, h) for h = linear(x) + residual at one decode row,
    where linear's all-reduce is the one-shot kernel. The kernel takes the residual add and the sums of h^2
    for norm(h), and `row` goes to `consumer` as linear_add_rmsnorm's does. None where that cannot run (tp 1,
    no one-shot sum for this row, a consumer whose GEMM at one row is not the small-M kernel's)."""
    if linear.tp_size == 1 or linear.lora is not None or not ps.can_all_reduce_add_rmsnorm(residual):
        return None
    ops = consumer.small_m_operands()
    if ops is None or small_m_kernel(residual, ops[0], ops[2]) is None:  # (the consumer's GEMV takes the row)
        return None
    weighted, h, partials = ps.all_reduce_add_rmsnorm(linear.quant_method.apply(linear, x), residual, norm.weight)
    return PrenormedRow(weighted, partials, norm.eps), h


def linear_add_rmsnorm(linear: LinearBase, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm,
                       consumer, after_attention: bool = False) -> tuple[PrenormedRow, torch.Tensor] | None:
    """(row, h) for h = linear(x) + residual at up to 16 decode rows: the residual add and the sums of h^2 for
    norm(h) run in the epilogue of linear's single-split GEMM, and `row` (a PrenormedRow) goes to `consumer`, the layer
    norm(h) feeds (a LinearBase, or the LM head: anything with small_m_operands(); it scales by 1 / rms in
    its GEMV: the norm's own launch goes). None where that cannot
    run: linear sharded over tensor-parallel ranks (its all-reduce comes before the add), a method with a
    GEMM of its own, no fusing table config for linear or consumer. The caller then runs linear and the
    norm apart. after_attention: x is decode attention's output (o_proj: where all of K fits one tile, its GEMV
    loads its weights while attention runs, triton_ops/pdl.py)."""
    if linear.tp_size > 1 or linear.lora is not None or getattr(consumer, "lora", None) is not None:
        return None
    ops = linear.small_m_operands()
    consumer_ops = consumer.small_m_operands()
    if ops is None or consumer_ops is None:
        return None
    return small_m_linear_add_rmsnorm(x, *ops, linear.bias, residual, norm.weight, norm.eps, consumer_ops[0],
                                      consumer_ops[2], after_attention)
