"""Continuous batching: which sequences compute how many tokens this step.

Design: there is no prefill phase or decode phase. Each sequence has
`num_computed_tokens`; a step gives it up to `num_tokens - num_computed_tokens`
more, within a per-step token budget. Running sequences go first (so decodes
are never starved by a long prompt, which is chunked instead), then waiting
ones in arrival order. With `prefill_cap` set (the engine's pacer, see
`prefill_pacer`), a step that carries decodes takes at most that many prompt
tokens, so a long chunk never stalls the tokens of running requests. When blocks run out, the most recently admitted running
sequence is preempted: its blocks are freed and it is recomputed later (its
full blocks usually survive in the prefix cache, so recompute is cheap); between tenants, the newest of the lowest
priority and of the tenant holding the most places.

A waiting sequence admitted for the first time may have more of its prefix
outside (the kv-store): the engine's connectors are asked, and if they offer
tokens, the sequence gets its blocks and waits LOADING, out of the batch, until
its load is reported (then it runs from there, or computes all if the load
failed). A sequence whose offer is not known yet keeps its place, and those
behind it go first.

Between tenants (`batch_share`): the waiting sequence admitted next is the highest priority's, then the one of
the tenant holding the fewest places; when the batch is full (`max_num_seqs`), a running sequence of a tenant
holding more than its share, or of a lower priority, is preempted for it before the step is planned. Such a
waiting sequence whose prompt fits what a step may take beside decodes goes ahead of them: a step of those prompts
alone, never two in a row, so that its first token does not wait for a step carrying the whole batch's decodes.
"""

from collections import Counter, deque
from dataclasses import dataclass, field

from shared.engine import batch_share
from shared.engine.block_manager import BlockManager, PrefixHit
from shared.engine.defaults import (DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, DEFAULT_SCHEDULING_POLICY,
                                    SCHEDULING_POLICIES)
from shared.engine.kv_connector import KVConnectors
from shared.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    enable_chunked_prefill: bool = True
    policy: str = DEFAULT_SCHEDULING_POLICY  # "fair": shared between tenants (`batch_share`); "fcfs": by arrival

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.policy!r}")


@dataclass(slots=True)
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, connectors: KVConnectors | None = None):
        """`connectors`: asked for prefixes to load from outside (when one implements `external_prefix`)."""
        self.config = config
        self.block_manager = block_manager
        self.connectors = connectors
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.loading: dict[str, tuple[Sequence, int]] = {}  # request id -> (sequence, tokens computed once loaded)
        self.abandoned: dict[str, Sequence] = {}  # finished while loading: blocks freed when the load is reported
        self.num_preemptions = 0
        self.num_share_preemptions = 0  # of them, places given to another tenant's or a higher priority's request
        self.went_ahead = False  # the last step was one of prompts going ahead of the decodes
        self.prefill_cap: int | None = None  # prompt tokens a step carrying decodes may take (None: the budget)
        # Prefix-cache lookups of sequences scheduled for the first time: tokens looked up, tokens found.
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading or self.abandoned)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        shared = self._shared_by_several()
        given_up = self._share_places() if shared else []
        budget = self.config.max_num_batched_tokens
        prompt_budget = budget
        # A sequence with one token to compute decodes; more is a chunk (of its prompt, or of its output again
        # after a preemption), which the cap limits beside decodes.
        if self.prefill_cap is not None and self.config.enable_chunked_prefill and any(
                s.num_uncomputed_tokens == 1 for s in self.running):
            prompt_budget = self.prefill_cap

        # A step of the prompts that go ahead of the running decodes (`batch_share.goes_ahead`), never two in a
        # row; else the running sequences first.
        ahead = self._going_ahead(given_up, prompt_budget) if shared and not self.went_ahead else []
        beside_decodes = prompt_budget
        if ahead:
            budget = prompt_budget = min(budget, prompt_budget)
        else:
            budget, prompt_budget = self._schedule_running(out, shared, budget, prompt_budget)

        # Then waiting sequences, unless this step already had to preempt.
        awaiting: list[Sequence] = []  # their connectors' offer is not known yet: they keep their place
        while (self.waiting and budget > 0 and not out.preempted
               and len(self.running) + len(self.loading) < self.config.max_num_seqs):
            seq = self._next_waiting(given_up, ahead) if shared else self.waiting[0]
            if seq is None:
                break
            limit = min(budget, prompt_budget, _chunk_cap(seq, self.config.enable_chunked_prefill))
            if limit <= 0:
                break  # the step's prompt tokens are spent: in arrival order, the next step
            # A sequence whose prefix was loaded from outside already holds its blocks.
            hit = None if seq.block_table else self._prefix_hit(seq)
            if hit is not None and self._asks_connectors(seq):
                offer = self._external_offer(seq, hit)
                if offer is None:
                    self.waiting.remove(seq)
                    awaiting.append(seq)
                    continue
                if offer > 0:
                    if not self.block_manager.allocate(seq, offer, hit):
                        break
                    self.waiting.remove(seq)
                    self._start_load(seq, offer)
                    continue
            num_new = seq.num_tokens - (hit.num_tokens if hit else seq.num_computed_tokens)
            if num_new > limit and not self.config.enable_chunked_prefill:
                if out.scheduled:
                    break  # wait for a step of its own
                # Longer than a whole step's budget: run it alone rather than never.
            elif num_new > limit:
                num_new = limit
            if not self.block_manager.allocate(seq, num_new, hit):
                break
            self.waiting.remove(seq)
            if seq.num_cached_tokens < 0:
                self._count_prefix_lookup(seq, hit.num_tokens if hit else 0)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new
            prompt_budget -= num_new
        self.waiting.extendleft(reversed(awaiting))
        self.went_ahead = bool(ahead and out.scheduled)
        if ahead and not out.scheduled:  # none of them could start (blocks, a load): the decodes' step after all
            self._schedule_running(out, shared, self.config.max_num_batched_tokens, beside_decodes)
        return out

    def _schedule_running(self, out: SchedulerOutput, shared: bool, budget: int,
                          prompt_budget: int) -> tuple[int, int]:
        """Running sequences first, oldest first; when blocks run out, the victim is the newest (between tenants,
        `batch_share.shortage_victim`'s), unscheduled if it already had its tokens. Returns the budgets left."""
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            in_prompt = seq.num_uncomputed_tokens > 1
            num_new = min(seq.num_uncomputed_tokens, budget, prompt_budget if in_prompt else budget,
                          _chunk_cap(seq, self.config.enable_chunked_prefill))
            if num_new == 0:  # a chunk with the step's prompt tokens spent: next step
                index += 1
                continue
            while not self.block_manager.allocate(seq, num_new):
                victim_index = self._shortage_victim(shared)
                victim = self.running.pop(victim_index)
                if victim_index < index:  # passed already: its tokens, if it had any, go back to the step
                    index -= 1
                    taken = next((s for s in out.scheduled if s.seq is victim), None)
                    if taken is not None:
                        out.scheduled.remove(taken)
                        budget += taken.num_new_tokens
                        if victim.num_uncomputed_tokens > 1:
                            prompt_budget += taken.num_new_tokens
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSequence(seq, num_new))
                budget -= num_new
                if in_prompt:
                    prompt_budget -= num_new
                index += 1
                continue
            if not shared:
                break  # `seq` itself was preempted, the newest: nothing newer is left
        return budget, prompt_budget

    def _shortage_victim(self, shared: bool) -> int:
        if not shared:
            return len(self.running) - 1
        return batch_share.shortage_victim([_claim(s) for s in self.running], self._held())

    def _going_ahead(self, given_up: list[Sequence], limit: int) -> list[Sequence]:
        """The waiting sequences whose prompts go ahead of the running decodes in a step of their own: those
        `batch_share.goes_ahead` says, of at most `limit` tokens left to compute (a longer one would stall the
        decodes: it is chunked beside them), when some running sequence decodes."""
        if not any(s.num_uncomputed_tokens == 1 for s in self.running):
            return []
        running, held = [_claim(s) for s in self.running], self._held()
        return [s for s in self.waiting if s not in given_up and s.num_uncomputed_tokens <= limit
                and batch_share.goes_ahead(_claim(s), running, held)]

    def _next_waiting(self, given_up: list[Sequence], among: list[Sequence]) -> Sequence | None:
        """The waiting sequence to admit next between tenants (`batch_share`), of `among` if given; one that gave
        its place up this step does not take it back in this step."""
        candidates = [s for s in among or self.waiting if s not in given_up and (not among or s in self.waiting)]
        if not candidates:
            return None
        return candidates[batch_share.next_waiting([_claim(s) for s in candidates], self._held())]

    def _held(self) -> Counter:
        """Places in the batch each tenant holds (running or loading)."""
        return Counter(s.params.tenant for s in (*self.running, *(seq for seq, _ in self.loading.values())))

    def _shared_by_several(self) -> bool:
        """Whether the batch is shared between tenants and the waiting and running sequences claim places as more
        than one (tenant, priority)."""
        if self.config.policy == "fcfs":
            return False
        claims = {(s.params.tenant, s.params.priority) for s in (*self.waiting, *self.running)}
        return len(claims) > 1

    def _share_places(self) -> list[Sequence]:
        """With the batch full and shared by several, preempt the running sequences whose places go to waiting ones
        (`batch_share`); returns them."""
        free = self.config.max_num_seqs - len(self.running) - len(self.loading)
        if not self.waiting or free >= len(self.waiting):
            return []
        running = list(self.running)
        given = batch_share.places_to_give([_claim(s) for s in self.waiting], [_claim(s) for s in running],
                                           self._held(), max(free, 0))
        given_up = [running[index] for index in sorted(given, reverse=True)]
        for seq in given_up:  # the newest first: the oldest given up ends first in line
            self.running.remove(seq)
            self._preempt(seq)
            self.num_share_preemptions += 1
        return given_up

    def load_finished(self, request_id: str, ok: bool) -> int | None:
        """A connector's load for a sequence of this scheduler ended: the tokens it made computed (0 when it
        failed: the sequence computes them); None if the request is not one of this scheduler's."""
        abandoned = self.abandoned.pop(request_id, None)
        if abandoned is not None:
            self.block_manager.free(abandoned)
            return 0
        entry = self.loading.pop(request_id, None)
        if entry is None:
            return None
        seq, loaded_end = entry
        num_local = seq.num_computed_tokens
        counted = seq.read_prefix_cache
        seq.read_prefix_cache = True  # from here on (recomputed, preempted) it is like any other
        if not ok:
            self.block_manager.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)
            return 0
        # A load of every token (and no token sampled elsewhere after them) leaves the last to compute again.
        seq.num_computed_tokens = min(loaded_end, seq.num_tokens - 1)
        if counted:
            self._count_prefix_lookup(seq, num_local)
        seq.num_cached_tokens = loaded_end
        if seq.num_uncomputed_tokens == 1:  # it decodes: into the batch (its slot was kept while it loaded)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        else:  # the rest of its prompt is a chunk like any other's, first in line
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)
        return loaded_end - num_local

    def _prefix_hit(self, seq: Sequence) -> PrefixHit:
        # A request for its prompt's logprobs computes the whole prompt (a cached position has no logits).
        if not seq.read_prefix_cache or seq.params.prompt_logprobs is not None:
            return PrefixHit([], 0)
        return self.block_manager.find_prefix_hit(seq)

    def _asks_connectors(self, seq: Sequence) -> bool:
        """At a sequence's first admission."""
        return (self.connectors is not None and not seq.external_asked and seq.num_cached_tokens < 0
                and seq.params.prompt_logprobs is None and self.connectors.wants("external_prefix"))

    def _external_offer(self, seq: Sequence, hit: PrefixHit) -> int | None:
        """Tokens to load after the local hit (all the rest, or whole blocks); None: ask later."""
        offer = self.connectors.external_prefix(seq.request_id, seq.token_ids, hit.num_tokens)
        if offer is None:
            return None
        offer = max(0, min(offer, seq.num_tokens - hit.num_tokens))
        if hit.num_tokens + offer < seq.num_tokens:
            block_size = self.block_manager.block_size
            offer = offer // block_size * block_size
        if offer == 0:
            seq.external_asked = True
        return offer

    def _start_load(self, seq: Sequence, num_tokens: int) -> None:
        seq.external_asked = True
        seq.status = SequenceStatus.LOADING
        first = seq.num_computed_tokens  # the local hit, adopted by `allocate`
        self.loading[seq.request_id] = (seq, first + num_tokens)
        self.connectors.start_load(seq.request_id, seq.block_table[first // self.block_manager.block_size:],
                                   first, num_tokens)

    def _count_prefix_lookup(self, seq: Sequence, num_local_tokens: int) -> None:
        """A sequence's first scheduling: its prefix-cache lookup and what the local cache held."""
        seq.num_cached_tokens = num_local_tokens
        if self.block_manager.enable_prefix_caching:
            block_size = self.block_manager.block_size
            self.prefix_query_tokens += (seq.num_tokens - 1) // block_size * block_size
            self.prefix_hit_tokens += num_local_tokens

    def finish(self, seq: Sequence, free_blocks: bool = True) -> None:
        """Remove a sequence (finished or aborted); its blocks are freed at once unless the caller keeps them."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.LOADING:
            del self.loading[seq.request_id]
            seq.status = SequenceStatus.FINISHED
            self.abandoned[seq.request_id] = seq  # its blocks are the load's until it is reported
            return
        seq.status = SequenceStatus.FINISHED
        if free_blocks:
            self.block_manager.free(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)


def _claim(seq: Sequence) -> batch_share.Claim:
    return batch_share.Claim(seq.params.tenant, seq.params.priority)


# A prompt whose logprobs are wanted returns logits for every position it computes: its chunks are capped so that
# a step's extra logits stay bounded (256 x a 152k vocabulary is 156 MB of float32).
PROMPT_LOGPROBS_CHUNK = 256


def _chunk_cap(seq: Sequence, chunked_prefill: bool) -> int:
    if chunked_prefill and seq.params.prompt_logprobs is not None and seq.num_uncomputed_tokens > 1:
        return PROMPT_LOGPROBS_CHUNK
    return 1 << 62
