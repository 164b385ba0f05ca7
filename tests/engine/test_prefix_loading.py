"""A prefix loaded from outside when the engine admits a request (a connector's `external_prefix`/`start_load`):
the request runs on from the loaded KV exactly as if it had computed it, waits without holding back others while
the connector finds out, computes everything when a load fails, and keeps its blocks away from reuse until an
aborted load is reported."""

import pytest
import torch

from reference import safe_prompts
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.errors import InvalidRequestError
from shared.engine.kv_connector import KVConnector, LoadEnd
from shared.engine.sampling_params import SamplingParams
from support.kv_from_elsewhere import KVFromElsewhere

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
BLOCK = 16


class WriteBack(KVConnector):
    """Keeps every block the engine hands out, by hash (what a worker puts in the kv-store)."""

    def __init__(self, stored: dict):
        self.stored = stored

    def blocks_computed(self, block_hashes, export):
        self.stored.update(zip(block_hashes, export(list(range(len(block_hashes))))))


class BlockStore(KVConnector):
    """Loads blocks from a dict by hash, as the kv-store tier does over the network: its answer can come only
    after some steps, and its loads end when `finish` is called (at once unless `deferred`)."""

    name = "store"

    def __init__(self, engine, stored: dict, *, unknown_for: dict | None = None, deferred: bool = False):
        self.engine, self.stored = engine, stored
        self.unknown_for = unknown_for or {}  # request id -> how many more times to answer "not known yet"
        self.deferred = deferred
        self.asked, self.loads, self.ended = [], [], []
        self._in_flight, self._done = [], []

    def external_prefix(self, request_id, token_ids, num_local_tokens):
        self.asked.append((request_id, num_local_tokens))
        if self.unknown_for.get(request_id, 0) > 0:
            self.unknown_for[request_id] -= 1
            return None
        held = 0
        for block_hash in self.engine.prefix_block_hashes(token_ids):
            if block_hash not in self.stored:
                break
            held += 1
        return held * BLOCK - num_local_tokens

    def start_load(self, request_id, block_ids, first_token, num_tokens):
        self.loads.append((request_id, list(block_ids), first_token, num_tokens))
        hashes = self.engine.prefix_block_hashes(self.engine.get_sequence(request_id).token_ids)
        self._in_flight.append((request_id, block_ids, hashes[first_token // BLOCK:(first_token + num_tokens) // BLOCK]))
        if not self.deferred:
            self.finish()

    def finish(self, ok: bool = True):
        for request_id, block_ids, hashes in self._in_flight:
            if ok:
                self.engine.write_blocks(block_ids[:len(hashes)], torch.stack([self.stored[h] for h in hashes]))
            self._done.append(LoadEnd(request_id, ok))
        self._in_flight.clear()

    def finished_loads(self):
        done, self._done = self._done, []
        return done

    def request_finished(self, request_id):
        self.ended.append(request_id)


def make_engine(model_dir, **overrides):
    return LLMEngine(EngineConfig(model=model_dir, dtype="float32", num_kv_blocks=128, **overrides),
                     load_tokenizer=False)


def engine_with_store(model_dir, stored, **store_options):
    engine = make_engine(model_dir)
    store = BlockStore(engine, stored, **store_options)
    engine.connect(store)
    return engine, store


def run_to_end(engine, request_id, prompt, params=GREEDY):
    engine.add_request(request_id, prompt, params)
    tokens, cached = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
            cached = out.num_cached_tokens
    return tokens, cached


@pytest.fixture(scope="module")
def written_back(default_model):
    """A 70-token prompt, its greedy tokens, and the blocks one engine wrote back while generating them."""
    prompt, expected = safe_prompts(default_model, 2048, [70], GREEDY.max_tokens, seed=9)[0]
    stored = {}
    source = make_engine(default_model, max_num_batched_tokens=32)
    source.connect(WriteBack(stored))
    assert source.generate([prompt], GREEDY)[0].token_ids == expected
    return prompt, expected, stored


def test_a_prefix_loaded_at_admission_continues_identically(default_model, written_back):
    prompt, expected, stored = written_back
    target, store = engine_with_store(default_model, stored, unknown_for={"r": 2})
    assert run_to_end(target, "r", prompt) == (expected, 64)  # 4 full blocks of the 70-token prompt loaded
    # Asked at each step until it knew, always with nothing cached locally; one load, from the first token.
    assert store.asked == [("r", 0)] * 3
    assert [(rid, len(blocks), first, n) for rid, blocks, first, n in store.loads] == [("r", 4, 0, 64)]
    assert store.ended == ["r"] and target.block_manager.num_used_blocks == 0
    counts = target.prefix_cache_counts()
    assert counts["hit_tokens"] == {"local": 0, "store": 64}
    assert counts["query_tokens"] == 64 and counts["prompt_tokens_computed"] == 70 - 64

    # The conversation's next turn: its decoded blocks were written back too (the source's 5th full block).
    next_turn = prompt + expected + [5, 6, 7]
    cold, _ = run_to_end(make_engine(default_model, enable_prefix_caching=False), "cold", next_turn)
    fresh = make_engine(default_model)
    fresh.connect(BlockStore(fresh, stored))
    assert run_to_end(fresh, "warm", next_turn) == (cold, 80)


def test_only_what_the_local_cache_lacks_is_loaded(default_model, written_back):
    prompt, expected, stored = written_back
    target = make_engine(default_model)
    target.generate([prompt[:40]], SamplingParams(temperature=0.0, max_tokens=1))  # caches the first 2 blocks
    store = BlockStore(target, stored)
    target.connect(store)
    assert run_to_end(target, "r", prompt) == (expected, 64)
    assert store.asked[-1] == ("r", 32) and store.loads[-1][2:] == (32, 32)
    assert target.prefix_cache_counts()["hit_tokens"] == {"local": 32, "store": 32}


def test_a_failed_load_computes_the_prompt_instead(default_model, written_back):
    prompt, expected, stored = written_back
    target, store = engine_with_store(default_model, stored, deferred=True)
    target.add_request("r", prompt, GREEDY)
    assert target.step() == [] and store.loads and target.block_manager.num_used_blocks == 4
    store.finish(ok=False)
    tokens = []
    while target.has_unfinished_requests():
        tokens += [t for out in target.step() for t in out.new_token_ids]
    assert tokens == expected
    assert len(store.asked) == 1  # not asked again after its load failed
    counts = target.prefix_cache_counts()
    assert counts["hit_tokens"] == {"local": 0, "store": 0} and counts["prompt_tokens_computed"] == 70


def test_an_aborted_request_keeps_its_blocks_until_its_load_is_reported(default_model, written_back):
    prompt, expected, stored = written_back
    target, store = engine_with_store(default_model, stored, deferred=True)
    target.add_request("r", prompt, GREEDY)
    target.step()
    loading_blocks = store.loads[0][1]
    assert target.abort_request("r") and store.ended == ["r"]
    # The load may still write into them: none is reused, and the id stays taken, until the load ends.
    assert target.block_manager.num_used_blocks == 4 and target.has_unfinished_requests()
    with pytest.raises(InvalidRequestError, match="already in use"):
        target.add_request("r", prompt, GREEDY)
    other = safe_prompts(default_model, 2048, [50], 4, seed=3)[0]
    target.add_request("other", other[0], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    target.step()
    assert not set(target.get_sequence("other").block_table) & set(loading_blocks)
    store.finish(ok=True)
    while target.has_unfinished_requests():
        target.step()
    assert target.block_manager.num_used_blocks == 0
    store.deferred = False
    assert run_to_end(target, "r", prompt) == (expected, 64)  # the id is free again


def test_a_request_whose_offer_is_unknown_does_not_hold_back_those_behind_it(default_model, written_back):
    prompt, expected, stored = written_back
    target, store = engine_with_store(default_model, stored, unknown_for={"waits": 10**9})
    target.add_request("waits", prompt, GREEDY)
    short, short_expected = safe_prompts(default_model, 2048, [20], 5, seed=4)[0]  # one block, not in the store
    target.add_request("short", short, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    tokens = []
    for _ in range(10):
        tokens += [t for out in target.step() if out.request_id == "short" for t in out.new_token_ids]
    assert tokens == short_expected and target.get_sequence("short") is None
    assert ("short", 0) in store.asked and store.loads == []
    target.step()
    assert target.stalled and target.has_unfinished_requests()  # only the waiting one is left: nothing ran
    store.unknown_for["waits"] = 0
    rest = []
    while target.has_unfinished_requests():
        rest += [t for out in target.step() for t in out.new_token_ids]
    assert rest == expected and not target.stalled


@pytest.mark.parametrize("ok", [True, False])
def test_a_prompt_loaded_whole_goes_on_after_the_token_sampled_elsewhere(default_model, ok):
    prompt, expected = safe_prompts(default_model, 2048, [45], GREEDY.max_tokens, seed=7)[0]
    source = make_engine(default_model)
    source.add_request("p", prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), hold_kv=True)
    first = source.step()[0].new_token_ids[0]
    target = make_engine(default_model)
    target.generate([prompt[:40]], SamplingParams(temperature=0.0, max_tokens=1))  # a local hit it must not read
    connector = KVFromElsewhere(target, [source.export_kv("p")], first, request_ids={"d"}, ok=ok, num_cached_tokens=7)
    target.connect(connector)
    target.add_request("d", prompt, GREEDY, read_prefix_cache=False)
    tokens, cached = [first], None
    while target.has_unfinished_requests():
        for out in target.step():
            tokens += out.new_token_ids
            cached = out.num_cached_tokens
    assert tokens == expected
    assert connector.loads == [("d", 0, 45, 3)]  # every prompt token, from the first block
    # Loaded: the cached tokens are the source's; failed: computed here, from this engine's own prefix cache.
    assert cached == (7 if ok else 32)
    assert target.prefix_cache_counts()["prompt_tokens_computed"] == 40 + (0 if ok else 45 - 32)  # 40: the hit's


def test_a_request_over_at_the_token_sampled_elsewhere_is_dropped_with_its_blocks(default_model):
    prompt, _ = safe_prompts(default_model, 2048, [45], 1, seed=7)[0]
    target = make_engine(default_model)
    target.connect(KVFromElsewhere(target, [], 5, request_ids={"d"}, ok=False, over=True))
    target.add_request("d", prompt, GREEDY, read_prefix_cache=False)
    assert target.step() == [] and target.step() == []
    assert not target.has_unfinished_requests() and target.block_manager.num_used_blocks == 0
