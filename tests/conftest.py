import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def _forked_launch(argv, env, cwd):
    from support.up import forked_launch  # (starts the tests' forkserver: only once a benchmark needs it)

    # A benchmark runs its deployment's services on the thread counts it sets; here, where the benchmarks' plumbing
    # is checked and not their figures, they keep the tests' (a fork with other values read as torch imports
    # would start a fresh interpreter, which imports it all again).
    env = dict(env)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.pop(name, None)
        if name in os.environ:
            env[name] = os.environ[name]
    return forked_launch(argv, env, cwd)


# The benchmarks' deployments start off the tests' preloaded forkserver, as the tests' own do.
import services.bench.up_process  # noqa: E402

services.bench.up_process.LAUNCH = _forked_launch


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One model cache for the whole run (also used by subprocesses)."""
    path = tmp_path_factory.mktemp("splitserve-cache")
    os.environ["SPLITSERVE_CACHE_DIR"] = str(path)
    return path


@pytest.fixture(scope="session")
def default_model(cache_dir) -> str:
    from shared.engine.default_model import default_model_dir

    path = str(default_model_dir())
    time_kernel_choices_once(path)
    return path


def time_kernel_choices_once(model_dir: str) -> None:
    """An engine times, as it starts, which kernel serves each number of rows of its linears and which attends a
    fresh prompt chunk: most of the build of an engine of these small models, paid by every engine a test makes and
    every worker a deployment starts. Timed once here instead, on the default model, and handed to the session's
    later engines (and the processes started from it) through the variables that skip the timings; the tests of
    the timings set or unset those themselves. Variables already set (by whoever runs the suite) are kept."""
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine
    from shared.engine.packed_linear import NATIVE_MAX_ROWS_ENV, PACKED_MIN_ROWS_ENV
    from shared.engine.prefill_attention_choice import FRESH_PREFILL_ENV

    names = (NATIVE_MAX_ROWS_ENV, PACKED_MIN_ROWS_ENV, FRESH_PREFILL_ENV)
    if any(name in os.environ for name in names):
        return
    runner = LLMEngine(EngineConfig(model=model_dir, dtype="float32", num_kv_blocks=16),
                       load_tokenizer=False).executor.runners[0]
    chosen = {}
    if runner.linear_layouts is not None:  # (None: no packed layout on this CPU, nothing timed)
        chosen[NATIVE_MAX_ROWS_ENV] = str(runner.linear_layouts.native_max_rows)
        chosen[PACKED_MIN_ROWS_ENV] = str(runner.linear_layouts.packed_min_rows)
    if runner.native_prefill is not None:  # (without the native kernel SDPA attends every chunk, untimed)
        chosen[FRESH_PREFILL_ENV] = "sdpa" if runner.sdpa_fresh_prefills else "native"
    os.environ.update(chosen)


# Shapes other than the default model: each exercises a different part of the
# transformers modules the engine plugs into.
MODEL_SHAPES = {
    "qwen2-bias": dict(model_type="qwen2", hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=256),
    "qwen3-qknorm": dict(model_type="qwen3", hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=48, intermediate_size=256),
    "llama-1kv": dict(model_type="llama", hidden_size=96, num_hidden_layers=5, num_attention_heads=6,
                      num_key_value_heads=1, intermediate_size=192, tie_word_embeddings=True),
    "mistral": dict(model_type="mistral", hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=4, intermediate_size=256),
}


@pytest.fixture(scope="session")
def model_zoo(tmp_path_factory) -> dict[str, str]:
    from shared.engine.default_model import build_random_model

    root = tmp_path_factory.mktemp("zoo")
    zoo = {}
    for seed, (name, shape) in enumerate(MODEL_SHAPES.items()):
        zoo[name] = str(build_random_model(root / name, seed=seed + 1, **shape))
    return zoo


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory):
    """One real nats-server with JetStream for the whole run (tests isolate by namespace or name)."""
    from support.processes import NatsServer

    server = NatsServer(tmp_path_factory.mktemp("nats-store"))
    server.start()
    yield server
    server.stop()
