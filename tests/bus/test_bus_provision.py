import asyncio

import pytest

from shared.bus.provision import ProvisionError, ensure_pull_consumer, ensure_stream

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]


def stream_args(name, **overrides):
    args = dict(name=name, subjects=[f"{name}.>"], retention="workqueue", storage="memory",
                max_msgs=1000, max_bytes=1 << 20, max_age_s=60.0, duplicate_window_s=30.0)
    return args | overrides


async def test_ensure_stream_is_idempotent_and_updates_a_changed_config(js, unique):
    name = unique("jobs")
    first = await ensure_stream(js, **stream_args(name))
    second = await ensure_stream(js, **stream_args(name))
    assert second.config.max_msgs == first.config.max_msgs == 1000
    assert second.state.messages == 0

    await js.publish(f"{name}.a", b"kept across the update")
    updated = await ensure_stream(js, **stream_args(name, max_msgs=5000, max_age_s=120.0, subjects=[f"{name}.>", f"x{name}"]))
    assert updated.config.max_msgs == 5000
    assert updated.config.max_age == 120.0
    assert sorted(updated.config.subjects) == sorted([f"{name}.>", f"x{name}"])
    assert updated.state.messages == 1


async def test_concurrent_ensure_stream_from_two_services(js, unique):
    name = unique("race")
    infos = await asyncio.gather(*(ensure_stream(js, **stream_args(name)) for _ in range(4)))
    assert {info.config.name for info in infos} == {name}


async def test_duplicate_window_is_clamped_to_max_age(js, unique):
    name = unique("short")
    info = await ensure_stream(js, **stream_args(name, max_age_s=5.0, duplicate_window_s=120.0))
    assert info.config.duplicate_window == 5.0


async def test_an_impossible_change_names_the_stream(js, unique):
    name = unique("fixed")
    await ensure_stream(js, **stream_args(name, storage="memory"))
    with pytest.raises(ProvisionError, match=name):
        await ensure_stream(js, **stream_args(name, storage="file"))


async def test_ensure_pull_consumer_is_idempotent_and_updates(js, unique):
    name = unique("work")
    await ensure_stream(js, **stream_args(name))
    args = dict(stream=name, durable="workers", filter_subject=f"{name}.>", ack_wait_s=5.0, max_deliver=3, max_ack_pending=10)
    first = await ensure_pull_consumer(js, **args)
    second = await ensure_pull_consumer(js, **args)
    assert first.config.ack_wait == second.config.ack_wait == 5.0
    assert second.config.max_deliver == 3

    updated = await ensure_pull_consumer(js, **(args | dict(ack_wait_s=9.0, max_deliver=5, max_ack_pending=20)))
    assert (updated.config.ack_wait, updated.config.max_deliver, updated.config.max_ack_pending) == (9.0, 5, 20)
    again = await js.consumer_info(name, "workers")
    assert again.config.max_ack_pending == 20



async def test_concurrent_ensure_pull_consumer(js, unique):
    name = unique("work")
    await ensure_stream(js, **stream_args(name))
    args = dict(stream=name, durable="racers", filter_subject=f"{name}.>", ack_wait_s=5.0, max_deliver=3, max_ack_pending=10)
    infos = await asyncio.gather(*(ensure_pull_consumer(js, **args) for _ in range(3)))
    assert {info.name for info in infos} == {"racers"}
