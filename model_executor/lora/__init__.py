"""Multi-LoRA serving: PEFT adapters, the device pool of adapter slots, the LoRA layer update and its kernels."""
