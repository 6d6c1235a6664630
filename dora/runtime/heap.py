"""Keep Python's cyclic garbage collector off the run's critical path.

A full (generation-2) collection walks every container object the process holds, and each of the run's processes
holds millions of them once torch and Ray are imported and the model is built. Measured in the main job's driver
(`dora apply specs/local-tiny.yaml`, gc callbacks): full collections of 16 to 250 ms, two of them during the steps,
each a stretch in which the controller handled no finished trajectory and admitted nothing, so the engine drained
to its last rows and stood idle (a 208 ms hole in the trace, 90 ms of it with no engine step at all). Three
alternating pairs of runs with and without it: the longest silence in the trace 214-236 ms without, 89-99 ms with
(a training step's length: the trainer is then the bottleneck), and 6-7 silences over 50 ms per run against 3.

``settle_heap()`` is called once per process, when start-up is over (imports, the model, warm-up, the first weight
load): it collects what is garbage then and moves everything still alive into the collector's permanent generation
(``gc.freeze``), which later collections do not walk. They then cost what the run allocates since, not what
start-up left behind. Objects frozen are never collected, so only what lives for the whole run should be alive
then; start-up's garbage is collected first.
"""

from __future__ import annotations

import gc


def settle_heap() -> int:
    """Collect, then freeze what survives (see the module doc); the number of objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
