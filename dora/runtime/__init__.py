"""Execute a lowered plan: engines, algorithm and task behind the runtime controller.

This package's one job is to *run* what the planner decided. It holds the
rollout and trainer engines (``engines/``: torch on CPU as the embedded
default, vLLM's engine for rollout and megatron-core's model for training, all
behind the two protocols in ``engines/base.py``), the RL algorithm (``grpo.py``: group-normalised
advantages, the token-level policy loss and its off-policy corrections) and the
verifiable tasks (``tasks.py``). Everything here is a plain Python object; the
Ray actors and the controller wrap these objects and add no maths of their own.
"""
