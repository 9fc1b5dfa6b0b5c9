"""Decode graphs with LoRA (stand-in capturer, triton attention in the interpreter): the slot ids are a graph
input buffer, so a replay after an adapter is loaded post-capture, with mixed adapters and the base in one batch,
equals eager decode."""

from __future__ import annotations

import pytest
import torch

from model_executor.forward_batch import ForwardMode
from model_executor.layers.attention.triton_backend import TritonAttnBackend
from model_executor.lora.manager import LoraConfig
from runners.cuda_graph_runner import CudaGraphRunner
from runners.graph_seam import StandInCapturer
from runners.model_runner import ModelRunner, RunnerConfig
from tests import triton_mode
from tests.lora_models import make_base_and_adapters
from tests.triton_mode import DEVICE, in_process

test_in_subprocess = triton_mode.subprocess_test(__file__)


@in_process
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_decode_replay_equals_eager_after_loading_an_adapter(tmp_path, backend):
    base, _, adapters = make_base_and_adapters(tmp_path)
    cfg = LoraConfig(paths=(("a1", str(adapters["a1"][0])),), max_per_batch=3, max_rank=8, backend=backend,
                     target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    runner = ModelRunner(RunnerConfig(model_path=str(base), device=DEVICE, dtype="float32", max_running_requests=8,
                                      max_total_tokens=512, disable_cuda_graph=True, lora=cfg))
    runner.attn_backend = TritonAttnBackend(runner)  # graph-safe: reads lengths from device buffers
    graphs = CudaGraphRunner(runner, [4], capturer=StandInCapturer())
    lora = runner.lora
    for name in ("a2", "a3"):  # after capture: copies into the pool, no recapture
        lora.load(name, str(adapters[name][0]))
    uids = [lora.uid("a2"), None, lora.uid("a1"), lora.uid("a3")]
    prompts = [[5, 17, 33, 8], [200, 3, 64], [9, 120, 77, 31, 250], [44, 2, 61]]
    rows, locs = [], []
    for p in prompts:
        row = runner.req_to_token_pool.alloc()
        loc = runner.allocator.alloc(len(p) + 1)
        runner.req_to_token_pool.write(row, 0, loc)
        rows.append(row)
        locs.append(loc)
    lens = [len(p) for p in prompts]
    slots = lora.prepare(uids)
    runner.forward_eager(runner.build_batch(ForwardMode.EXTEND, [t for p in prompts for t in p], rows, lens,
                                            torch.cat([loc[:n] for loc, n in zip(locs, lens)]),
                                            extend_seq_lens=lens, lora_slots=slots))
    decode_loc = torch.stack([loc[n] for loc, n in zip(locs, lens)])
    fb = runner.build_batch(ForwardMode.DECODE, [p[-1] for p in prompts][:3], rows[:3], [n + 1 for n in lens][:3],
                            decode_loc[:3], lora_slots=slots[:3])  # 3 rows: one padding row in the graph of 4
    eager = runner.forward_eager(fb).clone()
    replayed = graphs.replay(fb).clone()
    torch.testing.assert_close(replayed, eager, rtol=1e-4, atol=1e-4)
    base_rows = runner.build_batch(ForwardMode.DECODE, [p[-1] for p in prompts][:3], rows[:3],
                                   [n + 1 for n in lens][:3], decode_loc[:3], lora_slots=[0, 0, 0])
    assert base_rows.lora is None
    plain = graphs.replay(base_rows).clone()  # the same rows without adapters: the buffer's slots go to 0
    assert not torch.allclose(plain[0], eager[0], atol=1e-3)
    torch.testing.assert_close(plain[1], eager[1], rtol=1e-4, atol=1e-4)
