"""`splitserve generate` on the built-in random model (by name) and on another local model directory: as a
process of its own where the command's process is the point (its output, its exit code on a bad model), through
its entry point here for the rest (one interpreter start with torch each, otherwise)."""

import argparse
import json
import os
import subprocess
import sys

from reference import reference_greedy, safe_seed
from transformers import AutoTokenizer

from services.cli.generate import add_parser
from shared.engine.sampling_params import SamplingParams


def run_cli(*args, env_cache):
    env = dict(os.environ, SPLITSERVE_CACHE_DIR=str(env_cache))
    return subprocess.run(
        [sys.executable, "-m", "services.cli.main", "generate", *args],
        capture_output=True, text=True, timeout=300, env=env,
    )


def run_here(*args, capsys) -> subprocess.CompletedProcess:
    """`splitserve generate ARGS` through the command's own entry point in this process: what `run_cli` gives
    without a new interpreter importing torch first (the tests that run the command as a process keep it)."""
    from services.cli.main import main

    capsys.readouterr()
    code = main(["generate", *args])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["splitserve", "generate", *args], code, out, err)


def test_the_sampling_options_default_to_the_sampling_params_defaults_but_greedy_and_64_tokens():
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args, defaults = parser.parse_args(["generate", "--prompt", "x"]), SamplingParams()
    assert (args.max_tokens, args.temperature) == (64, 0.0)  # the command's own choice, as before
    assert ((args.top_p, args.top_k, args.min_p, args.seed, args.logprobs)
            == (defaults.top_p, defaults.top_k, defaults.min_p, defaults.seed, defaults.logprobs))


def test_generate_json_on_default_model_matches_transformers(cache_dir, default_model):
    result = run_cli("--model", "splitserve-default-llama", "--prompt", "The old clock in the hall",
                     "--max-tokens", "24", "--temperature", "0", "--json", env_cache=cache_dir)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    prompt = AutoTokenizer.from_pretrained(default_model)("The old clock in the hall").input_ids
    expected, _ = reference_greedy(default_model, prompt, 24, ignore_eos=False)
    assert out["token_ids"] == expected and out["model"] == default_model
    assert out["text"] and out["finish_reason"] in ("length", "stop")


def test_generate_on_a_qwen3_directory_streams_the_seeded_draws(model_zoo, capsys):
    model = model_zoo["qwen3-qknorm"]
    prompt = AutoTokenizer.from_pretrained(model)("hello there").input_ids
    seed, expected = safe_seed(model, prompt, 12, temperature=0.8)
    args = ("--model", model, "--prompt", "hello there", "--max-tokens", "12", "--temperature", "0.8",
            "--seed", str(seed), "--ignore-eos")
    result = run_here(*args, "--json", capsys=capsys)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["prompt_token_ids"] == prompt and out["token_ids"] == expected
    assert expected != reference_greedy(model, prompt, 12)[0]  # the temperature and seed were used
    streamed = run_here(*args, capsys=capsys)
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout == out["text"] + "\n" and out["text"].strip()


def test_generate_reports_a_bad_model_directory(cache_dir, tmp_path):
    result = run_cli("--model", str(tmp_path / "missing"), "--prompt", "x", env_cache=cache_dir)
    assert result.returncode == 2
    assert "does not exist" in result.stderr and "Traceback" not in result.stderr


def test_generate_reports_bad_parameters(default_model, capsys):
    result = run_here("--model", default_model, "--prompt", "x", "--top-p", "1.5", capsys=capsys)
    assert result.returncode == 2 and "top_p" in result.stderr


def test_generate_chat_wraps_the_prompt_as_a_user_message(default_model, capsys):
    result = run_here("--model", "splitserve-default-llama", "--prompt", "What is the capital of France?", "--chat",
                      "--max-tokens", "12", "--temperature", "0", "--json", capsys=capsys)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    tokenizer = AutoTokenizer.from_pretrained(default_model)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         add_generation_prompt=True, tokenize=False)
    assert chat.endswith("<|im_start|>assistant\n")  # the template this model ships with
    prompt = tokenizer(chat, add_special_tokens=False).input_ids
    assert out["prompt_token_ids"] == prompt
    assert out["token_ids"] == reference_greedy(default_model, prompt, 12, ignore_eos=False)[0]


def test_generate_stops_at_a_stop_string(default_model, capsys):
    full = json.loads(run_here("--model", "splitserve-default-llama", "--prompt", "The old clock in the hall",
                               "--max-tokens", "24", "--temperature", "0", "--ignore-eos", "--json",
                               capsys=capsys).stdout)
    text = full["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]  # three characters from the middle of the full answer
    assert stop.strip(), text
    result = run_here("--model", "splitserve-default-llama", "--prompt", "The old clock in the hall", "--max-tokens",
                      "24", "--temperature", "0", "--ignore-eos", "--stop", stop, "--json", capsys=capsys)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    # The text ends just before the stop string's first occurrence, which it does not include.
    assert out["finish_reason"] == "stop" and out["text"] == text[:text.index(stop)]
    assert len(out["token_ids"]) < 24 and out["token_ids"] == full["token_ids"][:len(out["token_ids"])]
