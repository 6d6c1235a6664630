"""planner: pure cost model, simulator, scheduling policies, schedule graph and plan search.

No I/O, no torch, no ray: every function takes explicit inputs and returns frozen outputs.
"""

from planner import _native

_native.use_current_code()  # before anything imports a module that may be compiled (see planner/_native.py)
