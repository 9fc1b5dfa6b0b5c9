"""launch_server's CLI: invalid values and unusable backends are one-line errors with exit code 2."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from server.args import ArgsError, ServerArgs, parse_args


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server.launch_server", *args], check=False, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("argv", [["--port", "-5"], ["--dtype", "fp8"], ["--mem-fraction-static", "1.5"],
                                  ["--cuda-graph-bs", "0", "4"], ["--tp-size", "0"], ["--max-running-requests", "0"],
                                  ["--nnodes", "2", "--tp-size", "2"], ["--dist-init-addr", "nohost"],
                                  ["--full-extend-graph-max-tokens", "-1"]])
def test_invalid_values_exit_2_with_one_line(argv):
    proc = run_cli(*argv)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("launch_server: error:"), proc.stderr


@pytest.mark.parametrize("backend", ["flashinfer", "triton"])
def test_gpu_backend_on_cpu_is_refused(backend):
    proc = run_cli("--device", "cpu", "--attention-backend", backend, "--model-path", ".")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "needs a CUDA device" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is not None, reason="flashinfer is installed here")
def test_flashinfer_not_installed_says_what_to_install():
    with pytest.raises(ArgsError, match=r"pip install 'duet\[flashinfer\]'"):
        ServerArgs(device="cuda", attention_backend="flashinfer").validate()


def test_explicit_capture_list_parses():
    args = parse_args(["--cuda-graph-bs", "1", "2", "8", "--piecewise-cuda-graph-tokens", "16", "64"])
    assert args.cuda_graph_bs == (1, 2, 8) and args.piecewise_cuda_graph_tokens == (16, 64)


def test_disable_small_m_gemm_reaches_the_runner():
    from server.scheduler_entry import runner_config

    assert not runner_config(parse_args(["--device", "cpu"])).disable_small_m_gemm
    args = parse_args(["--device", "cpu", "--disable-small-m-gemm"])
    assert args.disable_small_m_gemm and runner_config(args).disable_small_m_gemm


def test_whole_extend_graphs_default_to_512_tokens_and_go_with_the_pieces():
    from runners.capture_lists import resolve_full_extend_max_tokens

    assert resolve_full_extend_max_tokens(parse_args([])) == 512
    assert resolve_full_extend_max_tokens(parse_args(["--full-extend-graph-max-tokens", "128"])) == 128
    assert resolve_full_extend_max_tokens(parse_args(["--full-extend-graph-max-tokens", "0"])) == 0
    assert resolve_full_extend_max_tokens(parse_args(["--disable-piecewise-cuda-graph"])) == 0


def test_server_and_offline_cli_share_the_default_models_format(model_dir, monkeypatch):
    """No --model-path on a CPU: the server and `python -m server.generate` run the default model in the one
    format model_executor/default_model.py names (dtype and quantization); an explicit --dtype or --quantization
    wins in both, and a model the user names keeps its own (None / auto: the checkpoint's)."""
    from model_executor.default_model import default_dtype, default_quantization
    from server import generate
    from server.launch_server import resolve_args

    def offline(*argv: str):
        return generate.resolve_args(generate.build_parser().parse_args(["--prompt", "x", "--device", "cpu", *argv]))

    monkeypatch.setenv("DUET_CACHE_DIR", str(model_dir.parent))  # the cache that holds the default model
    server, cli = resolve_args(ServerArgs(device="cpu")), offline()
    assert server.model_path == cli.model_path == str(model_dir)
    assert server.quantization == cli.quantization == default_quantization("cpu")
    assert server.dtype == cli.dtype == default_dtype("cpu") == "bfloat16"
    assert resolve_args(ServerArgs(device="cpu", dtype="float32")).dtype == offline("--dtype", "float32").dtype
    assert offline("--dtype", "float32").dtype == "float32"  # an explicit --dtype wins
    assert resolve_args(ServerArgs(device="cpu", model_path=str(model_dir))).dtype == "auto"  # a named model: its own
    for q in ("none", "int8", "int4"):
        assert resolve_args(ServerArgs(device="cpu", quantization=q)).quantization == q
        assert offline("--quantization", q).quantization == q
    assert resolve_args(ServerArgs(device="cpu", model_path=str(model_dir))).quantization is None
    assert offline("--model-path", str(model_dir)).quantization is None


def test_offline_cli_refuses_a_quantization_the_device_cannot_run(tmp_path, capsys):
    from server import generate
    from tests.fake_scheduler import build_tiny_model_folder

    folder = str(build_tiny_model_folder(tmp_path / "tiny", with_weights=True))
    capsys.readouterr()
    assert generate.main(["--model-path", folder, "--prompt", "x", "--device", "cpu", "--quantization", "fp8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --quantization fp8 needs a CUDA GPU") and len(err.strip().splitlines()) == 1


def test_cpu_prefill_chunk_bounds_every_extend_batch():
    """On a CPU the chunk is also the extend batch's token budget (prompts arriving together wait one chunk at
    a time, as behind a long prompt); explicit values are taken as given, and the GPU keeps its defaults."""
    from server.scheduler_entry import CPU_CHUNKED_PREFILL_SIZE, scheduler_config

    cpu = scheduler_config(parse_args(["--device", "cpu"]))
    assert cpu.chunked_prefill_size == cpu.max_prefill_tokens == CPU_CHUNKED_PREFILL_SIZE == 128
    gpu = scheduler_config(ServerArgs(device="cuda"))
    assert (gpu.chunked_prefill_size, gpu.max_prefill_tokens) == (8192, 16384)
    given = scheduler_config(parse_args(["--device", "cpu", "--max-prefill-tokens", "4096",
                                         "--chunked-prefill-size", "512"]))
    assert (given.chunked_prefill_size, given.max_prefill_tokens) == (512, 4096)
    unchunked = scheduler_config(parse_args(["--device", "cpu", "--chunked-prefill-size", "-1"]))
    assert (unchunked.chunked_prefill_size, unchunked.max_prefill_tokens) == (None, 16384)


def test_int4_on_a_gpu_is_refused():
    with pytest.raises(ArgsError, match="--quantization int4 is weight-only int4 for the CPU"):
        ServerArgs(device="cuda", quantization="int4").validate()
