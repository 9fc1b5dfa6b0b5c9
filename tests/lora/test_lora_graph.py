"""LoRA inside the graphs (stand-in capturer, triton attention and LoRA kernels in the interpreter): the slot ids
are a graph input buffer, so a replay after adapters are loaded post-capture, with mixed adapters and the base
in one batch, equals the eager forward. Decode graphs, the piecewise extend pieces and the whole extend graphs."""

from __future__ import annotations

import pytest
import torch

from model_executor.forward_batch import ForwardMode
from model_executor.layers.attention.triton_backend import TritonAttnBackend
from model_executor.lora.manager import LoraConfig
from runners.cuda_graph_runner import CudaGraphRunner
from runners.full_extend_graph_runner import FullExtendGraphRunner
from runners.graph_seam import StandInCapturer
from runners.model_runner import ModelRunner, RunnerConfig
from runners.piecewise_cuda_graph_runner import PiecewiseCudaGraphRunner
from tests import triton_mode
from tests.lora_models import make_base_and_adapters
from tests.triton_mode import DEVICE, in_process

test_in_subprocess = triton_mode.subprocess_test(__file__)

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_runner(tmp_path, backend: str):
    """A runner serving a1 (loaded at start-up), the triton attention backend swapped in (graph-safe), and the
    other adapters' folders."""
    base, _, adapters = make_base_and_adapters(tmp_path)
    cfg = LoraConfig(paths=(("a1", str(adapters["a1"][0])),), max_per_batch=3, max_rank=8, backend=backend,
                     target_modules=ALL)
    runner = ModelRunner(RunnerConfig(model_path=str(base), device=DEVICE, dtype="float32", max_running_requests=8,
                                      max_total_tokens=512, disable_cuda_graph=True, lora=cfg))
    runner.attn_backend = TritonAttnBackend(runner)  # graph-safe: reads lengths from device buffers
    return runner, adapters


def load_after_capture(runner, adapters) -> list[int | None]:
    """a2 and a3 loaded after capture (copies into the pool, no recapture); each request's adapter uid."""
    lora = runner.lora
    for name in ("a2", "a3"):
        lora.load(name, str(adapters[name][0]))
    return [lora.uid("a2"), None, lora.uid("a1"), lora.uid("a3")]


@in_process
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_decode_replay_equals_eager_after_loading_an_adapter(tmp_path, backend):
    runner, adapters = make_runner(tmp_path, backend)
    graphs = CudaGraphRunner(runner, [4], capturer=StandInCapturer())
    uids = load_after_capture(runner, adapters)
    lora = runner.lora
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


def extend_batch(runner, slots: list[int], ext_lens: list[int], prefix_lens: list[int], seed: int, lora: bool = True):
    """An extend batch of requests with random prompts on each slot (0: the base model); each cached prefix is
    prefilled eagerly first under the request's adapter."""
    g = torch.Generator().manual_seed(seed)
    rows, seq_lens, ids, locs = [], [], [], []
    for slot, ext, pre in zip(slots, ext_lens, prefix_lens):
        prompt = torch.randint(3, 320, (pre + ext,), generator=g).tolist()
        row = runner.req_to_token_pool.alloc()
        loc = runner.allocator.alloc(pre + ext)
        runner.req_to_token_pool.write(row, 0, loc)
        if pre:
            runner.forward_eager(runner.build_batch(ForwardMode.EXTEND, prompt[:pre], [row], [pre], loc[:pre],
                                                    extend_seq_lens=[pre], lora_slots=[slot]))
        rows.append(row)
        seq_lens.append(pre + ext)
        ids += prompt[pre:]
        locs.append(loc[pre:])
    return runner.build_batch(ForwardMode.EXTEND, ids, rows, seq_lens, torch.cat(locs), extend_seq_lens=ext_lens,
                              lora_slots=slots if lora else None)


# (new tokens, cached prefix) per request: a2, base, a1, a3. 21 tokens: padded to the level of 32; request
# boundaries inside the kernels' 16-token blocks.
EXT, PREFIX = [5, 3, 9, 4], [0, 6, 3, 0]


def assert_graph_equals_eager(runner, graphs, uids) -> None:
    slots = runner.lora.prepare(uids)
    fb = extend_batch(runner, slots, EXT, PREFIX, seed=1)
    eager = runner.forward_eager(fb).clone()
    replayed = graphs.replay(fb).clone()
    torch.testing.assert_close(replayed, eager, rtol=1e-4, atol=1e-4)
    # The same batch without adapters: the adapters' rows change, the base row does not.
    fb.lora = None
    plain = graphs.replay(fb).clone()
    for i, slot in enumerate(slots):
        if slot:
            assert not torch.allclose(plain[i], eager[i], atol=1e-3), i
        else:
            torch.testing.assert_close(plain[i], eager[i], rtol=1e-4, atol=1e-4)


@in_process
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_piecewise_replay_equals_eager_after_loading_an_adapter(tmp_path, backend):
    torch._dynamo.reset()
    runner, adapters = make_runner(tmp_path, backend)
    graphs = PiecewiseCudaGraphRunner(runner, [4, 8, 16, 32], capturer=StandInCapturer())
    assert graphs.num_traces == 1
    assert_graph_equals_eager(runner, graphs, load_after_capture(runner, adapters))
    assert graphs.num_traces == 1
    torch._dynamo.reset()


@in_process
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_full_extend_replay_equals_eager_after_loading_an_adapter(tmp_path, backend):
    runner, adapters = make_runner(tmp_path, backend)
    graphs = FullExtendGraphRunner(runner, [8, 32], max_requests=4, capturer=StandInCapturer())
    assert_graph_equals_eager(runner, graphs, load_after_capture(runner, adapters))
    assert graphs.replays == 2
