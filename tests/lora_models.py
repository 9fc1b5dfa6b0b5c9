"""Tiny random base models and PEFT LoRA adapters for the LoRA tests (saved with save_pretrained)."""

from __future__ import annotations

import torch

from tests.conftest import TINY_LLAMA, save_tiny_hf_model

TINY_QWEN3 = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
              "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2, "architectures": ["Qwen3ForCausalLM"],
              "model_type": "qwen3", "head_dim": 32, "rope_theta": 1e6, "tie_word_embeddings": True}
BASES = {"llama": TINY_LLAMA, "qwen3": TINY_QWEN3}

# Three adapters: different ranks, target sets, alphas (one rsLoRA).
ADAPTERS = {
    "a1": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    "a2": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                          "up_proj", "down_proj"]},
    "a3": {"r": 2, "lora_alpha": 4, "target_modules": ["o_proj", "down_proj"], "use_rslora": True},
}


def save_adapter(base_model, path, seed: int, **lora_kwargs):
    """A PEFT LoRA adapter of base_model with random non-zero A and B, saved to path; returns the PeftModel."""
    import copy

    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(base_model), LoraConfig(init_lora_weights=False, **lora_kwargs))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.2)
    peft_model.save_pretrained(path)
    return peft_model.eval()


def make_base_and_adapters(root, base: str = "llama"):
    """(base folder, base HF model, {name: (folder, PeftModel)}) under root."""
    base_path = root / base
    hf = save_tiny_hf_model(base_path, BASES[base], seed=3)
    adapters = {}
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        path = root / f"{base}-{name}"
        adapters[name] = (path, save_adapter(hf, path, seed=10 + i, **kw))
    return base_path, hf, adapters
