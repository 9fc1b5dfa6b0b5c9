"""The EAGLE-3 draft head (models/eagle3.py) against a plain PyTorch reference of its forward, on tiny random
checkpoints in the published layout; the target's aux hidden states against HF transformers'
output_hidden_states; loading (safetensors and *.bin) and its one-line errors."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from model_executor.forward_batch import ForwardMode
from model_executor.model_config import ModelConfig, ModelConfigError, WeightLoadError
from model_executor.models.eagle3 import aux_layer_ids, check_draft_fits_target
from model_executor.weight_loader import check_checkpoint
from runners.model_runner import ModelRunner, RunnerConfig
from tests.conftest import TINY_LLAMA, save_tiny_hf_model

# 8 layers: the default target layers (1, L/2 - 1, L - 4) are 1, 3 and 4, none of them the last (whose HF
# hidden state is taken after the final norm).
TARGET = dict(TINY_LLAMA, num_hidden_layers=8)
VOCAB, DRAFT_VOCAB, HIDDEN, HEADS, KV_HEADS = 320, 100, 64, 4, 2


def eagle3_config(**over) -> dict:
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "vocab_size": VOCAB,
            "draft_vocab_size": DRAFT_VOCAB, "hidden_size": HIDDEN, "intermediate_size": 96, "num_hidden_layers": 1,
            "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "max_position_embeddings": 512,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 1,
            "eos_token_id": 2, **over}


def eagle3_tensors(cfg: dict, seed: int = 0, own_embedding: bool = False) -> dict[str, torch.Tensor]:
    """Random weights under the published names; d2t / t2d map the draft vocabulary onto a random subset of the
    target's ids."""
    gen = torch.Generator().manual_seed(seed)
    h, hd = cfg["hidden_size"], cfg["hidden_size"] // cfg["num_attention_heads"]
    th, inter = cfg.get("target_hidden_size", h), cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

    def randn(*shape):
        return torch.randn(*shape, generator=gen) * 0.1

    def norm():
        return torch.rand(h, generator=gen) * 0.4 + 0.8

    t = {"fc.weight": randn(h, 3 * th), "midlayer.input_layernorm.weight": norm(),
         "midlayer.hidden_norm.weight": norm(), "midlayer.post_attention_layernorm.weight": norm(),
         "midlayer.self_attn.q_proj.weight": randn(q, 2 * h), "midlayer.self_attn.k_proj.weight": randn(kv, 2 * h),
         "midlayer.self_attn.v_proj.weight": randn(kv, 2 * h), "midlayer.self_attn.o_proj.weight": randn(h, q),
         "midlayer.mlp.gate_proj.weight": randn(inter, h), "midlayer.mlp.up_proj.weight": randn(inter, h),
         "midlayer.mlp.down_proj.weight": randn(h, inter), "norm.weight": norm(),
         "lm_head.weight": randn(cfg["draft_vocab_size"], h)}
    ids = torch.randperm(cfg["vocab_size"], generator=gen)[: cfg["draft_vocab_size"]].sort().values
    t["d2t"] = ids - torch.arange(cfg["draft_vocab_size"])
    t["t2d"] = torch.zeros(cfg["vocab_size"], dtype=torch.bool)
    t["t2d"][ids] = True
    if own_embedding:
        t["embed_tokens.weight"] = randn(cfg["vocab_size"], h) * 5
    return t


def save_eagle3(path, cfg: dict, tensors: dict[str, torch.Tensor], fmt: str = "safetensors"):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    if fmt == "safetensors":
        save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors")
    else:
        torch.save(tensors, path / "pytorch_model.bin")
    return path


# ---- the plain PyTorch reference -------------------------------------------------------------------------------
def rms(x, w, eps=1e-5):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, positions, theta, hd):
    """Llama's rotary (HF's rotate_half layout) on x [T, heads, hd]."""
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = positions[:, None].double() * inv[None]
    cos = torch.cat([ang.cos(), ang.cos()], -1).float()[:, None]
    sin = torch.cat([ang.sin(), ang.sin()], -1).float()[:, None]
    rotated = torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], -1)
    return x * cos + rotated * sin


def reference_eagle3(w: dict, cfg: dict, table: torch.Tensor, ids: list[int], g: torch.Tensor):
    """One sequence, all its tokens at once with causal attention (what a KV cache gives step by step): per token
    the draft logits [T, draft_vocab] and the output before the final norm [T, H]. g: each token's hidden input
    (fc of the target's states, or the previous output)."""
    t, heads, kvh = len(ids), cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg["hidden_size"] // heads
    pos = torch.arange(t)
    x = torch.cat([rms(table[ids], w["midlayer.input_layernorm.weight"]),
                   rms(g, w["midlayer.hidden_norm.weight"])], -1)
    q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(t, heads, hd)
    k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(t, kvh, hd)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(t, kvh, hd)
    q, k = rope(q, pos, cfg["rope_theta"], hd), rope(k, pos, cfg["rope_theta"], hd)
    k, v = k.repeat_interleave(heads // kvh, 1), v.repeat_interleave(heads // kvh, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(t, -1)
    h = g + o @ w["midlayer.self_attn.o_proj.weight"].T
    n = rms(h, w["midlayer.post_attention_layernorm.weight"])
    out = h + (F.silu(n @ w["midlayer.mlp.gate_proj.weight"].T) * (n @ w["midlayer.mlp.up_proj.weight"].T)) \
        @ w["midlayer.mlp.down_proj.weight"].T
    return rms(out, w["norm.weight"]) @ w["lm_head.weight"].T, out


# ---- duet's runs ------------------------------------------------------------------------------------------------
def prefill(runner: ModelRunner, prompts: list[list[int]]):
    rows = [runner.req_to_token_pool.alloc() for _ in prompts]
    lens = [len(p) for p in prompts]
    loc = runner.allocator.alloc(sum(lens))
    start = 0
    for row, n in zip(rows, lens):
        runner.req_to_token_pool.write(row, 0, loc[start : start + n])
        start += n
    fb = runner.build_batch(ForwardMode.EXTEND, [t for p in prompts for t in p], rows, lens, loc, extend_seq_lens=lens)
    return rows, fb


def decode_batch(runner: ModelRunner, rows: list[int], seq_lens: list[int], ids: list[int]):
    loc = runner.allocator.alloc(len(rows))
    return runner.build_batch(ForwardMode.DECODE, ids, rows, seq_lens, loc)


def draft_forward(runner: ModelRunner, fb, hidden):
    runner.attn_backend.init_forward_metadata(fb)
    with torch.inference_mode():
        return runner.model(fb.input_ids, fb.positions, fb, hidden)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("eagle3_target")
    hf = save_tiny_hf_model(path, TARGET, seed=3)
    runner = ModelRunner(RunnerConfig(model_path=str(path), max_running_requests=4, max_total_tokens=512))
    return path, hf, runner


def test_target_aux_hidden_states_match_hf(target):
    """The outputs of the EAGLE-3 layers (default: 1, 3, 4 of 8) equal HF's hidden_states[layer + 1], for a
    prefill of two prompts and a decode step after it; with capture off nothing is captured."""
    _, hf, runner = target
    ids = aux_layer_ids(ModelConfig.from_dict(eagle3_config(), draft=True), runner.model_config)
    assert ids == (1, 3, 4)
    runner.model.set_aux_hidden_state_layers(ids)
    try:
        prompts = [[5, 17, 230, 41, 9, 77, 3], [300, 12, 8]]
        rows, fb = prefill(runner, prompts)
        logits = runner.forward(fb)
        seqs = [p + [int(t)] for p, t in zip(prompts, logits.argmax(-1))]
        with torch.no_grad():
            hf_states = [hf(torch.tensor([s]), output_hidden_states=True).hidden_states for s in seqs]
        expected = [torch.cat([hs[i + 1][0] for i in ids], -1) for hs in hf_states]  # [0]: the embedding output
        assert fb.aux_hidden_states.shape == (10, 3 * TARGET["hidden_size"])
        got = fb.aux_hidden_states.split([len(p) for p in prompts])
        for g, e, p in zip(got, expected, prompts):
            assert (g - e[: len(p)]).abs().max() < 1e-4
        fb = decode_batch(runner, rows, [len(s) for s in seqs], [s[-1] for s in seqs])
        runner.forward(fb)
        for g, e in zip(fb.aux_hidden_states, expected):
            assert (g - e[-1]).abs().max() < 1e-4
        runner.model.set_aux_hidden_state_layers(None)
        fb = decode_batch(runner, rows, [len(s) + 1 for s in seqs], [1, 1])
        runner.forward(fb)
        assert fb.aux_hidden_states is None
    finally:
        runner.model.set_aux_hidden_state_layers(None)
        for row in rows:
            runner.req_to_token_pool.free(row)
    with pytest.raises(ValueError, match="distinct layers"):
        runner.model.set_aux_hidden_state_layers([1, 8, 2])


@pytest.mark.parametrize("variant", ["shared_embedding", "own_embedding", "tied"])
def test_draft_matches_reference(variant, target, tmp_path):
    """Prefill of two prompts from the target's aux hidden states, then two single-token draft steps on the KV
    cache, each from the head's own hidden state and its drafted token (mapped to the target vocabulary by d2t):
    duet's logits and hidden states equal the plain reference's. shared_embedding: the checkpoint has no
    embedding and reads the target's; own_embedding: a head of another width than its target (32) with its own;
    tied: a full-vocabulary head whose LM head is the (target's) embedding table."""
    _, _, target_runner = target
    own, tied = variant == "own_embedding", variant == "tied"
    cfg = eagle3_config(target_hidden_size=32) if own else eagle3_config()
    if tied:
        cfg = eagle3_config(draft_vocab_size=VOCAB, tie_word_embeddings=True)
    w = eagle3_tensors(cfg, seed=1, own_embedding=own)
    if tied:  # the published tied layout: no head, no map
        for name in ("lm_head.weight", "d2t", "t2d"):
            del w[name]
    runner = ModelRunner(RunnerConfig(model_path=str(save_eagle3(tmp_path / "head", cfg, w)), draft=True,
                                      max_running_requests=4, max_total_tokens=256))
    head = runner.model
    assert len(runner.kv_cache.k_buffers) == 1  # its own one-layer pool
    assert head.needs_target_embedding is not own
    head.share_target_embedding(target_runner.model)
    table = w["embed_tokens.weight"] if own else target_runner.model.model.embed_tokens.weight.detach()
    d2t_map = torch.arange(VOCAB) if tied else w["d2t"] + torch.arange(DRAFT_VOCAB)
    if tied:
        w["lm_head.weight"] = table

    prompts = [[5, 17, 230, 41, 9], [300, 12, 8]]
    if own:
        aux = [torch.randn(len(p), 96, generator=torch.Generator().manual_seed(i)) for i, p in enumerate(prompts)]
    else:  # the target's own states, captured by duet
        target_runner.model.set_aux_hidden_state_layers((1, 3, 4))
        t_rows, t_fb = prefill(target_runner, prompts)
        target_runner.forward(t_fb)
        target_runner.model.set_aux_hidden_state_layers(None)
        for row in t_rows:
            target_runner.req_to_token_pool.free(row)
        aux = list(t_fb.aux_hidden_states.split([len(p) for p in prompts]))

    rows, fb = prefill(runner, prompts)
    out = draft_forward(runner, fb, torch.cat(aux))
    assert out.logits.shape == (2, cfg["draft_vocab_size"])
    seqs = [list(p) for p in prompts]
    g = [a @ w["fc.weight"].T for a in aux]  # the reference's per-token hidden inputs
    last = (fb.extend_start_loc + fb.extend_seq_lens - 1).long()
    hidden_next = out.hidden[last]
    for step in range(3):  # the prefill, then two draft steps
        for i in range(2):
            ref_logits, ref_out = reference_eagle3(w, cfg, table, seqs[i], g[i])
            assert (out.logits[i] - ref_logits[-1]).abs().max() < 1e-4, (step, i)
            assert (hidden_next[i] - ref_out[-1]).abs().max() < 1e-4, (step, i)
            if step == 0:  # every prompt token's hidden state too
                assert (out.hidden[fb.extend_start_loc[i] : last[i] + 1] - ref_out).abs().max() < 1e-4
            tok = int(d2t_map[ref_logits[-1].argmax()])
            assert tok == int(head.to_target_ids(out.logits[i].argmax()))
            seqs[i].append(tok)
            g[i] = torch.cat([g[i], ref_out[-1:]])
        if step == 2:
            break
        fb = decode_batch(runner, rows, [len(s) for s in seqs], [s[-1] for s in seqs])
        out = draft_forward(runner, fb, hidden_next)
        hidden_next = out.hidden


def test_bin_checkpoint_loads_like_safetensors(tmp_path):
    """A pytorch_model.bin head loads the same tensors as its safetensors twin, and both pass the header check."""
    cfg = eagle3_config()
    w = eagle3_tensors(cfg, seed=2)
    for fmt in ("safetensors", "bin"):
        check_checkpoint(save_eagle3(tmp_path / fmt, cfg, w, fmt), ModelConfig.from_dict(cfg, draft=True))
    models = [ModelRunner(RunnerConfig(model_path=str(save_eagle3(tmp_path / fmt, cfg, w, fmt)), draft=True,
                                       max_running_requests=1, max_total_tokens=16)).model
              for fmt in ("safetensors", "bin")]
    a, b = (dict(m.named_parameters()) for m in models)
    assert a.keys() == b.keys() and "midlayer.self_attn.qkv_proj.weight" in a
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert torch.equal(models[1].draft_to_target, w["d2t"] + torch.arange(DRAFT_VOCAB))
    qkv = torch.cat([w[f"midlayer.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(b["midlayer.self_attn.qkv_proj.weight"], qkv)


def test_config_errors(tmp_path, target):
    runner = target[2]
    head = save_eagle3(tmp_path / "head", eagle3_config(), eagle3_tensors(eagle3_config()))
    with pytest.raises(ModelConfigError, match="EAGLE-3 draft head, not a model to serve"):
        ModelRunner(RunnerConfig(model_path=str(head), max_running_requests=1, max_total_tokens=16))
    tcfg = runner.model_config

    def fits(**over):
        check_draft_fits_target(ModelConfig.from_dict(eagle3_config(**over), draft=True), tcfg)

    fits()
    with pytest.raises(ModelConfigError, match="reads hidden states of width 32 .* target's hidden_size is 64"):
        fits(target_hidden_size=32)
    with pytest.raises(ModelConfigError, match="vocab_size 330 is not the target's 320"):
        fits(vocab_size=330)
    with pytest.raises(ModelConfigError, match=r"config's: \[1, 3, 8\].*of the target's 8"):
        fits(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 8]})
    shallow = ModelConfig.from_dict(dict(TARGET, num_hidden_layers=4))
    with pytest.raises(ModelConfigError, match=r"the default: \[1, 1, 0\]"):
        aux_layer_ids(ModelConfig.from_dict(eagle3_config(), draft=True), shallow)
    with pytest.raises(ModelConfigError, match="3 distinct target layers"):
        ModelConfig.from_dict(eagle3_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 2, 5]}), draft=True)
    # vLLM's top-level key counts layer inputs: 2, 4, 5 are the outputs of layers 1, 3, 4
    cfg = ModelConfig.from_dict(eagle3_config(eagle_aux_hidden_state_layer_ids=[2, 4, 5]), draft=True)
    assert aux_layer_ids(cfg, tcfg) == (1, 3, 4)
    # a head serves its target's context, past its own max_position_embeddings (512)
    assert ModelConfig.from_dict(eagle3_config(), draft=True).check_context_length(4096) == 4096
    with pytest.raises(ModelConfigError, match="draft_vocab_size 400"):
        ModelConfig.from_dict(eagle3_config(draft_vocab_size=400), draft=True)


@pytest.mark.parametrize("case", ["no_d2t", "bad_t2d", "bad_d2t", "no_embedding", "fc_shape"])
def test_checkpoint_errors(case, tmp_path):
    cfg = eagle3_config(target_hidden_size=32) if case == "no_embedding" else eagle3_config()
    w = eagle3_tensors(cfg)
    match = {"no_d2t": "has no tensor 'd2t'", "bad_t2d": "'t2d' and 'd2t' name different",
             "bad_d2t": "'d2t' maps draft ids outside", "no_embedding": "has no tensor 'embed_tokens.weight'",
             "fc_shape": "'fc.weight' .* does not fit"}[case]
    if case == "no_d2t":
        del w["d2t"]
    elif case == "bad_t2d":
        w["t2d"][w["t2d"].nonzero()[0]] = False
        w["t2d"][w["t2d"].logical_not().nonzero()[0]] = True
    elif case == "bad_d2t":
        w["d2t"][-1] += VOCAB
    elif case == "fc_shape":
        w["fc.weight"] = w["fc.weight"][:, :96]
    path = save_eagle3(tmp_path / "head", cfg, w)
    if case in ("no_d2t", "no_embedding", "fc_shape"):  # what the header check sees (shapes, names)
        with pytest.raises(WeightLoadError, match=match):
            check_checkpoint(path, ModelConfig.from_pretrained(path, draft=True))
    with pytest.raises(WeightLoadError, match=match):
        ModelRunner(RunnerConfig(model_path=str(path), draft=True, max_running_requests=1, max_total_tokens=16))


def test_forward_needs_an_embedding(tmp_path):
    path = save_eagle3(tmp_path / "head", eagle3_config(), eagle3_tensors(eagle3_config()))
    runner = ModelRunner(RunnerConfig(model_path=str(path), draft=True, max_running_requests=1, max_total_tokens=16))
    _, fb = prefill(runner, [[5, 6]])
    with pytest.raises(RuntimeError, match="share_target_embedding"):
        draft_forward(runner, fb, torch.zeros(2, 3 * HIDDEN))
