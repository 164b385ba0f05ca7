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


class Offers(KVConnector):
    def __init__(self, name, offer, heard):
        self.name, self.offer, self.heard = name, offer, heard

    def external_prefix(self, request_id, token_ids, num_local_tokens):
        self.heard.append((self.name, "asked", num_local_tokens))
        return self.offer

    def start_load(self, request_id, block_ids, first_token, num_tokens):
        self.heard.append((self.name, "load", block_ids, first_token, num_tokens))

    def finished_loads(self):
        return [(f"{self.name}-done", True)]

    def request_finished(self, request_id):
        self.heard.append((self.name, "finished", request_id))


def test_the_first_connector_offering_a_prefix_loads_it_and_an_unknown_answer_waits():
    heard = []
    connectors = KVConnectors()
    connectors.connect(Offers("none", 0, heard))
    second = Offers("second", 32, heard)
    connectors.connect(second)
    connectors.connect(Offers("third", 64, heard))
    assert connectors.loader_names == ["none", "second", "third"]
    assert connectors.external_prefix("r", [1] * 80, 16) == 32
    assert heard == [("none", "asked", 16), ("second", "asked", 16)]  # the third is not asked
    connectors.start_load("r", [7, 8], 16, 32)
    assert heard[-1] == ("second", "load", [7, 8], 16, 32) and connectors.loader_of("r") is second
    assert connectors.finished_loads() == [("none-done", True), ("second-done", True), ("third-done", True)]
    connectors.request_finished("r")
    assert heard[-3:] == [("none", "finished", "r"), ("second", "finished", "r"), ("third", "finished", "r")]
    assert connectors.loader_of("r") is None

    second.offer = None  # an earlier connector that does not know yet decides: the request waits
    assert connectors.external_prefix("s", [1] * 80, 0) is None and connectors.loader_of("s") is None
    assert KVConnectors().external_prefix("t", [1] * 80, 0) == 0  # no connector: nothing to load
