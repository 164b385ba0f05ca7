"""A service's start-up objects leave the collector's passes once it is ready."""

import gc
import weakref

from services.common.startup_heap import freeze_startup_heap


class Node:
    """A reference cycle: only the collector frees it."""

    def __init__(self):
        self.me = self


def test_freezing_moves_the_live_objects_out_of_the_collectors_generations():
    kept = [object() for _ in range(1000)]
    live = Node()
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() >= len(kept)
        assert sum(gc.get_count()) < len(kept)  # the generations hold only what came since
        frozen = weakref.ref(live)
        del live
        gc.collect()
        assert frozen() is not None  # frozen: no pass of the collector looks at it (not even when it is garbage)
        later = Node()
        after = weakref.ref(later)
        del later
        gc.collect()
        assert after() is None  # what is made afterwards is collected as before
    finally:
        gc.unfreeze()
