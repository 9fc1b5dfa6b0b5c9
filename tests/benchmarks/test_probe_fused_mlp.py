"""benchmarks/probe_fused_mlp.py's kernels (one launch for a decode row's MLP) against the MLP in torch.

The probe times them on a GPU against today's two GEMVs; here Triton's CPU interpreter checks what they
compute: h = down(silu(gate x) * up x) + residual, G * h and sum(h^2), for both layouts of down, bf16 and FP8
weights, float32 and int64 fixed-point sums, and that the sums buffer and the arrival counter are left at
zero (a second call gives the same result). In the interpreter the programs run one after another, so the
last program is the one that finishes; the probe's max |diff| against today's kernels covers any order.
"""

from __future__ import annotations

import pytest
import torch

from tests import triton_mode
from tests.triton_mode import interpreter_only

if not triton_mode.RERUN_IN_SUBPROCESS:
    from benchmarks import probe_fused_mlp as pf

test_in_subprocess = triton_mode.subprocess_test(__file__)

H, I = 64, 256


def reference(x: torch.Tensor, layer) -> torch.Tensor:
    """h in float32 from the dequantized weights, rounded where the kernels round (gate, up, a, down's sum, h)."""
    fp8 = layer.sgu is not None
    wgu = layer.wgu.float() * (layer.sgu[:, None] if fp8 else 1)
    wd = layer.wd.float() * (layer.sd[:, None] if fp8 else 1)
    gu = x.float() @ wgu.t()
    g, u = gu[:, :I].bfloat16().float(), gu[:, I:].bfloat16().float()
    a = (torch.nn.functional.silu(g) * u).bfloat16().float()
    return ((a @ wd.t()).bfloat16().float() + layer.res.float()).bfloat16()


@interpreter_only
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("variant", ["u:4/2/2/4", "u:8/4/2/4", "u:16/1/2/4/1", "n:32/16/16/2/2/1", "n:64/32/8/2/2/0"])
def test_fused_mlp_kernels_compute_the_mlp_and_leave_their_buffers_zeroed(fp8, variant):
    layer = pf.Layer(H, I, fp8, torch.Generator().manual_seed(0), "cpu")
    x = torch.randn(1, H, generator=torch.Generator().manual_seed(1)).bfloat16()
    ref = reference(x, layer)
    step = pf.variant_step(variant)
    for _ in range(2):  # the second call starts from the buffers the first left
        h = step(x, layer).clone()
        torch.testing.assert_close(h.float(), ref.float(), atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(layer.y.float(), h.float() * layer.g.float(), atol=0, rtol=8e-3)  # (one bf16 rounding)
        assert float(layer.p) == pytest.approx(float((h.float() ** 2).sum()), rel=1e-5)
        assert int(layer.cnt) == 0 and not layer.acc.any() and not layer.acc64.any()
