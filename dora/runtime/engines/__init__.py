"""Engines behind the runtime's two interfaces: a rollout engine and a trainer.

``base.py`` holds the protocols (``RolloutEngine``, ``Trainer``) and the frozen
data that crosses them; ``torch_rollout.py`` / ``torch_trainer.py`` are the CPU
implementations over the tiny transformer of ``tiny_model.py``; ``vllm_rollout.py``
runs vLLM's engine and ``megatron_trainer.py`` megatron-core's model behind the
same protocols.
"""
