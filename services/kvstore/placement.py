"""Which kv-store instance holds a block: rendezvous hashing over the instances that are up.

Each block goes to the instance with the highest hash of (instance, block
hash), so every worker computes the same place without coordination, and an
instance joining or leaving moves only the blocks it gains or held.
"""

import hashlib


def place(block_hash: bytes, instances: list[str]) -> str:
    if not instances:
        raise ValueError("no kv-store instance to place a block on")
    return max(instances, key=lambda instance: hashlib.blake2b(instance.encode() + b"|" + block_hash,
                                                               digest_size=8).digest())


def group_by_instance(hashes: list[bytes], instances: list[str]) -> dict[str, list[int]]:
    """{instance: indices into `hashes` of the blocks it holds}, indices in order."""
    groups: dict[str, list[int]] = {}
    for index, block_hash in enumerate(hashes):
        groups.setdefault(place(block_hash, instances), []).append(index)
    return groups
