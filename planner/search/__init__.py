"""Plan search: enumerate placements x modes x staleness, screen analytically, simulate the best few.

``search(SearchInputs) -> SearchOutcome``; ``build_plan`` turns an outcome into the deterministic ``Plan``.
"""

from planner.search.build import build_plan
from planner.search.core import InfeasibleError, SearchOutcome, Simulated, search, simulate_candidate
from planner.search.inputs import Pins, SearchInputs

__all__ = ["InfeasibleError", "Pins", "SearchInputs", "SearchOutcome", "Simulated", "build_plan", "search",
           "simulate_candidate"]
