"""A tiny Llama-style chat model built offline, for tests and demos.

``build_tiny_model`` writes a directory that ``AutoTokenizer.from_pretrained`` and
``AutoModelForCausalLM.from_pretrained`` load like any Hugging Face checkpoint: a byte-level BPE
tokenizer trained on text generated here, a chat template, a 4-layer ``LlamaForCausalLM`` and
``tokentrail.json`` describing the build. Its seeded random weights are then briefly trained on
synthetic chats (``worker.tiny.training``), so that sampled replies close their turn, often reason and
often call offered tools -- enough structure to exercise multi-turn stitching. Nothing is downloaded;
the tokenizer is byte-identical everywhere, the weights are reproducible on one machine (see
``train_tiny_model``), and with ``train=False`` they are byte-identical everywhere.

Token kinds, per template:

* chatml: special ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos, the turn closer);
  non-special added tokens ``<think>`` ``</think>`` ``<tool_call>`` ``</tool_call>`` ``<tool_response>``
  ``</tool_response>``: single ids that ``decode(skip_special_tokens=True)`` keeps, as in Qwen3.
* llama3: special ``<|begin_of_text|>`` (bos), ``<|end_of_text|>`` (eos, *not* the turn closer),
  ``<|start_header_id|>``, ``<|end_header_id|>``, ``<|eot_id|>`` (closes a turn), ``<|eom_id|>`` (closes
  an assistant turn that called a tool), ``<|python_tag|>``, ``<|finetune_right_pad_id|>`` (pad);
  generation_config.json stops on eot, eom and end_of_text.

``resolve_model("tiny")`` (or ``"tiny-<template>"``) builds such a model once into the cache directory
and returns its path; any other name is returned unchanged.
"""

from worker.tiny.build import build_tiny_model
from worker.tiny.cache import resolve_model

__all__ = ["build_tiny_model", "resolve_model"]
