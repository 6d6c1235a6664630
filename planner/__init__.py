"""planner: pure cost model, simulator, scheduling policies, schedule graph and plan search.

No I/O, no torch, no ray: every function takes explicit inputs and returns frozen outputs.
"""
