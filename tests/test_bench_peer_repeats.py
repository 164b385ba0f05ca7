"""The peer benchmark's repetitions (median and spread), its burst and long steady workloads' rows, and what
the tuned vLLM preloads."""

from pathlib import Path

from loadtest import peer_server
from loadtest.bench_peer import WORKLOADS, format_table, median_summary
from loadtest.peer_venv import PeerVenv


def _figures(throughput: float, ttft_p95: float, failed: int = 0) -> dict:
    stats = {"p50": ttft_p95 / 2, "p95": ttft_p95, "p99": ttft_p95}
    return {"completed": 64, "failed": failed, "duration_s": 10.0, "output_throughput": throughput,
            "cached_tokens": 0, "ttft_ms": stats, "itl_ms": stats, "tpot_ms": stats, "short_requests": 64,
            "long_requests": 0, "short_itl_ms": stats, "wrong_output_lengths": 0, "tokens_per_chunk": 1.0}


def test_the_median_of_each_figure_counts_summed_and_the_spread_of_throughput():
    merged = median_summary([_figures(400.0, 900.0), _figures(500.0, 700.0, failed=1), _figures(450.0, 800.0)])
    assert merged["output_throughput"] == 450.0 and merged["ttft_ms"]["p95"] == 800.0
    assert merged["failed"] == 1 and merged["completed"] == 192
    assert merged["repetitions"] == 3 and abs(merged["spread"] - 100 / 450) < 1e-9
    single = median_summary([_figures(400.0, 900.0)])
    assert single["spread"] == 0.0 and single["repetitions"] == 1


def test_burst_and_long_steady_rows_and_the_spread_row():
    settings = {"burst": dict(WORKLOADS["burst"]), "steady-c32": dict(WORKLOADS["steady-c32"])}
    tuned = {"burst": median_summary([_figures(700.0, 300.0), _figures(720.0, 320.0), _figures(710.0, 310.0)]),
             "steady-c32": median_summary([_figures(800.0, 100.0)] * 3)}
    ours = {"burst": median_summary([_figures(600.0, 900.0)] * 3), "steady-c32": median_summary([_figures(900.0, 90.0)] * 3)}
    lines = format_table({"bfloat16": {"vllm-tuned": tuned, "colocated": ours}}, {}, settings,
                         ["vllm-tuned", "colocated"], "vllm-tuned").splitlines()
    assert "| burst: 64 prompts of 512 tokens at once: TTFT p95 | 310 ms | 900 ms |" in lines
    assert "| 128 requests x 256 tokens, concurrency 32: output tokens/s | 800 | 900 |" in lines
    assert "| burst: spread of output tokens/s over the repetitions | 2.8% | 0.0% |" in lines


def test_the_tuned_vllm_preloads_what_is_there_and_says_what_is_not(tmp_path, monkeypatch):
    venv = PeerVenv(tmp_path / "venv", {})
    iomp = venv.path / "lib" / "libiomp5.so"
    iomp.parent.mkdir(parents=True)
    iomp.write_bytes(b"")
    tcmalloc = tmp_path / "libtcmalloc_minimal.so.4"
    tcmalloc.write_bytes(b"")
    monkeypatch.setattr(peer_server, "TCMALLOC_PATHS", (str(tmp_path / "absent.so"), str(tcmalloc)))
    assert peer_server.tuned_preload(venv) == ([str(tcmalloc), str(iomp)], [])
    iomp.unlink()
    monkeypatch.setattr(peer_server, "TCMALLOC_PATHS", (str(tmp_path / "absent.so"),))
    found, missing = peer_server.tuned_preload(venv)
    assert found == [] and [note.split(":")[0] for note in missing] == ["tcmalloc", "Intel OpenMP"]


def test_the_preload_goes_into_vllms_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SPLITSERVE_KV_CACHE_BYTES", str(1 << 30))  # vLLM's is set in whole GiB
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    venv = PeerVenv(tmp_path, {})
    server = peer_server.vllm_server(venv, "/models/x", dtype="bfloat16", max_model_len=2048, log_dir=tmp_path,
                                     omp_bind="0-1", label="vllm-tuned", preload=["/a/libtc.so", "/b/libiomp5.so"])
    assert server.env["LD_PRELOAD"] == "/a/libtc.so:/b/libiomp5.so" and server.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    plain = peer_server.vllm_server(venv, "/models/x", dtype="bfloat16", max_model_len=2048, log_dir=tmp_path)
    assert "LD_PRELOAD" not in plain.env
    assert Path(server.log_path).name == "vllm-tuned-bfloat16.log"
