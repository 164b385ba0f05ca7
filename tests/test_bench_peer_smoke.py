"""The peer benchmark's pure parts (prompts every server tokenizes alike, what each server is sent, output
agreement, the table) and a quick run against splitserve alone (CI never installs vLLM)."""

import json

import pytest

from loadtest.bench_peer import (
    QUICK, WORKLOADS, build_workload, compare_outputs, format_table, main, server_conversations,
    server_request_args, summarize, workload_args,
)
from loadtest.peer_server import engine_limits


def _request(conversation: int, text: str, *, prompt_tokens: int = 128, itl_ms=(10.0, 20.0), error=None) -> dict:
    return {"conversation": conversation, "turn": 0, "text": text, "error": error, "prompt_tokens": prompt_tokens,
            "output_tokens": 3, "itl_ms": list(itl_ms)}


def _result(dataset: str, requests: list[dict], **settings) -> dict:
    figures = {"mean": 1.0, "p50": 50.0, "p90": 90.0, "p95": 95.0, "p99": 99.0}
    return {"settings": {"dataset": dataset, "input_len": 128, "output_len": 3, "long_input_len": 1600,
                         "long_output_len": 3, **settings},
            "requests": requests, "completed": sum(r["error"] is None for r in requests),
            "failed": sum(r["error"] is not None for r in requests), "duration_s": 12.5, "output_throughput": 42.0,
            "cached_tokens": 0, "ttft_ms": figures, "itl_ms": figures, "tpot_ms": figures}


def test_prompts_tokenize_back_into_their_ids(default_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model)
    args, conversations = build_workload({**WORKLOADS["mixed"], **QUICK["mixed"]}, tokenizer)
    assert len(conversations) == QUICK["mixed"]["num_prompts"]
    for (request,) in conversations:
        assert tokenizer(request.text).input_ids == request.token_ids
        assert request.prompt_len == len(request.token_ids) <= args.long_input_len
    again = build_workload({**WORKLOADS["mixed"], **QUICK["mixed"]}, tokenizer)[1]
    assert [c[0].token_ids for c in again] == [c[0].token_ids for c in conversations]  # the same for every server


def test_each_server_is_asked_for_exact_lengths_its_own_way():
    args = workload_args(WORKLOADS["steady-c1"])
    vllm = server_request_args("vllm", args)
    assert vllm.ignore_eos and vllm.temperature == 0.0 and not vllm.extra_body
    hf = server_request_args("transformers", args)
    assert not hf.ignore_eos and json.loads(hf.extra_body["generation_config"]) == {"eos_token_id": None,
                                                                                    "do_sample": False}
    assert args.ignore_eos is False  # the shared workload is not changed


def test_transformers_gets_text_and_the_others_token_ids(default_model):
    from transformers import AutoTokenizer

    _, conversations = build_workload({**WORKLOADS["steady-c1"], "num_prompts": 2},
                                      AutoTokenizer.from_pretrained(default_model))
    assert all(c[0].token_ids for c in server_conversations("colocated", conversations))
    texts = server_conversations("transformers", conversations)
    assert [c[0].token_ids for c in texts] == [None, None]
    assert [c[0].text for c in texts] == [c[0].text for c in conversations]


def test_outputs_compared_per_request():
    reference = [_request(0, "a b c"), _request(1, "x y z"), _request(2, "p q"), _request(3, "ends in \ufffd"),
                 _request(4, "failed there", error=None)]
    other = [_request(3, "ends in "), _request(1, "x y w"), _request(0, "a b c"), _request(2, "p q"),
             _request(4, "", error="HTTP 500")]
    agreement = compare_outputs(reference, other, encode=str.split)
    assert (agreement["compared"], agreement["identical"]) == (4, 3)  # the failed one is not compared
    assert agreement["identical_rate"] == 0.75
    assert agreement["mean_common_prefix_tokens_when_different"] == 2.0  # x y | z vs w
    assert agreement["examples"][0]["conversation"] == 1
    assert compare_outputs([], other, encode=str.split)["identical_rate"] is None


def test_mixed_short_requests_and_output_lengths():
    requests = [_request(0, "s", itl_ms=(10.0, 10.0)), _request(1, "l", prompt_tokens=1600, itl_ms=(500.0,)),
                {**_request(2, "s"), "output_tokens": 2}]
    figures = summarize(_result("mixed", requests))
    assert (figures["short_requests"], figures["long_requests"]) == (2, 1)
    assert figures["short_itl_ms"]["p99"] < 100  # the long request's gap is not a short request's
    assert figures["wrong_output_lengths"] == 1
    assert figures["tokens_per_chunk"] == pytest.approx(1.0)  # 3 + 3 + 2 tokens in 3 + 2 + 3 chunks


def test_table_has_a_block_per_dtype_and_marks_what_did_not_run():
    settings = {"steady-c16": {**WORKLOADS["steady-c16"]}, "mixed": {**WORKLOADS["mixed"]}}
    ok = {"steady-c16": summarize(_result("random", [_request(0, "t")])),
          "mixed": summarize(_result("mixed", [_request(0, "t")]))}
    failed = {"steady-c16": summarize(_result("random", [_request(0, "", error="boom")]))}
    summary = {"float32": {"vllm": ok, "colocated": ok, "disagg-2d": {"mixed": ok["mixed"]}},
               "bfloat16": {"vllm": ok, "colocated": failed, "disagg-2d": {}}}
    agreement = {"float32": {"colocated": {"steady-c16": {"identical": 1, "compared": 1}}}}
    table = format_table(summary, agreement, settings, ["vllm", "colocated", "disagg-2d"], "vllm")
    lines = table.splitlines()
    assert lines[0] == "| | vllm | colocated | disagg-2d |"
    assert "| **float32** |" in lines[2] and any("| **bfloat16** |" in line for line in lines)
    assert "| 32 requests x 64 tokens, concurrency 16: output tokens/s | 42 | 42 | - |" in lines
    assert "| mixed, Poisson 2/s, concurrency 8: wall time for 48 requests | 12.5 s | 12.5 s | 12.5 s |" in lines
    assert "| steady-c16: outputs identical to vllm's | - | 1/1 | - |" in lines
    bf16 = lines[lines.index(next(line for line in lines if "**bfloat16**" in line)):]
    assert "| 32 requests x 64 tokens, concurrency 16: output tokens/s | 42 | - | - |" in bf16
    assert "| steady-c16: failed / wrong output length | - | 1 / 0 | - |" in bf16


def test_peers_get_splitserve_worker_limits():
    limits = engine_limits()
    assert limits["max_num_seqs"] > 0 and limits["max_num_batched_tokens"] > 0 and limits["block_size"] > 0
    assert limits["kv_cache_bytes"] > 0


@pytest.mark.timeout(300)  # a hang guard only
def test_quick_run_against_splitserve(default_model, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPLITSERVE_KV_CACHE_BYTES", str(1 << 30))  # main sets it for the workers; undone after
    out, table, plot = tmp_path / "peer.json", tmp_path / "peer.md", tmp_path / "peer.png"
    rc = main(["--quick", "--servers", "colocated,disagg", "--dtypes", "float32", "--workloads", "steady-c1,mixed",
               "--model", default_model, "--run-dir-root", str(tmp_path / "runs"), "--out", str(out),
               "--table", str(table), "--plot", str(plot)])
    printed = capsys.readouterr().out
    assert rc == 0, printed[-3000:]
    report = json.loads(out.read_text())
    assert report["settings"]["reference"] == "colocated" and report["peer_versions"] is None
    for server in ("colocated", "disagg"):
        run = report["runs"]["float32"][server]
        assert run["error"] is None and run["teardown"]["clean"], run
        assert set(run["results"]) == {"steady-c1", "mixed"}
        assert run["placement"] and "unbound" not in run["placement"].values(), run["placement"]  # up --cpus
        for workload, figures in report["summary"]["float32"][server].items():
            assert figures["failed"] == 0 and figures["wrong_output_lengths"] == 0, (server, workload)
    assert report["summary"]["float32"]["disagg"]["mixed"]["long_requests"] == 2
    assert report["agreement"]["float32"]["disagg"]["mixed"]["compared"] == QUICK["mixed"]["num_prompts"]
    assert "| **float32** |" in table.read_text() and plot.stat().st_size > 10_000
