"""Fixtures of the side-channel tests: a started receiver and a sender (checked for leftover segments)."""

import pytest
import pytest_asyncio

from shared.transfer import KVReceiver, KVSender
from transfer_helpers import RECEIVER_OPTIONS, segments_with_prefix


@pytest_asyncio.fixture
async def receiver():
    r = KVReceiver(**RECEIVER_OPTIONS)
    await r.start()
    yield r
    await r.stop()


@pytest.fixture
def sender():
    s = KVSender(io_timeout_s=2.0)
    yield s
    s.close()
    assert segments_with_prefix(s.shm_pool.prefix) == [], "the sender left shared-memory segments behind"
