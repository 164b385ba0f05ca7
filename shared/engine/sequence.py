"""One request's state inside the engine."""

import enum
from dataclasses import dataclass, field

from shared.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    LOADING = "loading"  # its blocks are being written from outside (a connector's load)
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """A request: its tokens, how many of them have KV computed, and its blocks.

    There is no prefill or decode phase: each step computes the tokens in
    `token_ids[num_computed_tokens:]` (or a chunk of them), and a new token is
    sampled whenever all tokens are computed.
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    seed: int
    max_total_tokens: int  # prompt + generated tokens never exceed this
    arrival_index: int
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit length at first scheduling; -1 until scheduled
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_hashed_blocks: int = 0  # blocks of block_table registered in the prefix cache
    num_written_back: int = 0  # full blocks handed to the engine's connectors (blocks_computed) (or already stored elsewhere)
    num_preemptions: int = 0
    read_prefix_cache: bool = True  # False: its whole prefix comes from a connector (a remote prefill's KV)
    external_asked: bool = False  # the connectors' offer of its prefix was taken (a load started, or none offered)
    hold_kv: bool = False  # keep the blocks after finishing, until released (a prefill worker ships them)
    stream_prompt_kv: bool = False  # hand the prompt's KV to the connectors layer by layer (until it has been)
    virtual_engine: int = 0  # which of the engine's schedulers runs it (pipeline micro-batches)
    # params.prompt_logprobs: the logprobs of prompt tokens 1.. as their positions are computed (token 0 has none)
    prompt_logprobs: list = field(default_factory=list)
    prompt_logprobs_sent: bool = False  # they went out with its first output

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
