"""Qwen2.5-VL on a tiny random config saved by HF transformers (float32) matches HF: the vision tower's
embeddings, the M-RoPE positions, the first step's logits and 12 greedy tokens for prompts with one and with two
images, through the scheduler (also with prefill chunks that cut through an image)."""

from __future__ import annotations

import pytest
import torch

from model_executor.models.qwen2_5_vl import encoder_groups, max_image_patches, mrope_positions
from model_executor.sampling_params import SamplingParams
from runners.model_runner import ModelRunner, RunnerConfig
from scheduler.scheduler import Scheduler, SchedulerConfig
from tests.vlm_models import hf_inputs, image_inputs, make_image, save_tiny_qwen2_5_vl

NEW_TOKENS = 12
PROMPTS = {
    "one_image": ([(112, 84, 0)], "What is in this picture?"),
    "two_images": ([(56, 56, 1), (140, 112, 2)], "Compare the two pictures."),
}


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory, model_dir):
    path = tmp_path_factory.mktemp("tiny_qwen2_5_vl")
    return path, save_tiny_qwen2_5_vl(path, model_dir)


def _inputs(path, name):
    sizes, text = PROMPTS[name]
    return hf_inputs(path, [make_image(w, h, seed) for w, h, seed in sizes], text)


def _runner(path) -> ModelRunner:
    return ModelRunner(RunnerConfig(model_path=str(path), max_running_requests=4, max_total_tokens=2048,
                                    context_length=1024))


def _generate(runner, reqs: dict[str, dict], pad_id: int, chunk: int | None = None) -> dict[str, list[int]]:
    sched = Scheduler(runner, SchedulerConfig(max_running_requests=4, chunked_prefill_size=chunk))
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for rid, inputs in reqs.items():
        sched.add_request(rid, inputs["input_ids"][0].tolist(), params, images=image_inputs(inputs, pad_id))
    out = {rid: [] for rid in reqs}
    while sched.has_work():
        for o in sched.step():
            assert o.finish_reason is None or o.finish_reason.kind == "length", o.finish_reason
            out[o.rid] += o.new_token_ids
    return out


def _hf_generate(model, inputs) -> list[int]:
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_vision_tower_matches_hf(tiny_vl):
    path, hf = tiny_vl
    runner = _runner(path)
    inputs = _inputs(path, "two_images")
    grids = [tuple(g) for g in inputs["image_grid_thw"].tolist()]
    ours = runner.encode_images(list(inputs["pixel_values"].split([t * h * w for t, h, w in grids])), grids)
    with torch.no_grad():
        ref = hf.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
    assert [o.shape for o in ours] == [r.shape for r in ref]
    for o, r in zip(ours, ref):
        torch.testing.assert_close(o, r, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", list(PROMPTS))
def test_mrope_positions_match_hf(tiny_vl, name):
    path, hf = tiny_vl
    inputs = _inputs(path, name)
    pad_id = hf.config.image_token_id
    images = [(img.offset, img.grid_thw) for img in image_inputs(inputs, pad_id)]
    ours, delta = mrope_positions(inputs["input_ids"][0].tolist(), images, merge=2)
    ref, ref_delta = hf.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                             inputs["image_grid_thw"])
    assert torch.equal(ours, ref[:, 0]) and delta == int(ref_delta)


@pytest.mark.parametrize("name", list(PROMPTS))
def test_first_logits_match_hf(tiny_vl, name):
    path, hf = tiny_vl
    runner = _runner(path)
    inputs = _inputs(path, name)
    pad_id = hf.config.image_token_id
    captured = []
    real_forward = runner.forward
    runner.forward = lambda fb: captured.append(real_forward(fb).clone()) or captured[-1]
    sched = Scheduler(runner, SchedulerConfig(max_running_requests=4))
    sched.add_request("r", inputs["input_ids"][0].tolist(), SamplingParams(max_new_tokens=1, temperature=0.0),
                      images=image_inputs(inputs, pad_id))
    while sched.has_work():
        sched.step()
    with torch.no_grad():
        ref = hf(**inputs).logits[0, -1]
    torch.testing.assert_close(captured[0][0], ref, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("chunk", [None, 16], ids=["whole", "chunked"])
def test_greedy_tokens_match_hf(tiny_vl, chunk):
    """Both prompts in one batch (the vision tower encodes their three images together); with 16-token prefill
    chunks each image is cut across chunks."""
    path, hf = tiny_vl
    runner = _runner(path)
    reqs = {name: _inputs(path, name) for name in PROMPTS}
    ours = _generate(runner, reqs, hf.config.image_token_id, chunk)
    for name, inputs in reqs.items():
        assert ours[name] == _hf_generate(hf, inputs), name


def test_compiled_decode_with_images_matches_hf(tiny_vl):
    """The CPU's compiled decode (inductor, the decode graphs' analogue) reads each row's M-RoPE offset."""
    path, hf = tiny_vl
    runner = ModelRunner(RunnerConfig(model_path=str(path), max_running_requests=4, max_total_tokens=2048,
                                      context_length=1024, cuda_graph_bs=(1, 2, 4)))
    reqs = {name: _inputs(path, name) for name in PROMPTS}
    ours = _generate(runner, reqs, hf.config.image_token_id)
    assert runner.path_counts["decode_graph"] > 0
    for name, inputs in reqs.items():
        assert ours[name] == _hf_generate(hf, inputs), name


def test_images_that_do_not_fit_the_prompt_are_refused(tiny_vl, tiny_llama):
    """A request whose images do not match its pad tokens, or that carries images to a text-only model, ends
    "invalid" (a 400 for its client); the scheduler goes on."""
    import dataclasses

    path, hf = tiny_vl
    inputs = _inputs(path, "one_image")
    ids, images = inputs["input_ids"][0].tolist(), image_inputs(inputs, hf.config.image_token_id)
    sched = Scheduler(_runner(path), SchedulerConfig(max_running_requests=4))
    params = SamplingParams(max_new_tokens=2, temperature=0.0)
    sched.add_request("shifted", ids, params, images=[dataclasses.replace(images[0], offset=images[0].offset + 1)])
    sched.add_request("extra pad", ids + [hf.config.image_token_id], params, images=images)
    sched.add_request("fine", ids, params, images=images)
    text_only = Scheduler(ModelRunner(RunnerConfig(model_path=str(tiny_llama[0]), max_running_requests=2,
                                                   max_total_tokens=256, context_length=128)),
                          SchedulerConfig(max_running_requests=2))
    text_only.add_request("to text", [5, 6, 7], params, images=images)
    done = {}
    for s in (sched, text_only):
        while s.has_work():
            for o in s.step():
                if o.finish_reason is not None:
                    done[o.rid] = o.finish_reason
    assert {rid: r.kind for rid, r in done.items()} == {"shifted": "invalid", "extra pad": "invalid",
                                                          "fine": "length", "to text": "invalid"}
    assert "no images" in done["to text"].message


def test_vision_tower_calls_stay_within_one_largest_image(tiny_vl):
    """--mm-max-pixels bounds one tower call's patches: images beyond it go in further calls, same embeddings."""
    path, _ = tiny_vl
    inputs = _inputs(path, "two_images")  # 16 and 80 patches
    grids = [tuple(g) for g in inputs["image_grid_thw"].tolist()]
    pixels = list(inputs["pixel_values"].split([t * h * w for t, h, w in grids]))
    whole = _runner(path).encode_images(pixels, grids)
    assert max_image_patches(str(path)) == 28 * 28 * 64 // 196  # the processor's own bound
    runner = ModelRunner(RunnerConfig(model_path=str(path), max_running_requests=4, max_total_tokens=2048,
                                      context_length=1024, mm_max_pixels=20 * 196))
    split = runner.encode_images(pixels, grids)
    assert runner.path_counts["vision_encoder"] == 2
    for a, b in zip(whole, split):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert encoder_groups([(1, 4, 4), (1, 2, 2), (1, 8, 8), (1, 2, 2)], 20) == [[0, 1], [2], [3]]
