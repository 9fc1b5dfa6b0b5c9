"""Multi-LoRA through the scheduler in-process, on a tiny random Llama and Qwen3 with three PEFT adapters
(different ranks, targets, alphas; random non-zero A and B): greedy tokens equal PEFT's model per adapter with the
base and three adapters in one batch, prefill logits equal PEFT's, the prefix cache never shares KV across
adapters, LRU eviction when more adapters than slots, at most max_loras_per_batch adapters per batch, and an
adapter that cannot be served is a one-line LoraError at load."""

from __future__ import annotations

import json

import pytest
import torch

from model_executor.forward_batch import ForwardMode
from model_executor.lora.adapter import LoraError
from model_executor.lora.manager import LoraConfig
from model_executor.sampling_params import SamplingParams
from runners.model_runner import ModelRunner, RunnerConfig
from scheduler.scheduler import Scheduler, SchedulerConfig
from tests.lora_models import make_base_and_adapters, save_adapter

PROMPTS = [[5, 17, 33, 8, 90, 41, 7], [200, 3, 64, 64, 12], [9, 120, 77, 31, 250, 18, 44, 2, 61]]
NEW = 8


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def setup(request, tmp_path_factory):
    return make_base_and_adapters(tmp_path_factory.mktemp(f"lora-{request.param}"), request.param)


def make_scheduler(setup, names=("a1", "a2", "a3"), **lora_kw) -> Scheduler:
    base, _, adapters = setup
    cfg = LoraConfig(paths=tuple((n, str(adapters[n][0])) for n in names), **lora_kw)
    runner = ModelRunner(RunnerConfig(model_path=str(base), max_running_requests=16, max_total_tokens=2048,
                                      lora=cfg))
    return Scheduler(runner, SchedulerConfig(max_running_requests=16))


def greedy() -> SamplingParams:
    return SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)


def reference(setup, name, prompt) -> list[int]:
    _, hf, adapters = setup
    model = hf if name is None else adapters[name][1]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    return out[0, len(prompt):].tolist()


def run(s: Scheduler, reqs: dict[str, tuple[str | None, list[int]]]) -> dict[str, object]:
    for rid, (name, prompt) in reqs.items():
        s.add_request(rid, prompt, greedy(), lora_name=name)
    tokens, outs = {}, {}
    while s.has_work():
        for o in s.step():
            tokens.setdefault(o.rid, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                outs[o.rid] = o
    return {rid: (tokens.get(rid, []), outs[rid]) for rid in reqs}


def test_base_and_three_adapters_in_one_batch_equal_peft(setup):
    s = make_scheduler(setup)
    batches = []
    prepare = s.runner.lora.prepare
    s.runner.lora.prepare = lambda uids: batches.append(list(uids)) or prepare(uids)
    names = [None, "a1", "a2", "a3"]
    reqs = {f"r{i}-{j}": (n, p) for i, n in enumerate(names) for j, p in enumerate(PROMPTS)}
    got = run(s, reqs)
    assert len(set(batches[0])) == 4 and len(batches[0]) == len(reqs)  # one extend batch: base + 3 adapters
    for rid, (name, prompt) in reqs.items():
        assert got[rid][0] == reference(setup, name, prompt), (rid, name)
    # each adapter changes the output (the adapters are not no-ops)
    assert len({tuple(got[f"r{i}-0"][0]) for i in range(4)}) == 4


def test_prefill_logits_equal_peft(setup):
    _base, hf, adapters = setup
    s = make_scheduler(setup)
    runner = s.runner
    names = [None, "a1", "a2", "a3"]
    slots = runner.lora.prepare([runner.lora.uid(n) if n else None for n in names])
    prompt = PROMPTS[2]
    rows, locs = [], []
    for _ in names:
        row = runner.req_to_token_pool.alloc()
        loc = runner.allocator.alloc(len(prompt))
        runner.req_to_token_pool.write(row, 0, loc)
        rows.append(row)
        locs.append(loc)
    n = len(prompt)
    fb = runner.build_batch(ForwardMode.EXTEND, prompt * 4, rows, [n] * 4, torch.cat(locs), extend_seq_lens=[n] * 4,
                            lora_slots=slots)
    logits = runner.forward(fb)
    for i, name in enumerate(names):
        model = hf if name is None else adapters[name][1]
        with torch.no_grad():
            ref = model(torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(logits[i], ref, rtol=1e-4, atol=1e-4)


def test_prefix_cache_is_per_adapter(setup):
    s = make_scheduler(setup)
    prompt = PROMPTS[2] * 3
    order = [("x1", "a1"), ("x2", "a2"), ("x3", None), ("x4", "a1")]
    cached = {}
    for rid, name in order:  # one after another: each finds what the ones before left in the cache
        (tokens, out), = run(s, {rid: (name, prompt)}).values()
        cached[rid] = out.cached_tokens
        assert tokens == reference(setup, name, prompt), rid
    assert cached["x1"] == cached["x2"] == cached["x3"] == 0  # same prompt, another adapter: no shared KV
    assert cached["x4"] > 0  # the same adapter again: its own prefix is reused


def test_lru_eviction_and_the_per_batch_limit(setup):
    s = make_scheduler(setup, max_per_batch=2)
    lora = s.runner.lora
    distinct = []
    prepare = lora.prepare
    lora.prepare = lambda uids: distinct.append(len(set(uids) - {None})) or prepare(uids)
    for name in ("a1", "a2", "a3"):  # one at a time: a3 takes the least recently used slot (a1's)
        run(s, {f"seq-{name}": (name, PROMPTS[0])})
    assert lora.slot_of("a1") is None and lora.slot_of("a2") is not None and lora.slot_of("a3") is not None
    # three adapters and the base arriving together: never more than 2 adapters in a batch; all still exact
    reqs = {f"m{i}": (n, PROMPTS[1]) for i, n in enumerate(["a1", None, "a2", "a3", "a1"])}
    got = run(s, reqs)
    assert max(distinct) == 2
    for rid, (name, prompt) in reqs.items():
        assert got[rid][0] == reference(setup, name, prompt), rid


def test_unknown_adapter_fails_only_that_request(setup):
    s = make_scheduler(setup, names=("a1",))
    got = run(s, {"bad": ("nope", PROMPTS[0]), "good": ("a1", PROMPTS[0])})
    assert got["bad"][1].finish_reason.kind == "invalid" and "nope" in got["bad"][1].finish_reason.message
    assert got["good"][0] == reference(setup, "a1", PROMPTS[0])


def test_bad_adapters_are_one_line_errors_and_serving_goes_on(setup, tmp_path):
    _base, hf, adapters = setup
    s = make_scheduler(setup, names=("a1",), max_rank=8, target_modules=("q_proj", "v_proj", "o_proj"))
    lora = s.runner.lora
    big = save_adapter(hf, tmp_path / "big", seed=5, r=16, target_modules=["q_proj"])
    del big
    cases = {
        str(tmp_path / "big"): "rank 16 exceeds --max-lora-rank 8",
        str(adapters["a2"][0]): "not in --lora-target-modules",
        str(tmp_path / "missing"): "no adapter_config.json",
    }
    other = tmp_path / "other-shape"  # the same targets, but the other tiny model's hidden size
    (other).mkdir()
    for f in adapters["a1"][0].iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((other / "adapter_config.json").read_text())
    from safetensors.torch import load_file, save_file

    tensors = {k: torch.cat([v, v], dim=-1) if "lora_A" in k else v
               for k, v in load_file(other / "adapter_model.safetensors").items()}
    save_file(tensors, other / "adapter_model.safetensors")
    (other / "adapter_config.json").write_text(json.dumps(cfg))
    cases[str(other)] = "does not fit the model"
    for path, why in cases.items():
        with pytest.raises(LoraError, match=why) as e:
            lora.load("x", path)
        assert "\n" not in str(e.value)
    assert lora.names() == ["a1"]
    got = run(s, {"after": ("a1", PROMPTS[0])})
    assert got["after"][0] == reference(setup, "a1", PROMPTS[0])


def test_unload_refuses_an_adapter_in_use_then_frees_it(setup):
    s = make_scheduler(setup, names=("a1",))
    s.add_request("busy", PROMPTS[0], greedy(), lora_name="a1")
    assert "in use" in s.unload_lora("a1")
    while s.has_work():
        s.step()
    assert s.unload_lora("a1") is None and s.runner.lora.names() == []
    assert "not loaded" in s.unload_lora("a1")
