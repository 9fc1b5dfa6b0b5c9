"""The torch.compile backend of the piecewise runner: split the traced backbone at the attention op.

Dynamo traces the backbone once (fullgraph, token dimension dynamic) and hands the FX graph here. The
graph is cut with `torch.fx.passes.split_module` so that every `duet::attention` call is a partition of
its own; what lies between two attention calls (and before the first, after the last) is a piece:
num_layers + 1 pieces for a decoder. The split module calls the partitions in their original order;
each piece is replaced by whatever `wrap_piece` returns (the runner's capture/replay wrapper), attention
partitions run eagerly and call the op's implementation directly, skipping the dispatcher (host time that
every layer of every extend batch would pay, for nothing: nothing traces them any more).

Piece compilers: "eager" (the piece runs as its FX GraphModule; no inductor needed) or "inductor"
(each piece compiled by inductor for the symbolic token count, from the fake inputs dynamo traced with).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module

from model_executor.layers.attention.attention_op import ATTENTION_OPS, attention_impl

logger = logging.getLogger("duet.fx_split")


def is_attention_node(node: fx.Node) -> bool:
    return node.op == "call_function" and (node.target in ATTENTION_OPS or node.target is attention_impl)


def call_attention_directly(attention: fx.GraphModule) -> None:
    """Retarget the partition's op call to the plain Python implementation (same arguments, same effect)."""
    for node in attention.graph.nodes:
        if is_attention_node(node):
            node.target = attention_impl
    attention.recompile()


@dataclass
class SplitGraph:
    module: fx.GraphModule  # calls submodules in order; pieces are swapped for wrappers
    piece_names: list[str]  # non-attention submodules, in call order
    attention_names: list[str]  # submodules holding one attention call each, in call order


def split_at_attention(gm: fx.GraphModule) -> SplitGraph:
    """One partition per attention call, one per gap between them (empty gaps are dropped)."""
    partition, ids = 0, {}
    attention_ids = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_attention_node(node):
            partition += 1
            ids[node] = partition
            attention_ids.add(partition)
            partition += 1
        else:
            ids[node] = partition
    split = split_module(gm, None, lambda node: ids[node], keep_original_order=True)
    pieces, attention = [], []
    for node in split.graph.nodes:
        if node.op == "call_module":
            index = int(node.target.rsplit("_", 1)[-1])
            (attention if index in attention_ids else pieces).append(node.target)
    return SplitGraph(split, pieces, attention)


def piece_fake_inputs(split: fx.GraphModule, example_inputs: Sequence) -> dict[str, list]:
    """Fake (symbolic-shape) inputs of every submodule, propagated from the inputs dynamo traced with.

    Called inside the backend: dynamo's fake mode memoizes its real inputs, so `from_tensor` gives back the
    fake tensors with the symbolic token dimension."""
    fake_mode = torch._guards.detect_fake_mode()
    fake_args = [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]
    found: dict[str, list] = {}

    class Recorder(fx.Interpreter):
        def call_module(self, target, args, kwargs):
            found[target] = list(args)
            return super().call_module(target, args, kwargs)

    with fake_mode:
        Recorder(split).run(*fake_args)
    return found


def compile_piece_inductor(gm: fx.GraphModule, fake_inputs: list) -> Callable:
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, fake_inputs)


@dataclass
class PiecewiseBackend:
    """`torch.compile(backend=PiecewiseBackend(...))`. Counts its invocations: one trace is the goal."""

    wrap_piece: Callable[[int, str, Callable], nn.Module]  # (piece index, name, compiled piece) -> module
    piece_compiler: str = "eager"  # "eager" | "inductor"
    num_traces: int = 0
    compile_seconds: float = 0.0
    split: SplitGraph | None = field(default=None, repr=False)
    last_args: tuple | None = field(default=None, repr=False)  # what dynamo last called the split module with

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence) -> Callable:
        start = time.perf_counter()
        self.num_traces += 1
        (output,) = [n for n in gm.graph.nodes if n.op == "output"]
        if len(output.args[0]) != 1:  # the runner's direct replay returns the graph's only output
            raise ValueError(f"the piecewise backbone must return one tensor, its graph returns {output.args[0]}")
        split = split_at_attention(gm)
        fake_inputs = piece_fake_inputs(split.module, example_inputs) if self.piece_compiler == "inductor" else {}
        for index, name in enumerate(split.piece_names):
            piece = getattr(split.module, name)
            if self.piece_compiler == "inductor":
                piece = compile_piece_inductor(piece, fake_inputs[name])
            elif self.piece_compiler != "eager":
                raise ValueError(f"unknown piece compiler {self.piece_compiler!r}")
            setattr(split.module, name, self.wrap_piece(index, name, piece))
        for name in split.attention_names:
            call_attention_directly(getattr(split.module, name))
        self.split = split
        self.compile_seconds += time.perf_counter() - start
        logger.info("split the backbone into %d pieces around %d attention calls (%s pieces)",
                    len(split.piece_names), len(split.attention_names), self.piece_compiler)

        def run_split(*args):
            self.last_args = args  # the runner keeps them per level to replay without dynamo's frame
            return split.module(*args)

        return run_split
