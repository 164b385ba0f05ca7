"""One stored KV block: its bytes and what they hold."""

from dataclasses import dataclass

import torch

from shared.transfer.wire import DTYPES


@dataclass(frozen=True, slots=True)
class StoredBlock:
    """A block's KV, all layers (`[layers, 2, block_size, kv_heads, head_dim]`), as raw bytes, and the model
    (its fingerprint) that computed it."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes
    model_fingerprint: bytes = b""

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
