"""dora: compile a declarative RL post-training spec into a plan, report its cost, and run it.

Pipeline (one direction): spec (``dora.spec``) -> plan (``planner``) -> lowering (``dora.lower``)
-> launch (``dora.runtime``).
"""

__version__ = "0.1.0"
