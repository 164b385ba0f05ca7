"""One stored KV block: its bytes, what they hold, and their checksum, fixed when the block is first made."""

from dataclasses import dataclass

import torch

from shared.transfer.checksum import fold64
from shared.transfer.wire import DTYPES


@dataclass(frozen=True, slots=True)
class StoredBlock:
    """A block's KV, all layers (`[layers, 2, block_size, kv_heads, head_dim]`), as raw bytes, and the model
    (its fingerprint) that computed it. `checksum` (fold64 of the bytes) is computed when the block arrives and
    travels with it through both tiers; a block made with one (read back from disk) must match it."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes
    model_fingerprint: bytes = b""
    checksum: int | None = None

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        numel = 1
        for dim in self.shape:
            if not isinstance(dim, int) or dim < 0:
                raise ValueError(f"shape {self.shape} is not a list of sizes")
            numel *= dim
        if numel * DTYPES[self.dtype].itemsize != len(self.data):
            raise ValueError(f"{len(self.data)} bytes are not a {self.dtype} block of shape {list(self.shape)}")
        total = content_sum(self.data)
        if self.checksum is None:
            object.__setattr__(self, "checksum", total)
        elif self.checksum != total:
            raise ValueError("the block's bytes fail its checksum")

    @property
    def nbytes(self) -> int:
        return len(self.data)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor, model_fingerprint: bytes = b"") -> "StoredBlock":
        tensor = tensor.detach().to("cpu").contiguous()
        return cls(str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape),
                   tensor.reshape(-1).view(torch.uint8).numpy().tobytes(), model_fingerprint)

    def tensor(self) -> torch.Tensor:
        return torch.frombuffer(bytearray(self.data), dtype=DTYPES[self.dtype]).view(self.shape)


def content_sum(data: bytes) -> int:
    return fold64(torch.frombuffer(bytearray(data), dtype=torch.uint8)) if data else 0
