"""Programmatic dependent launch (PDL, sm_90+), used at two boundaries of a decode step: the qkv kernel ->
decode attention -> o_proj.

A kernel launched with PDL (`launch_pdl=True`; CUDA graphs keep the edge) may start once every program of the
kernel before it has signalled (`gdc_launch_dependents`) or ended, and must wait (`gdc_wait`: that kernel
complete and its writes visible) before it reads anything that kernel, or one before it, may have written. A
kernel launched without PDL waits for the one before as always, so a signal is harmless where the next kernel
is not a PDL launch; and every PDL kernel waits before it ends, so the stream's order holds transitively.

Decode attention at one or two requests reads little and is bound by its latency: the memory bus idles
while it runs.
- The qkv GEMV that runs the rotary and KV store signals at its start; decode attention after it is launched
  with PDL and loads its first step's K/V (all but the newest position, the one that kernel stores) before its
  wait (decode_attention.preload_after_qkv), so its first loads overlap the GEMV's last wave.
- Attention signals at its start; a one-row o_proj GEMV launched with PDL loads its weights (all of K in one
  tile, small_m_gemm.preload_config; PRELOAD in the kernel) before its wait, so those bytes stream while
  attention runs (it may start while the qkv kernel still runs: every attention program has started by then).
PDL is used at these two boundaries only: applied to every small-M GEMM (a first tile each), a GEMV's early
programs compete with the streaming GEMV before them for bandwidth and SM slots (docs/kernels.md)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on this device may signal and be launched with PDL (griddepcontrol needs sm_90)."""
    return device.type == "cuda" and _capable(device.index if device.index is not None else torch.cuda.current_device())
