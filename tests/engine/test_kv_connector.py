"""KVConnectors: each hook reaches the connectors that implement it, in the order they were connected."""

from shared.engine.kv_connector import KVConnector, KVConnectors


class Stores(KVConnector):
    def __init__(self, name, heard):
        self.name, self.heard = name, heard

    def block_stored(self, block_hash):
        self.heard.append((self.name, "stored", block_hash))


class Computes(KVConnector):
    def __init__(self, heard):
        self.heard = heard

    def blocks_computed(self, block_hashes, export):
        self.heard.append(("computes", list(block_hashes), export([0])))


def test_hooks_reach_only_the_connectors_that_implement_them_in_order():
    heard = []
    connectors = KVConnectors()
    assert not connectors.wants("block_stored") and not connectors.wants("blocks_computed")
    connectors.connect(Stores("first", heard))
    connectors.connect(Computes(heard))
    connectors.connect(Stores("second", heard))
    assert connectors.wants("block_stored") and connectors.wants("blocks_computed")
    assert not connectors.wants("block_removed") and not connectors.wants("cache_listed")

    connectors.block_stored(b"h1")
    connectors.block_removed(b"h1")  # nobody implements it: a no-op, not an error
    connectors.cache_listed()
    connectors.blocks_computed([b"h1", b"h2"], lambda indices: f"blocks {indices}")
    assert heard == [("first", "stored", b"h1"), ("second", "stored", b"h1"),
                     ("computes", [b"h1", b"h2"], "blocks [0]")]


def test_a_plain_connector_does_nothing():
    connector = KVConnector()
    connector.block_stored(b"h")
    connector.block_removed(b"h")
    connector.cache_listed()
    connector.blocks_computed([b"h"], lambda indices: 1 / 0)  # the default never exports
