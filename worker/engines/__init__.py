"""Inference engines behind one contract (``contract``): transformers (``hf``) and vLLM (``vllm``,
imported only when chosen)."""
