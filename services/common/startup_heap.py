"""Keep what a service built at start-up out of the garbage collector's passes.

Its imports (torch and transformers bring hundreds of thousands of objects), its model and its tables live as
long as the process. Each full collection walks all of them: a pause in the middle of serving (a decode step
waits for it), and at exit, where the interpreter's last collections made a worker take 1.5 to 2 s to end
after its shutdown was done (every deployment's stop and every rolling restart waited for it). Frozen once
start-up is over, they are never walked again; what the service makes afterwards is collected as usual.
"""

import gc


def freeze_startup_heap() -> None:
    """Collect what start-up left behind, then move every live object out of the collector's generations."""
    gc.collect()
    gc.freeze()
