"""Chained block hashes: the identity of a full block of KV for prefix reuse.

A block's hash covers its parent's hash, its token ids and the model
fingerprint, so equal hashes mean "same tokens after the same prefix, computed
by the same model". Hashes are stable across processes and machines (blake2b
over little-endian int64 token ids), which the kv-store relies on.

A request's cache salt (vLLM's `cache_salt`; the gateway makes one per tenant)
is the first block's parent: requests with different salts share no block hash,
so no cache (a worker's, the kv-store's, the scheduler's index) ever serves one
the other's prefix. No salt keeps the all-zero root.
"""

import hashlib
import struct
from collections.abc import Sequence

BLOCK_HASH_BYTES = 16
ROOT_PARENT_HASH = bytes(BLOCK_HASH_BYTES)


def hash_block(parent_hash: bytes, token_ids: Sequence[int], fingerprint: bytes) -> bytes:
    digest = hashlib.blake2b(digest_size=BLOCK_HASH_BYTES)
    digest.update(parent_hash)
    digest.update(fingerprint)
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return digest.digest()


def root_hash(cache_salt: str = "") -> bytes:
    """The parent of a prompt's first block."""
    if not cache_salt:
        return ROOT_PARENT_HASH
    return hashlib.blake2b(cache_salt.encode(), digest_size=BLOCK_HASH_BYTES, person=b"splitserve-salt").digest()


def extend_block_hashes(
    hashes: list[bytes], token_ids: Sequence[int], block_size: int, fingerprint: bytes, cache_salt: str = ""
) -> None:
    """Append the hashes of every full block of `token_ids` not yet in `hashes`."""
    for block_index in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else root_hash(cache_salt)
        start = block_index * block_size
        hashes.append(hash_block(parent, token_ids[start : start + block_size], fingerprint))


def block_hashes(token_ids: Sequence[int], block_size: int, fingerprint: bytes, cache_salt: str = "") -> list[bytes]:
    hashes: list[bytes] = []
    extend_block_hashes(hashes, token_ids, block_size, fingerprint, cache_salt)
    return hashes


def cacheable_block_hashes(prompt_token_ids: Sequence[int], block_size: int, fingerprint: bytes,
                           cache_salt: str = "") -> list[bytes]:
    """The hashes of the prompt's full blocks that a cached prefix may cover: one token is always left to
    compute, so that the step that follows has logits to sample."""
    usable = (len(prompt_token_ids) - 1) // block_size * block_size
    return block_hashes(prompt_token_ids[:usable], block_size, fingerprint, cache_salt)
