"""lorapack: plan multi-LoRA serving on vLLM with a fast digital twin."""

__version__ = "0.1.0"
