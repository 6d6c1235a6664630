"""Engines behind the runtime's two interfaces: a rollout engine and a trainer.

``base.py`` holds the protocols (``RolloutEngine``, ``Trainer``) and the frozen
data that crosses them; ``torch_rollout.py`` / ``torch_trainer.py`` are the CPU
implementations over the tiny transformer of ``tiny_model.py`` (the vLLM and
Megatron-core implementations plug in behind the same protocols).
"""
