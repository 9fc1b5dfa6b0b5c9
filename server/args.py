"""ServerArgs: every flag of the server, defined once; the CLI is generated from this dataclass.

Validated once at start-up (`validate`), never mutated afterwards: resolved values (device, capture
lists, the model folder) are computed into a new frozen copy by `resolve`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
from dataclasses import dataclass, field, fields

ATTENTION_BACKENDS = ("auto", "torch_native", "triton", "flashinfer")
SAMPLING_BACKENDS = ("auto", "flashinfer", "pytorch")  # model_executor/sampling_flashinfer.py
DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULE_POLICIES = ("fcfs", "lpm")
LOG_LEVELS = ("debug", "info", "warning", "error")
QUANTIZATION_CHOICES = ("none", "fp8", "int8", "int4")  # --quantization (server and offline CLI)
DP_ROUTINGS = ("least_load", "prefix")
SPECULATIVE_ALGORITHMS = ("NGRAM", "STANDALONE", "EAGLE3")
SPECULATIVE_DRAFT_MODELS = ("STANDALONE", "EAGLE3")
# Tokens verified per step and request (the last sampled token and 3 drafts); docs/speculative.md.
NGRAM_DEFAULT_NUM_DRAFT_TOKENS = 4
MAX_SPECULATIVE_NUM_DRAFT_TOKENS = 64


API_KEY_ENV = "DUET_API_KEY"


class ArgsError(ValueError):
    """A flag has an invalid value; the message is one line naming the flag."""


def _f(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class ServerArgs:
    model_path: str | None = _f(None, "HF model folder; default: SmolLM2-135M-Instruct, fetched and converted on first use")
    served_model_name: str | None = _f(None, "model name reported by /v1/models (default: the hub id or the "
                                              "folder name)")
    # Where the model comes from (server/model_source.py resolves and checks these before start-up).
    tokenizer_path: str | None = _f(None, "tokenizer folder or hub id (default: the model's)")
    revision: str | None = _f(None, "hub revision (branch, tag or commit) of a --model-path hub id")
    download_dir: str | None = _f(None, "hub cache folder for downloads (default: HF_HUB_CACHE, HF_HOME/hub)")
    trust_remote_code: bool = _f(False, "accepted for compatibility; models that need remote code are refused "
                                        "(duet runs only its own model code)")
    sampling_defaults: str = _f("model", "defaults for sampling values a request leaves unset: model "
                                         "(generation_config.json) or openai", choices=("model", "openai"))
    host: str = _f("127.0.0.1", "HTTP bind address")
    port: int = _f(30000, "HTTP port")
    device: str = _f("auto", "cuda or cpu; auto picks cuda when available", choices=("auto", "cuda", "cpu"))
    dtype: str = _f("auto", "weights/KV dtype; auto: float32 on CPU, bfloat16 on GPU", choices=DTYPES)
    context_length: int | None = _f(None, "max tokens per request (prompt + output); default: the model's")
    mem_fraction_static: float = _f(0.85, "GPU memory fraction for everything: weights, KV cache, and the "
                                          "graph and activation reserves")
    max_total_tokens: int | None = _f(None, "KV cache size in tokens (default: from memory on GPU, 16384 on CPU)")
    max_running_requests: int | None = _f(None, "max requests decoding at once (default: 256 on GPU, 64 on CPU)")
    max_prefill_tokens: int | None = _f(None, "token budget of one extend batch (default: 16384 on GPU; on a CPU "
                                              "the chunked-prefill size, so that prompts arriving together hold "
                                              "the running requests up for one chunk's time)")
    chunked_prefill_size: int | None = _f(None, "prompts longer than this are prefilled in chunks; prompts that "
                                                "arrive meanwhile and fit in a chunk join the next one (a batch "
                                                "then holds up to 1.5 chunks) (default: 8192 on GPU, 128 on CPU; "
                                                "-1 disables)")
    schedule_policy: str = _f("fcfs", "waiting-queue order: fcfs, or lpm (longest prefix match)",
                              choices=SCHEDULE_POLICIES)
    disable_radix_cache: bool = _f(False, "turn the radix prefix cache off")
    disable_overlap_schedule: bool = _f(False, "read each step's tokens before launching the next (by default the "
                                               "next step is launched first, so the GPU never waits for the host)")
    enable_mixed_chunk: bool = _f(False, "run a long prompt's prefill chunk and the running decodes in one batch "
                                         "(steadier inter-token latency while long prompts arrive)")
    attention_backend: str = _f("auto", "attention backend; auto: torch_native on CPU, triton on GPU "
                                        "(faster than flashinfer in our measurements)", choices=ATTENTION_BACKENDS)
    sampling_backend: str = _f("auto", "kernels that sample the random rows without a seed: flashinfer (no sort "
                                       "of the vocabulary) or pytorch; auto: flashinfer on a GPU when installed "
                                       "(rows with a seed always use pytorch)", choices=SAMPLING_BACKENDS)
    cuda_graph_max_bs: int | None = _f(None, "largest decode batch captured in a CUDA graph "
                                             "(default from GPU memory)")
    cuda_graph_bs: tuple[int, ...] | None = _f(None, "explicit decode capture list, captured exactly as given; "
                                                     "sets --cuda-graph-max-bs to its largest entry",
                                               nargs="+")
    disable_cuda_graph: bool = _f(False, "run decode batches eagerly (no CUDA graphs)")
    piecewise_cuda_graph_max_tokens: int | None = _f(None, "largest extend token count captured "
                                                           "(default: the chunked-prefill size, at most 2048)")
    piecewise_cuda_graph_tokens: tuple[int, ...] | None = _f(None, "explicit extend token levels, captured "
                                                                   "exactly as given", nargs="+")
    disable_piecewise_cuda_graph: bool = _f(False, "run extend batches eagerly (no piecewise graphs)")
    full_extend_graph_max_tokens: int | None = _f(None, "extend levels up to this many tokens also get a graph "
                                                        "of the whole model, attention inside (triton backend; "
                                                        "up to 8 requests); 0: none; default 512")
    disable_small_m_gemm: bool = _f(False, "GPU: run every linear layer on its plain path (cuBLAS for bf16, the "
                                           "W8A8 GEMM for FP8) instead of the small-M GEMM kernel and its "
                                           "fusions at decode-sized batches")
    enable_torch_compile: bool = _f(False, "GPU: compile the piecewise extend graphs' pieces with inductor "
                                           "(decode graphs are not compiled); CPU: compile decode with "
                                           "inductor; slower start-up")
    quantization: str | None = _f(None, "weight quantization: fp8 (online, GPU sm89+), int8 / int4 (weight-only, "
                                        "CPU), none; default: the checkpoint's (an FP8 checkpoint runs as FP8; "
                                        "SmolLM2, the quick start's model, runs unquantized)",
                                  choices=QUANTIZATION_CHOICES)
    kv_cache_dtype: str = _f("auto", "KV cache dtype: auto (the model dtype) or fp8_e4m3 (GPU sm89+, "
                                     "triton or flashinfer attention)", choices=("auto", "fp8_e4m3"))
    # Parallelism (server/parallel.py): dp_size replicas, each a group of tp_size scheduler ranks.
    tp_size: int = _f(1, "tensor-parallel size: ranks (one process and one GPU each; gloo ranks on CPU) "
                         "that split every layer of the model")
    dp_size: int = _f(1, "data-parallel size: independent replicas of the model (each its own --tp-size "
                         "group) behind one HTTP server")
    dp_routing: str = _f("least_load", "how requests pick a data-parallel replica: least_load (fewest "
                                       "requests in flight), or prefix (the replica that served the longest "
                                       "prefix of the prompt, for prefix-cache reuse; else the least loaded)",
                         choices=DP_ROUTINGS)
    nnodes: int = _f(1, "hosts the tensor-parallel group spans (each runs launch_server with its --node-rank)")
    node_rank: int = _f(0, "this host's index among --nnodes (0 serves HTTP)")
    dist_init_addr: str | None = _f(None, "HOST:PORT where the ranks' torch.distributed groups meet (needed "
                                          "with --nnodes > 1; replica d uses PORT + d; default: a free "
                                          "local port)")
    watchdog_timeout: float = _f(60.0, "with --tp-size > 1: seconds a rank's scheduler loop may go without "
                                       "finishing an iteration before the server stops, naming the rank (a hung "
                                       "rank stalls its peers in their next collective); 0: off")
    disable_custom_all_reduce: bool = _f(False, "with --tp-size > 1 on GPUs: NCCL for every all-reduce, instead "
                                                "of the one-shot kernel over peer memory for small sums (on by "
                                                "default on one host; --nnodes > 1 always uses NCCL)")
    dist_timeout: float = _f(300.0, "seconds a collective may wait for the other ranks before the rank "
                                    "fails (a hung rank brings the server down instead of stalling it)")
    api_key: str | None = _f(None, "require 'Authorization: Bearer KEY' on every route but /health and /metrics; "
                                   "DUET_API_KEY in the environment sets it too, out of sight of ps")
    log_level: str = _f("info", "log level", choices=LOG_LEVELS)
    # Observability: SGLang-style request log and periodic status line.
    log_requests: bool = _f(False, "log each request at INFO: id, prompt length, sampling parameters, then its "
                                   "finish reason and output length (never the text)")
    status_interval: float = _f(5.0, "seconds between the scheduler's status lines at INFO while requests run "
                                     "(running/queued requests, KV usage, tokens/s, graph hit rate); 0: off")
    enable_metrics: bool = _f(True, "always on: /metrics is always served; the flag is accepted for SGLang "
                                    "compatibility")
    random_seed: int = _f(0, "seed for weights of --load-format dummy and for unseeded sampling")
    load_format: str = _f("auto", "auto: safetensors from the folder; dummy: random weights of the "
                                  "folder's shape (benchmarks)", choices=("auto", "dummy"))
    # Structured outputs, tools, reasoning.
    grammar_backend: str = _f("xgrammar", "structured outputs (response_format, regex, ebnf, tool_choice "
                                          "required/named): xgrammar, or none to refuse them",
                              choices=("xgrammar", "none"))
    tool_call_parser: str | None = _f(None, "the tool-call format calls are written and read in: hermes (Qwen), "
                                            "llama3 (JSON), mistral, qwen3_coder (XML) or gpt-oss (harmony); none: "
                                            "tool_choice auto answers in text (default: detected from the chat template; a template "
                                            "without tools gets duet's own hermes-style format)",
                                      choices=("hermes", "llama3", "mistral", "qwen3_coder", "gpt-oss", "none"))
    reasoning_parser: str | None = _f(None, "split reasoning into reasoning_content: qwen3 or deepseek-r1 (<think>), "
                                            "gpt-oss (harmony's analysis channel); "
                                            "none: never (default: detected from the chat template)",
                                      choices=("qwen3", "deepseek-r1", "gpt-oss", "none"))
    # Pooling servers (model_executor/pooling.py, server/serving_embedding.py, server/serving_rerank.py).
    is_embedding: bool = _f(False, "serve /v1/embeddings instead of generation (also detected: a "
                                   "sentence-transformers modules.json or 1_Pooling/config.json, or a *Model "
                                   "architecture); with a *ForSequenceClassification model it serves /v1/rerank "
                                   "and /v1/score, as --is-reranker")
    is_reranker: bool = _f(False, "serve /v1/rerank and /v1/score instead of generation: a "
                                  "*ForSequenceClassification model (detected) scores with its head; a causal LM "
                                  "as Qwen3-Reranker, p(yes) of its 'yes'/'no' logits after Qwen3-Reranker's prompt")
    # Multi-LoRA serving (model_executor/lora/, docs/lora.md).
    enable_lora: bool = _f(False, "serve LoRA adapters (also on when --lora-paths are given)")
    lora_paths: tuple[str, ...] | None = _f(None, "LoRA adapters loaded at start-up: NAME=PATH (or PATH: its "
                                                  "folder name is the name), PEFT folders with adapter_config.json "
                                                  "and adapter_model.safetensors", nargs="+",
                                            aliases=("--lora-modules",))
    max_loras_per_batch: int = _f(8, "adapters one batch may use: the device pool's slots (its memory is "
                                     "allocated at start-up)", aliases=("--max-loras",))
    max_loaded_loras: int | None = _f(None, "adapters held in host memory at once (default: no limit); loading "
                                            "one more is refused", aliases=("--max-cpu-loras",))
    max_lora_rank: int | None = _f(None, "the pool's rank: the largest adapter rank that can be loaded (default: "
                                         "the largest of --lora-paths; needed without them)")
    lora_target_modules: tuple[str, ...] | None = _f(None, "projections adapters may target: q_proj k_proj "
                                                           "v_proj o_proj gate_proj up_proj down_proj, or all "
                                                           "(default: those of --lora-paths; needed without them)",
                                                     nargs="+")
    lora_backend: str = _f("auto", "LoRA kernels: triton (SGMV / per-row) or torch; auto: triton on a GPU, torch "
                                   "on a CPU", choices=("auto", "triton", "torch"))
    chat_template: str | None = _f(None, "chat template replacing the model's: a file path or the template text")
    # Speculative decoding (SGLang's flags; docs/speculative.md).
    speculative_algorithm: str | None = _f(None, "speculative decoding: NGRAM drafts tokens from a suffix match "
                                                 "over the request's own prompt and output (no draft model); "
                                                 "STANDALONE drafts with a smaller model of the same tokenizer; "
                                                 "EAGLE3 with an EAGLE-3 head; default: off",
                                           choices=SPECULATIVE_ALGORITHMS)
    speculative_num_draft_tokens: int | None = _f(None, "tokens the target verifies per step and request: the "
                                                        "last sampled token and up to this minus one drafts "
                                                        f"(default: --speculative-num-steps + 1, else "
                                                        f"{NGRAM_DEFAULT_NUM_DRAFT_TOKENS})")
    speculative_ngram_min_match_window_size: int = _f(1, "NGRAM: the shortest suffix of the request's tokens that "
                                                         "may match an earlier occurrence (default: 1)")
    speculative_ngram_max_match_window_size: int = _f(12, "NGRAM: the longest suffix tried first (default: 12)")
    speculative_draft_model_path: str | None = _f(None, "STANDALONE / EAGLE3: the draft model's folder")
    speculative_num_steps: int | None = _f(None, "STANDALONE / EAGLE3: draft tokens (steps of the draft "
                                                          "model) per verify (default: --speculative-num-draft-"
                                                          "tokens - 1)")
    speculative_eagle_topk: int | None = _f(None, "STANDALONE / EAGLE3: draft tokens branched per "
                                                         "step; only 1 (a chain) is built")
    max_request_bytes: int = _f(8 * 1024 * 1024, "largest HTTP request body accepted (413 above)")
    # Images in prompts (vision-language models; server/multimodal.py, docs/vision.md).
    limit_mm_per_prompt: str | None = _f(None, "most images one request may carry: image=N or JSON {\"image\": N} "
                                               "(vLLM's flag; default: 8)")
    mm_min_pixels: int | None = _f(None, "images are resized to at least this many pixels (default: the model's "
                                         "preprocessor_config.json)")
    mm_max_pixels: int | None = _f(None, "images are resized to at most this many pixels (default: the model's "
                                         "preprocessor_config.json)")
    disable_image_url_fetch: bool = _f(False, "refuse http(s) image URLs (data: URLs are still read)")
    allowed_local_media_path: str | None = _f(None, "file:// image paths are read only from under this folder "
                                                    "(vLLM's flag; default: file:// refused)")

    def validate(self) -> None:
        """Raise ArgsError (one line, naming the flag) for an invalid value."""

        def positive(name: str, value, allow_none: bool = True) -> None:
            if value is None and allow_none:
                return
            if not isinstance(value, int) or value < 1:
                raise ArgsError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")

        positive("port", self.port, allow_none=False)
        if self.port > 65535:
            raise ArgsError(f"--port must be at most 65535, got {self.port}")
        for name in ("context_length", "max_total_tokens", "max_running_requests", "cuda_graph_max_bs",
                     "piecewise_cuda_graph_max_tokens"):
            positive(name, getattr(self, name))
        positive("max_prefill_tokens", self.max_prefill_tokens)
        full = self.full_extend_graph_max_tokens
        if full is not None and (not isinstance(full, int) or full < 0):
            raise ArgsError(f"--full-extend-graph-max-tokens must be a non-negative integer, got {full}")
        positive("max_request_bytes", self.max_request_bytes, allow_none=False)
        positive("mm_min_pixels", self.mm_min_pixels)
        positive("mm_max_pixels", self.mm_max_pixels)
        if self.mm_min_pixels and self.mm_max_pixels and self.mm_min_pixels > self.mm_max_pixels:
            raise ArgsError(f"--mm-min-pixels {self.mm_min_pixels} is more than --mm-max-pixels {self.mm_max_pixels}")
        if self.allowed_local_media_path is not None and not os.path.isdir(self.allowed_local_media_path):
            raise ArgsError(f"--allowed-local-media-path {self.allowed_local_media_path!r} is not a folder")
        from server.multimodal import parse_image_limit

        try:
            parse_image_limit(self.limit_mm_per_prompt)
        except ValueError as e:
            raise ArgsError(f"--limit-mm-per-prompt: {e}") from None
        if self.chunked_prefill_size is not None and self.chunked_prefill_size != -1:
            positive("chunked_prefill_size", self.chunked_prefill_size)
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ArgsError(f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}")
        for name in ("cuda_graph_bs", "piecewise_cuda_graph_tokens"):
            values = getattr(self, name)
            if values is not None and (not values or any(v < 1 for v in values)):
                raise ArgsError(f"--{name.replace('_', '-')} must list positive integers, got {list(values)}")
        self._validate_parallel(positive)
        if self.device == "cpu" and self.attention_backend in ("triton", "flashinfer"):
            raise ArgsError(f"--attention-backend {self.attention_backend} needs a CUDA device; "
                            "use torch_native on CPU")
        if self.attention_backend == "flashinfer" and importlib.util.find_spec("flashinfer") is None:
            raise ArgsError("--attention-backend flashinfer: flashinfer is not installed; "
                            "install it with `pip install 'duet[flashinfer]'` (needs a CUDA GPU)")
        if self.sampling_backend == "flashinfer" and self.device == "cpu":
            raise ArgsError("--sampling-backend flashinfer needs a CUDA device; use pytorch (or auto) on CPU")
        if self.sampling_backend == "flashinfer" and importlib.util.find_spec("flashinfer") is None:
            raise ArgsError("--sampling-backend flashinfer: flashinfer is not installed; "
                            "install it with `pip install 'duet[flashinfer]'` (needs a CUDA GPU)")
        self._validate_quantization()
        self._validate_speculative(positive)
        if not self.status_interval >= 0:
            raise ArgsError(f"--status-interval must be >= 0 seconds, got {self.status_interval}")
        if self.chat_template is not None and not os.path.isfile(os.path.expanduser(self.chat_template)) \
                and "{" not in self.chat_template:
            raise ArgsError(f"--chat-template: no such file, and not a template either: {self.chat_template}")
        if self.is_embedding and self.is_reranker:
            raise ArgsError("--is-embedding and --is-reranker exclude each other: a server serves embeddings or "
                            "scores")
        if self.api_key is not None and not self.api_key:
            raise ArgsError("--api-key must not be empty")
        self._validate_lora(positive)

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_paths)

    def lora_adapters(self) -> list[tuple[str, str]]:
        """--lora-paths as (name, folder) pairs (NAME=PATH, or PATH named by its folder)."""
        out = []
        for item in self.lora_paths or ():
            name, sep, path = item.partition("=")
            if not sep:
                name, path = os.path.basename(os.path.normpath(item)), item
            out.append((name, path))
        return out

    def _validate_lora(self, positive) -> None:
        """LoRA flags, each adapter's adapter_config.json (rank, targets), and what LoRA does not run with."""
        if not self.lora_enabled:
            return
        from model_executor.lora.adapter import TARGET_MODULES, LoraError, config_targets, read_config

        positive("max_loras_per_batch", self.max_loras_per_batch, allow_none=False)
        positive("max_loaded_loras", self.max_loaded_loras)
        positive("max_lora_rank", self.max_lora_rank)
        adapters = self.lora_adapters()
        names = [n for n, _ in adapters]
        if any(not n or not p for n, p in adapters):
            raise ArgsError(f"--lora-paths: expected NAME=PATH or PATH, got {list(self.lora_paths)}")
        if len(set(names)) != len(names):
            raise ArgsError(f"--lora-paths: adapter names must be distinct, got {names}")
        if self.max_loaded_loras is not None and len(adapters) > self.max_loaded_loras:
            raise ArgsError(f"--max-loaded-loras {self.max_loaded_loras} is fewer than the {len(adapters)} "
                            "--lora-paths")
        targets = self.lora_target_modules
        if targets is not None:
            unknown = sorted(set(targets) - set(TARGET_MODULES) - {"all", "all-linear"})
            if unknown:
                raise ArgsError(f"--lora-target-modules: {unknown} are not supported; choose from "
                                f"{', '.join(TARGET_MODULES)} or all")
        ranks, union = [], set()
        for name, path in adapters:
            try:
                cfg = read_config(path, name)
                union |= config_targets(cfg, name)
            except LoraError as e:
                raise ArgsError(f"--lora-paths: {e}") from None
            ranks.append(cfg["r"])
            if self.max_lora_rank is not None and cfg["r"] > self.max_lora_rank:
                raise ArgsError(f"--lora-paths: adapter {name!r} has rank {cfg['r']} > --max-lora-rank "
                                f"{self.max_lora_rank}")
        if not adapters and self.max_lora_rank is None:
            raise ArgsError("--enable-lora without --lora-paths needs --max-lora-rank (the pool's rank)")
        if not adapters and targets is None:
            raise ArgsError("--enable-lora without --lora-paths needs --lora-target-modules")
        refused = [(self.dp_size > 1, "--dp-size > 1"),
                   (self.quantization not in (None, "none"), f"--quantization {self.quantization}"),
                   (self.is_embedding or self.is_reranker, "--is-embedding / --is-reranker"),
                   (self.speculative_algorithm is not None, "--speculative-algorithm")]
        for bad, what in refused:
            if bad:
                raise ArgsError(f"LoRA adapters are not served with {what} (not built)")

    def lora_config(self):
        """The runner's LoraConfig, or None with LoRA off."""
        if not self.lora_enabled:
            return None
        from model_executor.lora.adapter import TARGET_MODULES
        from model_executor.lora.manager import LoraConfig

        targets = tuple(self.lora_target_modules or ())
        if {"all", "all-linear"} & set(targets):
            targets = TARGET_MODULES
        return LoraConfig(paths=tuple(self.lora_adapters()), max_per_batch=self.max_loras_per_batch,
                          max_loaded=self.max_loaded_loras, max_rank=self.max_lora_rank or 0,
                          target_modules=targets, backend=self.lora_backend)

    def _validate_parallel(self, positive) -> None:
        for name in ("tp_size", "dp_size", "nnodes"):
            positive(name, getattr(self, name), allow_none=False)
        if not 0 <= self.node_rank < self.nnodes:
            raise ArgsError(f"--node-rank must be in [0, --nnodes {self.nnodes}), got {self.node_rank}")
        if self.tp_size % self.nnodes:
            raise ArgsError(f"--tp-size {self.tp_size} must be a multiple of --nnodes {self.nnodes} "
                            "(each host runs the same number of ranks)")
        if self.nnodes > 1 and self.dp_size > 1:
            raise ArgsError("--dp-size > 1 with --nnodes > 1 is not supported; run one server per host instead")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ArgsError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address, reachable from "
                            "every host)")
        if self.dist_init_addr is not None:
            try:
                split_host_port(self.dist_init_addr)
            except ValueError as e:
                raise ArgsError(f"--dist-init-addr: {e}") from None
        if not self.watchdog_timeout >= 0:
            raise ArgsError(f"--watchdog-timeout must be >= 0 seconds, got {self.watchdog_timeout}")
        if not self.dist_timeout > 0:
            raise ArgsError(f"--dist-timeout must be > 0 seconds, got {self.dist_timeout}")
    def _validate_speculative(self, positive) -> None:
        algo = self.speculative_algorithm
        for name in ("speculative_num_draft_tokens", "speculative_ngram_min_match_window_size",
                     "speculative_ngram_max_match_window_size", "speculative_num_steps", "speculative_eagle_topk"):
            positive(name, getattr(self, name))
        if algo is None:
            given = [f for f in ("speculative_num_draft_tokens", "speculative_draft_model_path",
                                 "speculative_num_steps", "speculative_eagle_topk")
                     if getattr(self, f) is not None]
            given += [f for f, default in (("speculative_ngram_min_match_window_size", 1),
                                           ("speculative_ngram_max_match_window_size", 12))
                      if getattr(self, f) != default]
            if given:
                raise ArgsError(f"--{given[0].replace('_', '-')} needs --speculative-algorithm")
            return
        if algo in SPECULATIVE_DRAFT_MODELS:
            self._validate_draft_model(algo)
        else:
            for name in ("speculative_draft_model_path", "speculative_num_steps", "speculative_eagle_topk"):
                if getattr(self, name) is not None:
                    raise ArgsError(f"--{name.replace('_', '-')} does not apply to --speculative-algorithm {algo}")
        n = self.resolved_num_draft_tokens
        if n is not None and not 2 <= n <= MAX_SPECULATIVE_NUM_DRAFT_TOKENS:
            raise ArgsError(f"--speculative-num-draft-tokens must be in [2, {MAX_SPECULATIVE_NUM_DRAFT_TOKENS}] "
                            f"(the last token and at least one draft), got {n}")
        lo, hi = self.speculative_ngram_min_match_window_size, self.speculative_ngram_max_match_window_size
        if lo > hi:
            raise ArgsError(f"--speculative-ngram-min-match-window-size ({lo}) must not exceed "
                            f"--speculative-ngram-max-match-window-size ({hi})")
        if self.tp_size > 1:
            raise ArgsError("--speculative-algorithm with --tp-size > 1 is not built yet")
        if self.lora_enabled:
            raise ArgsError("--speculative-algorithm with LoRA adapters (--enable-lora / --lora-paths) is not built "
                            "yet")
        if self.is_embedding or self.is_reranker:
            flag = "--is-embedding" if self.is_embedding else "--is-reranker"
            raise ArgsError(f"--speculative-algorithm does not apply to {flag}: such a server decodes nothing")

    @property
    def resolved_num_draft_tokens(self) -> int | None:
        """Tokens verified per step and request (None: speculation off)."""
        if self.speculative_algorithm is None:
            return None
        if self.speculative_num_draft_tokens is None and self.speculative_num_steps is not None:
            return self.speculative_num_steps + 1  # a chain: the last token and one draft per step
        return self.speculative_num_draft_tokens or NGRAM_DEFAULT_NUM_DRAFT_TOKENS

    def _validate_draft_model(self, algo: str) -> None:
        if self.speculative_draft_model_path is None:
            raise ArgsError(f"--speculative-algorithm {algo} needs --speculative-draft-model-path")
        if self.speculative_eagle_topk not in (None, 1):
            raise ArgsError(f"--speculative-eagle-topk {self.speculative_eagle_topk} (tree drafts) is not built yet; "
                            f"chains (1) are")
        steps, n = self.speculative_num_steps, self.speculative_num_draft_tokens
        if steps is not None and n is not None and n != steps + 1:
            raise ArgsError(f"--speculative-num-draft-tokens ({n}) must be --speculative-num-steps + 1 ({steps + 1}) "
                            f"with chain drafts")
        for name, default in (("speculative_ngram_min_match_window_size", 1),
                              ("speculative_ngram_max_match_window_size", 12)):
            if getattr(self, name) != default:
                raise ArgsError(f"--{name.replace('_', '-')} does not apply to --speculative-algorithm {algo}")

    def _validate_quantization(self) -> None:
        """FP8 needs an sm89+ GPU, int8 is CPU-only, the FP8 KV cache needs triton or flashinfer: refused
        here, before anything starts (the device is known once `auto` is resolved). The GPU's compute
        capability is checked by the engine process (model_runner), so that this process never holds a
        CUDA context of its own."""
        fp8_kv = self.kv_cache_dtype == "fp8_e4m3"
        if self.device == "auto" or not (self.quantization in ("fp8", "int8", "int4") or fp8_kv):
            return
        from model_executor.layers.quantization.config import FP8_KV_BACKENDS, fp8_unsupported_reason

        wants_fp8 = self.quantization == "fp8" or fp8_kv
        fp8_why = fp8_unsupported_reason(self.device) if wants_fp8 and self.device == "cpu" else None
        if self.quantization == "fp8" and fp8_why:
            raise ArgsError(f"--quantization fp8 {fp8_why}")
        if self.quantization in ("int8", "int4") and self.device != "cpu":
            raise ArgsError(f"--quantization {self.quantization} is weight-only {self.quantization} for the CPU; "
                            "on a GPU use --quantization fp8")
        if fp8_kv and fp8_why:
            raise ArgsError(f"--kv-cache-dtype fp8_e4m3 {fp8_why}")
        if fp8_kv and self.attention_backend not in ("auto", *FP8_KV_BACKENDS):
            raise ArgsError(f"--kv-cache-dtype fp8_e4m3 runs with --attention-backend triton or flashinfer, not "
                            f"{self.attention_backend}")

    def replace(self, **changes) -> ServerArgs:
        return dataclasses.replace(self, **changes)


def split_host_port(addr: str) -> tuple[str, int]:
    """'host:port' (IPv6 as [addr]:port) -> (host, port); ValueError naming the problem."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {addr!r}")
    return host.strip("[]"), int(port)


def _arg_type(f: dataclasses.Field):
    t = str(f.type)
    if "int" in t:
        return int
    if "float" in t:
        return float
    return str


class _OneLineErrorParser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineErrorParser(prog="launch_server", description="duet: an OpenAI-compatible LLM server")
    for f in fields(ServerArgs):
        flag = "--" + f.name.replace("_", "-")
        meta = dict(f.metadata)
        help_text = meta.pop("help")
        flags = [flag, *meta.pop("aliases", ())]  # vLLM's names for the same flag
        if f.type in ("bool", bool):
            parser.add_argument(*flags, action="store_true", default=f.default, help=help_text)
            continue
        kind = _arg_type(f)
        if f.default is not None and "default" not in help_text:  # else the help text names its default
            help_text = f"{help_text} (default: {f.default})"
        parser.add_argument(*flags, dest=f.name, type=kind, default=f.default, help=help_text, **meta)
    return parser


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    """Parse and validate; invalid values exit with a one-line error and code 2 (argparse's convention)."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    values = vars(ns)
    if values["api_key"] is None:  # a key on the command line is visible to every local user (ps, /proc)
        values["api_key"] = os.environ.get(API_KEY_ENV) or None
    for name in ("cuda_graph_bs", "piecewise_cuda_graph_tokens", "lora_paths", "lora_target_modules"):
        if values[name] is not None:
            values[name] = tuple(values[name])
    args = ServerArgs(**values)
    try:
        args.validate()
    except ArgsError as e:
        parser.error(str(e))
    return args
