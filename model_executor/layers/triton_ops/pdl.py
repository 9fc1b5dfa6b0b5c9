"""Programmatic dependent launch (PDL, sm90+): a kernel launched with it may start while the previous kernel
in the stream finishes, once every program of that kernel has signalled (`gdc_launch_dependents`) or ended;
it must wait (`gdc_wait`: the previous kernel complete, its writes visible) before it reads what that kernel
wrote. The small-M GEMM is launched so (its weights do not depend on the previous kernel: it loads a first
tile before waiting); the kernels that usually precede it in a decode step (RMSNorm, decode attention)
signal at their start. A kernel launched without PDL waits for the previous one as always, so the signal is
harmless elsewhere; and every PDL kernel waits before it ends, so order holds transitively."""

from __future__ import annotations

import functools

import torch


@functools.cache
def supported(device: torch.device) -> bool:
    """Whether kernels on this device may signal and be launched with PDL (griddepcontrol needs sm90)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
