"""The plain-data description of one forward step, shared by every layer range.

The scheduler's decisions become a `StepBatch` of ints and lists, so the same
step can be executed by one runner, by a chain of layer-range runners in one
process, or by stage processes that receive it over the wire: the struct is
itself the wire's part (`contracts.StageActivation.batch`). Like
`sampling_params`, this module imports only msgspec at run time, so
`contracts` can carry it without importing the engine's heavy modules.
"""

from typing import TYPE_CHECKING

import msgspec
from msgspec import field

if TYPE_CHECKING:
    from shared.engine.scheduler import SchedulerOutput


class StepBatch(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    request_ids: list[str]
    token_ids: list[int]  # every scheduled token, sequence after sequence
    positions: list[int]  # absolute position of each token in its sequence
    query_lens: list[int]  # tokens computed this step, per sequence
    context_lens: list[int]  # tokens with KV after this step, per sequence
    block_tables: list[list[int]]
    sample_indices: list[int]  # sequences (by index) whose last token's logits are sampled
    block_size: int
    # Tokens (indices into token_ids) whose logits are wanted too, after the sampled ones: prompt logprobs
    extra_logit_indices: list[int] = field(default_factory=list)

    @classmethod
    def empty(cls, block_size: int) -> "StepBatch":
        return cls(request_ids=[], token_ids=[], positions=[], query_lens=[], context_lens=[], block_tables=[],
                   sample_indices=[], block_size=block_size)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def build_step_batch(out: "SchedulerOutput", block_size: int) -> StepBatch:
    batch = StepBatch.empty(block_size)
    for index, item in enumerate(out.scheduled):
        seq, num_new = item.seq, item.num_new_tokens
        start = seq.num_computed_tokens
        end = start + num_new
        batch.request_ids.append(seq.request_id)
        batch.token_ids.extend(seq.token_ids[start:end])
        batch.positions.extend(range(start, end))
        batch.query_lens.append(num_new)
        batch.context_lens.append(end)
        batch.block_tables.append(seq.block_table[: -(-end // block_size)])
        if end == seq.num_tokens:
            batch.sample_indices.append(index)
    return batch
