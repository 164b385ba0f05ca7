"""A service's start-up objects leave the collector's passes once it is ready."""

import gc

from services.common.startup_heap import freeze_startup_heap


def test_freezing_moves_the_live_objects_out_of_the_collectors_generations():
    kept = [object() for _ in range(1000)]
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() >= len(kept)
        assert sum(gc.get_count()) < len(kept)  # the generations hold only what came since
        made_after = [[i] for i in range(100)]
        assert gc.is_tracked(made_after[0]) and gc.collect() >= 0  # later objects are collected as before
    finally:
        gc.unfreeze()
