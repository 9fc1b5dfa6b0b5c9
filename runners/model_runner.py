"""ModelRunner: owns the model, the KV pools, the attention backend, the sampler and the graph runners,
and sends each batch down one path (decode graph / decode eager / extend graph / extend eager)."""

from __future__ import annotations

import array
import gc
import logging
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from model_executor.distributed import parallel_state as ps
from model_executor.forward_batch import ForwardBatch, ForwardMode, MultimodalBatch
from model_executor.layers.attention import create_attention_backend, resolve_backend_name
from model_executor.layers.quantization import QuantizationError, resolve_quant_config
from model_executor.layers.quantization.config import FP8_KV_BACKENDS
from model_executor.layers.triton_ops import small_m_gemm_dispatch
from model_executor.lora.layer import LoraBatch
from model_executor.lora.manager import LoraConfig, LoraManager
from model_executor.memory_pool import KVCache, ReqToTokenPool, SlotAllocator
from model_executor.model_config import ModelConfig
from model_executor.models.qwen2_5_vl import encoder_groups, max_image_patches
from model_executor.sampler import SampleOutput, Sampler, SamplingBatchInfo
from model_executor.sampling_flashinfer import create_flashinfer_sampler
from model_executor.sampling_params import SamplingParams
from model_executor.speculative_sampling import VerifyOutput, verify_drafts
from model_executor.weight_loader import build_model, init_random_weights, load_model, weight_bytes
from runners.memory_plan import MemorySplit, estimate_graph_reserve, plan_kv_cache

logger = logging.getLogger("duet.model_runner")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RunnerConfig:
    """What the model runner needs; the server builds it once from its flags (server/scheduler_entry.py),
    tests and benchmarks directly."""

    model_path: str
    device: str = "cpu"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on GPU
    attention_backend: str = "auto"  # auto: torch_native on CPU, triton (or flashinfer) on GPU
    context_length: int | None = None
    max_running_requests: int = 64
    max_total_tokens: int | None = None  # KV slots; None: from memory (GPU) or a CPU budget
    mem_fraction_static: float = 0.85
    max_prefill_tokens: int = 16384  # the largest eager extend: its activation peak is profiled (GPU)
    random_weights: bool = False  # benchmarks / GPU tests: real shapes, random weights
    seed: int = 0
    # Graph runners. On CPU the decode list is compiled by inductor (runners/cpu_graph_runner.py) and the
    # piecewise extend settings are ignored.
    disable_cuda_graph: bool = False
    cuda_graph_bs: tuple[int, ...] = ()  # resolved capture list; empty = no decode graphs
    cpu_graph_dynamic: bool = True  # CPU: one trace with a symbolic batch instead of one per size
    disable_piecewise_cuda_graph: bool = False
    piecewise_cuda_graph_tokens: tuple[int, ...] = ()
    # Extend levels up to this many tokens also get a whole-backbone graph (attention inside) where the backend
    # allows it (runners/full_extend_graph_runner.py); 0: none. Only with the piecewise levels.
    full_extend_graph_max_tokens: int = 0
    enable_torch_compile: bool = False
    # Every linear on its plain path (cuBLAS / the W8A8 GEMM), never the small-M GEMM kernel
    # (model_executor/layers/triton_ops/small_m_gemm_dispatch.py).
    disable_small_m_gemm: bool = False
    # Tensor parallelism: this process is rank tp_rank of tp_size, joining at dist_init_method
    # (tcp://host:port); device is this rank's own GPU (cuda:N) on CUDA.
    tp_rank: int = 0
    tp_size: int = 1
    dist_init_method: str | None = None
    dist_timeout_s: float = ps.DEFAULT_TIMEOUT_S
    custom_all_reduce: bool = True  # CUDA, one host: small sums through the one-shot kernel (parallel_state)
    quantization: str | None = None  # none / fp8 / int8; None: the checkpoint's
    kv_cache_dtype: str = "auto"  # auto (the model dtype) or fp8_e4m3
    # The server passes --sampling-backend (default auto: flashinfer on a GPU when installed, for the unseeded
    # random rows). In-process users (tests, benchmarks) opt in: flashinfer 0.5.3 compiles its sampling
    # kernels with nvcc on a machine's first use, minutes that a test or a greedy benchmark should not pay.
    sampling_backend: str = "pytorch"
    # An embedding server's model (--is-embedding): the backbone's hidden states are its output, its LM head is
    # never read (model_executor/models/llama.LlamaEmbeddingModel).
    embedding_only: bool = False
    # A speculative draft model: its folder may hold a draft head (an EAGLE-3 head's architecture is accepted).
    draft: bool = False
    # Multi-LoRA serving (model_executor/lora/): the adapters' pool and flags; None: off.
    lora: LoraConfig | None = None
    # Speculative decoding: the most tokens a request verifies in one pass (its last token and its drafts); > 0
    # captures verify graphs (runners/verify_graph_runner.py) at the decode sizes up to speculative_max_bs.
    speculative_tokens: int = 0
    speculative_max_bs: int = 0
    # An EAGLE-3 target: the layers whose outputs every forward also gives (ForwardBatch.aux_hidden_states),
    # set before the graphs are captured so that they give them too.
    aux_hidden_state_layers: tuple[int, ...] = ()
    # A vision-language model: the image processor's max pixels per image (--mm-max-pixels; None: the model
    # folder's preprocessor_config.json). One vision-tower call takes images of at most one largest image's
    # patches, and the GPU memory profile runs the tower on that many.
    mm_max_pixels: int | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.float32 if torch.device(self.device).type == "cpu" else torch.bfloat16
        return DTYPES[self.dtype]


CPU_DEFAULT_MAX_TOTAL_TOKENS = 16384


def int64_tensor(values: list[int]) -> torch.Tensor:
    """A host int64 tensor of values: through array.array (a C loop), several times faster than torch.tensor
    on a Python list of a few hundred ints. The tensor shares the array's memory and keeps it alive."""
    if not values:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)


class ModelRunner:
    def __init__(self, config: RunnerConfig):
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.model_config = ModelConfig.from_pretrained(config.model_path, draft=config.draft)
        if config.embedding_only:
            self.model_config = replace(self.model_config, embedding_only=True)
        self.context_len = self.model_config.check_context_length(config.context_length)
        self.quant = resolve_quant_config(config.quantization, self.model_config.hf_config, self.device.type,
                                          self.dtype)
        self.kv_dtype = self._kv_cache_dtype()
        cuda = self.device.type == "cuda"
        if cuda and self.device.index is not None:
            torch.cuda.set_device(self.device)  # a TP/DP rank's own GPU: NCCL and the graph pools use it
        if config.tp_size > 1 and config.dist_init_method is None:
            raise ValueError("tensor parallelism needs dist_init_method")
        ps.init_tensor_parallel(config.tp_rank, config.tp_size, config.dist_init_method or "", self.device,
                                config.dist_timeout_s, config.custom_all_reduce)
        # The small-M GEMM path on or off, and its start-up line: the table file this GPU uses, or a warning.
        small_m_gemm_dispatch.configure(not config.disable_small_m_gemm, self.device)
        self.tp_rank, self.tp_size = config.tp_rank, config.tp_size
        cfg = self.model_config
        self.num_kv_heads = ps.kv_heads_per_rank(cfg.num_key_value_heads, config.tp_size)  # this rank's KV heads
        base = 0
        if cuda:
            # An earlier runner in this process (tests, benchmarks) may be garbage that only the cycle collector
            # frees: freed later (a capture collects), its memory would come off this runner's measurements.
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)  # what others in this process hold already
        t0 = time.perf_counter()
        if config.random_weights:
            model = build_model(self.model_config, self.dtype, self.device, max_positions=self.context_len,
                                quant=self.quant)
            self.model = init_random_weights(model, config.seed)
        else:
            self.model = load_model(Path(config.model_path), self.model_config, self.dtype, self.device,
                                    max_positions=self.context_len, quant=self.quant)
        self.load_seconds = time.perf_counter() - t0
        if config.aux_hidden_state_layers:
            self.model.set_aux_hidden_state_layers(config.aux_hidden_state_layers)
        # The adapters' device pool, allocated once beside the weights (before the KV cache takes the rest).
        self.lora = LoraManager(config.lora, self.model, self.dtype, self.device) if config.lora else None
        self.profile_seconds: float | None = None  # the activation profile's (a GPU runs one)
        # Peak device memory while loading (the weights plus what streaming needed on top of them).
        self.load_peak_bytes = torch.cuda.max_memory_allocated(self.device) - base if cuda else 0
        logger.info("loaded %s (%s%s, %s) in %.1f s", config.model_path, self.dtype,
                    f", {self.quant.method} weights" if self.quant else "", self.device, self.load_seconds)
        self.req_to_token_pool = ReqToTokenPool(config.max_running_requests, self.context_len, self.device)
        self.image_patch_budget: int | None = None
        if getattr(self.model, "uses_mrope", False):  # each request row's M-RoPE decode offset
            self.model.mrope_deltas = torch.zeros(self.req_to_token_pool.size + 1, dtype=torch.int64,
                                                  device=self.device)
            self.image_patch_budget = max_image_patches(config.model_path, config.mm_max_pixels)
        # The token each request row sampled last, kept on the device: a decode step reads its input ids
        # from here, so the next step can be launched before the previous one's tokens reach the host.
        self.last_token_ids = torch.zeros(self.req_to_token_pool.size + 1, dtype=torch.int64, device=self.device)
        self.pin_memory = self.device.type == "cuda"
        # The backend's workspaces do not depend on the KV size: allocated first, they count as in use.
        self.attn_backend = create_attention_backend(config.attention_backend, self)
        self.sampler = Sampler(create_flashinfer_sampler(config.sampling_backend, self.device))
        self.memory_split = self._plan_memory()
        if self.lora is not None:
            pool = self.lora.pool_bytes
            self.memory_split = replace(self.memory_split, lora=pool, other=max(self.memory_split.other - pool, 0)
                                        if cuda else 0)
        num_slots = self.memory_split.num_slots
        k_scales, v_scales = self._kv_scales()
        self.kv_cache = KVCache(num_slots, cfg.num_hidden_layers, self.num_kv_heads, cfg.head_dim,
                                self.kv_dtype, self.device, k_scales, v_scales)
        self.allocator = SlotAllocator(num_slots)
        self.path_counts: Counter[str] = Counter()
        self.decode_graph_runner = None
        self.extend_graph_runner = None
        self.full_extend_graph_runner = None
        self.verify_graph_runner = None
        self.init_graph_runners()
        if cuda:
            captured = sum(r.capture_bytes for r in self._graph_runners() if r)
            self.memory_split = replace(self.memory_split, graphs_measured=captured)
        logger.info(self.memory_split.line())

    def _graph_runners(self) -> tuple:
        return (self.decode_graph_runner, self.extend_graph_runner, self.full_extend_graph_runner,
                self.verify_graph_runner)

    @property
    def aux_hidden_state_layers(self) -> tuple[int, ...]:
        backbone = getattr(self.model, "model", None)
        return tuple(getattr(backbone, "aux_layer_ids", ()))

    def set_aux_hidden_state_layers(self, layer_ids) -> None:
        """Every forward from now on also gives these layers' outputs (an EAGLE-3 target,
        LlamaForCausalLM.set_aux_hidden_state_layers). Graphs captured without them are captured again (a server
        names the layers in RunnerConfig, before the first capture)."""
        if tuple(layer_ids or ()) == self.aux_hidden_state_layers:
            return
        self.model.set_aux_hidden_state_layers(layer_ids)
        if any(self._graph_runners()):
            logger.info("capturing the graphs again: they now give the hidden states of layers %s", list(layer_ids))
            self.decode_graph_runner = self.extend_graph_runner = None
            self.full_extend_graph_runner = self.verify_graph_runner = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.init_graph_runners()

    def init_graph_runners(self) -> None:
        """Capture decode graphs, then extend pieces, then whole extend graphs at the small levels; each is
        skipped when disabled or unsupported."""
        cfg = self.config
        if self.lora is not None and self.device.type == "cpu":
            logger.info("LoRA: decode runs eagerly on a CPU (the inductor decode graphs take no adapters)")
            return
        if self.device.type == "cpu":  # the CPU analogue: decode compiled by inductor; no extend pieces
            if not cfg.disable_cuda_graph and cfg.cuda_graph_bs:
                from runners.cpu_graph_runner import CpuGraphRunner

                self.decode_graph_runner = CpuGraphRunner(self, list(cfg.cuda_graph_bs), dynamic=cfg.cpu_graph_dynamic)
            return
        if not cfg.disable_cuda_graph and cfg.cuda_graph_bs:
            if self.attn_backend.supports_cuda_graph:
                from runners.cuda_graph_runner import CudaGraphRunner

                self.decode_graph_runner = CudaGraphRunner(self, list(cfg.cuda_graph_bs))
            else:
                logger.warning("%s cannot run in CUDA graphs: decode runs eagerly", type(self.attn_backend).__name__)
        self._init_verify_graphs()
        if cfg.disable_piecewise_cuda_graph or not cfg.piecewise_cuda_graph_tokens:
            return
        # (from the list itself, not the pieces' levels: those start at 2, and a one-token extend, a prompt cached
        # but for its last token, takes a whole graph of one token, the GEMM rows eager runs)
        full_levels = sorted({t for t in cfg.piecewise_cuda_graph_tokens if t <= cfg.full_extend_graph_max_tokens})
        capturer = None
        if self.aux_hidden_state_layers:
            # The pieces are traced: a forward's aux hidden states (a side output) do not come out of them.
            logger.info("EAGLE-3 target: extends over %d tokens run eagerly (no piecewise pieces)",
                        cfg.full_extend_graph_max_tokens if full_levels else 0)
        else:
            # Attention runs eagerly between the pieces, so every backend works here.
            from runners.piecewise_cuda_graph_runner import PiecewiseCudaGraphRunner

            self.extend_graph_runner = PiecewiseCudaGraphRunner(self, list(cfg.piecewise_cuda_graph_tokens))
            capturer = self.extend_graph_runner.capturer
        if full_levels and self.attn_backend.supports_extend_cuda_graph:
            from runners.full_extend_graph_runner import FullExtendGraphRunner

            self.full_extend_graph_runner = FullExtendGraphRunner(self, full_levels, capturer=capturer)
        elif full_levels and self.extend_graph_runner is not None:
            logger.info("%s runs extend attention outside graphs: extends replay piecewise only",
                        type(self.attn_backend).__name__)

    def _init_verify_graphs(self) -> None:
        cfg = self.config
        sizes = [bs for bs in cfg.cuda_graph_bs if bs <= cfg.speculative_max_bs]
        if cfg.disable_cuda_graph or not cfg.speculative_tokens or not sizes:
            return
        if not self.attn_backend.supports_extend_cuda_graph:
            logger.info("%s runs extend attention outside graphs: verify batches replay as extends",
                        type(self.attn_backend).__name__)
            return
        from runners.verify_graph_runner import VerifyGraphRunner

        # Into the decode graphs' pool: a verify step's graph and a decode step's never run at once.
        capturer = self.decode_graph_runner.capturer if self.decode_graph_runner is not None else None
        self.verify_graph_runner = VerifyGraphRunner(self, sizes, cfg.speculative_tokens, capturer=capturer)

    def _kv_cache_dtype(self) -> torch.dtype:
        """The KV pool's dtype; an FP8 pool needs an sm89+ GPU and the triton or flashinfer backend (their
        kernels read FP8 K/V with the pool's scales)."""
        if self.config.kv_cache_dtype == "auto":
            return self.dtype
        if self.config.kv_cache_dtype != "fp8_e4m3":
            raise QuantizationError(f"--kv-cache-dtype must be auto or fp8_e4m3, got {self.config.kv_cache_dtype!r}")
        from model_executor.layers.quantization.config import fp8_unsupported_reason

        why = fp8_unsupported_reason(self.device.type)
        if why:
            raise QuantizationError(f"--kv-cache-dtype fp8_e4m3 {why}")
        backend = resolve_backend_name(self.config.attention_backend, self.device.type)
        if backend not in FP8_KV_BACKENDS:
            raise QuantizationError(f"--kv-cache-dtype fp8_e4m3 runs with the triton or flashinfer attention backend, "
                                    f"not {backend}")
        return torch.float8_e4m3fn

    def _kv_scales(self) -> tuple[list[float] | None, list[float] | None]:
        """The checkpoint's per-layer KV scales for an FP8 pool (1.0 everywhere when it has none)."""
        scales = getattr(self.model, "kv_scales", None)
        if scales is None:
            return None, None
        if self.kv_dtype != torch.float8_e4m3fn:
            logger.info("the checkpoint's KV-cache scales are not used: the KV cache is %s (--kv-cache-dtype "
                        "fp8_e4m3 uses them)", self.kv_dtype)
            return None, None
        return scales

    @property
    def num_kv_slots(self) -> int:
        return self.allocator.num_slots

    def _plan_memory(self) -> MemorySplit:
        split = self._plan_memory_local()
        # Every rank's scheduler makes the same decisions over the same slots: the smallest pool rules.
        slots = ps.all_reduce_min_int(split.num_slots)
        if slots != split.num_slots:
            split = replace(split, num_slots=slots, kv=split.kv // split.num_slots * slots)
        return split

    def _plan_memory_local(self) -> MemorySplit:
        cfg = self.model_config
        per_slot = KVCache.bytes_per_slot(cfg.num_hidden_layers, self.num_kv_heads, cfg.head_dim, self.kv_dtype)
        weights = weight_bytes(self.model)
        if self.device.type != "cuda":
            slots = self.config.max_total_tokens or CPU_DEFAULT_MAX_TOTAL_TOKENS
            return MemorySplit(device=str(self.device), weights=weights, kv=slots * per_slot, num_slots=slots)
        torch.cuda.empty_cache()  # blocks cached during loading are free memory for the KV cache
        t0 = time.perf_counter()
        tokens, activations = self._profile_activations()
        self.profile_seconds = time.perf_counter() - t0
        free, total = torch.cuda.mem_get_info(self.device)
        graphs = estimate_graph_reserve(
            activation_bytes_per_token=activations / max(tokens, 1),
            decode_max_bs=0 if self.config.disable_cuda_graph else max(self.config.cuda_graph_bs, default=0),
            vocab_size=cfg.vocab_size,
            extend_max_tokens=(0 if self.config.disable_piecewise_cuda_graph
                               else max(self.config.piecewise_cuda_graph_tokens, default=0)),
            backend_bytes=self.attn_backend.cuda_graph_state_bytes(max(self.config.cuda_graph_bs, default=0)),
            verify_max_tokens=self.config.speculative_tokens * self.config.speculative_max_bs)
        return plan_kv_cache(total=total, free=free, weights=weights, activations=activations, graphs=graphs,
                             fraction=self.config.mem_fraction_static, bytes_per_slot=per_slot,
                             max_total_tokens=self.config.max_total_tokens, device=str(self.device))

    @torch.inference_mode()
    def _profile_activations(self) -> tuple[int, int]:
        """Run the largest eager extend (--max-prefill-tokens tokens over as many requests as may run, so
        the logits and the sampler are at their largest too); returns (tokens, peak bytes above what was
        allocated before it, not counting its own KV cache). A real batch in every way: each token writes
        and reads its own slot of a profile-sized KV cache, through the request rows it will use later."""
        n = min(self.config.max_prefill_tokens, self.req_to_token_pool.size * self.context_len)
        bs = min(self.req_to_token_pool.size, n)
        lens = [n // bs + (1 if i < n % bs else 0) for i in range(bs)]
        cfg = self.model_config
        kv = KVCache(n, cfg.num_hidden_layers, self.num_kv_heads, cfg.head_dim, self.kv_dtype, self.device)
        rows, slots, start = list(range(1, bs + 1)), torch.arange(n, device=self.device), 0
        for row, length in zip(rows, lens):
            self.req_to_token_pool.write(row, 0, slots[start : start + length])
            start += length
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        fb = ForwardBatch.build(
            ForwardMode.EXTEND, [0] * n, rows, lens, slots, extend_seq_lens=lens,
            req_to_token_pool=self.req_to_token_pool, kv_cache=kv, attn_backend=self.attn_backend,
            device=self.device)
        if getattr(self.model, "aux_width", None):  # an EAGLE-3 head: its forward reads the target's hidden states
            self.attn_backend.init_forward_metadata(fb)
            aux = torch.zeros(n, self.model.aux_width, dtype=self.dtype, device=self.device)
            logits = self.model(fb.input_ids, fb.positions, fb, aux).logits
        else:
            logits = self.forward_eager(fb)
        params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.05)] * bs
        self.sample(logits, params, [0] * bs)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        if self.image_patch_budget:  # the vision tower on its largest call (it runs before the extend)
            del logits
            torch.cuda.reset_peak_memory_stats(self.device)
            self.model.encode_images(*self._largest_image())
            torch.cuda.synchronize(self.device)
            peak = max(peak, torch.cuda.max_memory_allocated(self.device) - base)
        self.req_to_token_pool.req_to_token[1 : bs + 1].zero_()
        self.req_to_token_pool.req_to_token_cpu[1 : bs + 1].zero_()
        del kv, fb, logits
        torch.cuda.empty_cache()
        logger.info("profiled an extend of %d tokens in %d requests: activation peak %.2f GiB", n, bs, peak / 2**30)
        return n, peak

    def _largest_image(self) -> tuple[list[torch.Tensor], list[tuple[int, int, int]]]:
        """A square image of image_patch_budget patches at most (random pixels): the memory profile's."""
        vc = self.model_config.hf_config["vision_config"]
        merge = vc["spatial_merge_size"]
        side = max(int(self.image_patch_budget ** 0.5) // merge * merge, merge)
        dim = vc.get("in_channels", 3) * vc["temporal_patch_size"] * vc["patch_size"] ** 2
        return [torch.randn(side * side, dim)], [(1, side, side)]

    # ---- batches ------------------------------------------------------------------------------
    def build_batch(self, mode: ForwardMode, input_ids: list[int] | None, req_pool_indices: list[int],
                    seq_lens: list[int], out_cache_loc: torch.Tensor,
                    extend_seq_lens: list[int] | None = None, num_decode_tail: int = 0,
                    lora_slots: list[int] | None = None, mm: MultimodalBatch | None = None,
                    mrope_deltas: list[int] | None = None) -> ForwardBatch:
        """An extend batch from host lists, or a decode batch; a decode batch also records its new slots in
        the request rows, and with input_ids None it reads each row's last sampled token on the device. In an
        extend batch, the last `num_decode_tail` requests take one decode step (one token each, whose id is
        read the same way; their entries in input_ids are placeholders). lora_slots: each request's LoRA pool slot
        (LoraManager.prepare; 0: the base model). An extend batch of a multimodal model: mm, its positions and
        image embeddings (host tensors; None: a text batch), and each request's M-RoPE decode offset, kept in
        the model for the request's row."""
        if mode.is_decode():
            fb = self._build_decode(input_ids, req_pool_indices, seq_lens, out_cache_loc)
            if lora_slots is not None:
                fb.lora = LoraBatch.build(lora_slots, None, self.device)
            return fb
        fb = ForwardBatch.build(
            mode, input_ids, req_pool_indices, seq_lens, out_cache_loc, extend_seq_lens=extend_seq_lens,
            req_to_token_pool=self.req_to_token_pool, kv_cache=self.kv_cache, attn_backend=self.attn_backend,
            device=self.device)
        if num_decode_tail:
            fb.input_ids[-num_decode_tail:] = self.last_token_ids[fb.req_pool_indices[-num_decode_tail:]]
        if mrope_deltas is not None and getattr(self.model, "uses_mrope", False):
            self.model.mrope_deltas[fb.req_pool_indices] = torch.tensor(mrope_deltas, dtype=torch.int64,
                                                                        device=self.device)
        if mm is not None:
            dev = self.device
            fb.mm = MultimodalBatch(mm.positions.to(dev), None if mm.embed_rows is None else mm.embed_rows.to(dev),
                                    None if mm.embeds is None else mm.embeds.to(dev))
        if lora_slots is not None:
            fb.lora = LoraBatch.build(lora_slots, extend_seq_lens, self.device)
        return fb

    def _build_decode(self, input_ids: list[int] | None, rows: list[int], seq_lens: list[int],
                      out_cache_loc: torch.Tensor) -> ForwardBatch:
        bs = len(rows)
        # One (pinned, non-blocking) host-to-device copy for the rows, lengths and slots of the step.
        # The slots are a host tensor already: joined as one, not turned into a list and back.
        parts = [int64_tensor(rows + seq_lens), out_cache_loc.to(torch.int64)]
        if input_ids is not None:
            parts.append(torch.tensor(input_ids, dtype=torch.int64))
        if self.pin_memory:
            host = torch.cat(parts, out=torch.empty(sum(t.numel() for t in parts), dtype=torch.int64,
                                                    pin_memory=True))
        else:
            host = torch.cat(parts)
        dev = host.to(self.device, non_blocking=True)
        rows_d, seq_lens_d, slots_d = dev[:bs], dev[bs : 2 * bs], dev[2 * bs : 3 * bs]
        positions = host[bs : 2 * bs] - 1
        positions_d = positions if dev is host else seq_lens_d - 1
        # The host mirror is indexed with host tensors (Python lists as indices cost a conversion per element).
        self.req_to_token_pool.write_decode(host[:bs], positions, out_cache_loc, rows_d, positions_d, slots_d)
        return ForwardBatch(
            mode=ForwardMode.DECODE, batch_size=bs,
            input_ids=self.last_token_ids[rows_d] if input_ids is None else dev[3 * bs :],
            positions=positions_d, req_pool_indices=rows_d, seq_lens=seq_lens_d,
            out_cache_loc=slots_d, req_to_token_pool=self.req_to_token_pool, kv_cache=self.kv_cache,
            attn_backend=self.attn_backend, seq_lens_cpu=list(seq_lens))

    def build_verify_batch(self, input_ids: list[int], req_pool_indices: list[int], seq_lens: list[int],
                           out_cache_loc: torch.Tensor, extend_seq_lens: list[int]) -> ForwardBatch:
        """A speculative verify batch: each request's [last sampled token, drafts...] at consecutive positions
        after its KV prefix (an extend, causal within the request's tokens), with logits at every token."""
        fb = self.build_batch(ForwardMode.EXTEND, input_ids, req_pool_indices, seq_lens, out_cache_loc,
                              extend_seq_lens=extend_seq_lens)
        fb.all_token_logits = True
        return fb

    @torch.inference_mode()
    def forward_verify(self, fb: ForwardBatch) -> torch.Tensor:
        """Runs a verify batch; float32 logits [tokens, vocab]: its graph where one fits, else as an extend."""
        runner = self.verify_graph_runner
        if runner is not None and runner.can_run(fb):
            self.path_counts["verify_graph"] += 1
            return runner.replay(fb)
        return self.forward(fb)

    @torch.inference_mode()
    def verify(self, logits: torch.Tensor, info: SamplingBatchInfo, drafts: torch.Tensor, num_rows: list[int],
               rows: torch.Tensor) -> VerifyOutput:
        """Accept each request's drafts (model_executor/speculative_sampling.py) and record its run's last token
        as the last token of its request row (rows: one per request), which the next decode step reads."""
        out = verify_drafts(self.sampler, logits, info, drafts, num_rows)
        self.last_token_ids[rows] = out.final_tokens
        return out

    # ---- forward ------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Runs the batch; returns float32 logits [bs, vocab] of each request's last token."""
        if fb.mode.is_decode():
            runners, graph_path, eager_path = (self.decode_graph_runner,), "decode_graph", "decode_eager"
        elif fb.mm is not None:  # M-RoPE positions [3, tokens] and image embeddings: the graphs take neither
            runners = ()
            graph_path, eager_path = "extend_graph", "extend_eager"
        else:  # a whole graph where the batch fits one, else pieces
            runners = (self.full_extend_graph_runner, self.extend_graph_runner)
            graph_path, eager_path = "extend_graph", "extend_eager"
        for runner in runners:
            if runner is not None and runner.can_run(fb):
                self.path_counts[graph_path] += 1
                return runner.replay(fb)
        self.path_counts[eager_path] += 1
        return self.forward_eager(fb)

    def forward_eager(self, fb: ForwardBatch) -> torch.Tensor:
        self.attn_backend.init_forward_metadata(fb)
        if self.lora is not None:
            self.lora.batch = fb.lora
        return self.model(fb.input_ids, fb.positions, fb)

    @torch.inference_mode()
    def encode_images(self, pixels: list[torch.Tensor], grid_thw: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """Each image's embeddings (a multimodal model's vision tower, one pass over all of them)."""
        out: list[torch.Tensor | None] = [None] * len(pixels)
        for group in encoder_groups(grid_thw, self.image_patch_budget):
            self.path_counts["vision_encoder"] += 1
            embeds = self.model.encode_images([pixels[i] for i in group], [grid_thw[i] for i in group])
            for i, e in zip(group, embeds):
                out[i] = e
        return out

    def startup_phases(self) -> dict[str, float]:
        """Seconds of this runner's start-up phases that ran, in order: weights, the memory profile, each graph
        runner's capture and the compile (inductor: the CPU's decode, the GPU's piecewise extend pieces)."""
        phases = {"weights": self.load_seconds}
        if self.profile_seconds is not None:
            phases["memory_profile"] = self.profile_seconds
        decode, extend, full, verify = self._graph_runners()
        if decode is not None:
            phases["compile" if self.device.type == "cpu" else "decode_graphs"] = decode.capture_seconds
        if extend is not None:
            phases["piecewise_extend"] = extend.capture_seconds
            phases["compile"] = extend.compile_seconds
        if full is not None:
            phases["whole_extend_graphs"] = full.capture_seconds
        if verify is not None:
            phases["verify_graphs"] = verify.capture_seconds
        return phases

    def graph_info(self) -> dict:
        """What was captured, for the start-up line and /server_info."""
        info = {"cuda_graph_bs": [], "piecewise_cuda_graph_tokens": [], "full_extend_graph_tokens": []}
        for runner in self._graph_runners():
            if runner is not None:
                info.update(runner.info())
        kinds = ("decode", "extend", "full_extend", "verify")
        info["capture_seconds"] = round(sum(info.get(f"{k}_capture_seconds", 0.0) for k in kinds), 2)
        info["capture_gib"] = round(sum(info.get(f"{k}_capture_gib", 0.0) for k in kinds), 3)
        info["memory"] = {**self.memory_split.as_dict(), "load_seconds": round(self.load_seconds, 2),
                          "load_peak_gib": round(self.load_peak_bytes / 2**30, 3)}
        return info

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, params: list[SamplingParams], steps: list[int],
               rows: torch.Tensor | None = None, info: SamplingBatchInfo | None = None) -> SampleOutput:
        """Sample each row's next token; with `rows` (device request rows), also record the tokens as those
        rows' last tokens, which the next decode step reads. info: the batch's sampling tensors, when the
        caller kept them from an earlier step (built from params and steps otherwise)."""
        if info is None:
            info = SamplingBatchInfo.from_params(params, steps, self.device)
        out = self.sampler(logits, info)
        # Under TP every rank samples, then takes rank 0's tokens: the schedulers stay identical even where
        # sampling draws from an unseeded RNG or an all-reduce rounds differently on one rank.
        ps.broadcast_from_rank0(out.next_token_ids)
        if rows is not None:
            self.last_token_ids[rows] = out.next_token_ids
        return out
