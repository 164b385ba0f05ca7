"""Continuous batching: which sequences compute how many tokens this step.

Design: there is no prefill phase or decode phase. Each sequence has
`num_computed_tokens`; a step gives it up to `num_tokens - num_computed_tokens`
more, within a per-step token budget. Running sequences go first (so decodes
are never starved by a long prompt, which is chunked instead), then waiting
ones in arrival order. With `prefill_cap` set (the engine's pacer, see
`prefill_pacer`), a step that carries decodes takes at most that many prompt
tokens, so a long chunk never stalls the tokens of running requests. When blocks run out, the most recently admitted running
sequence is preempted: its blocks are freed and it is recomputed later (its
full blocks usually survive in the prefix cache, so recompute is cheap).
"""

from collections import deque
from dataclasses import dataclass, field

from shared.engine.block_manager import BlockManager
from shared.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")


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
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefill_cap: int | None = None  # prompt tokens a step carrying decodes may take (None: the budget)
        # Prefix-cache lookups of sequences scheduled for the first time: tokens looked up, tokens found.
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Admit a sequence that already holds its blocks (imported KV) straight into the batch."""
        seq.status = SequenceStatus.RUNNING
        if seq.num_cached_tokens < 0:
            seq.num_cached_tokens = 0
        self.running.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        prompt_budget = budget
        # A sequence with one token to compute decodes; more is a chunk (of its prompt, or of its output again
        # after a preemption), which the cap limits beside decodes.
        if self.prefill_cap is not None and self.config.enable_chunked_prefill and any(
                s.num_uncomputed_tokens == 1 for s in self.running):
            prompt_budget = self.prefill_cap

        # Running sequences first, oldest first; preempt from the newest end.
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            in_prompt = seq.num_uncomputed_tokens > 1
            num_new = min(seq.num_uncomputed_tokens, budget, prompt_budget if in_prompt else budget)
            if num_new == 0:  # a chunk with the step's prompt tokens spent: next step
                index += 1
                continue
            while not self.block_manager.allocate(seq, num_new):
                victim = self.running.pop()
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
            break  # `seq` itself was preempted: nothing newer is left

        # Then waiting sequences, unless this step already had to preempt.
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            limit = min(budget, prompt_budget)
            if limit <= 0:
                break  # the step's prompt tokens are spent: in arrival order, the next step
            # A sequence arriving with imported KV already holds its blocks.
            hit = None if seq.block_table else self.block_manager.find_prefix_hit(seq)
            num_new = seq.num_tokens - (hit.num_tokens if hit else seq.num_computed_tokens)
            if num_new > limit and not self.config.enable_chunked_prefill:
                if out.scheduled:
                    break  # wait for a step of its own
                # Longer than a whole step's budget: run it alone rather than never.
            elif num_new > limit:
                num_new = limit
            if not self.block_manager.allocate(seq, num_new, hit):
                break
            self.waiting.popleft()
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = hit.num_tokens if hit else 0
                if hit is not None and self.block_manager.enable_prefix_caching:
                    self.prefix_query_tokens += (seq.num_tokens - 1) // self.block_manager.block_size * self.block_manager.block_size
                    self.prefix_hit_tokens += hit.num_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new
            prompt_budget -= num_new
        return out

    def finish(self, seq: Sequence, free_blocks: bool = True) -> None:
        """Remove a sequence (finished or aborted); its blocks are freed at once unless the caller keeps them."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
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
