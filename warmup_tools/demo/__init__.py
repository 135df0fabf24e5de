"""What ``make demo`` and the tests serve: the demo model assets and the demo's prompts.

- ``assets``: the deterministic demo assets (random-weight LM, tokenizer, LoRA adapters, ONNX embedder).
- ``prompts``: one system prompt per demo adapter and a few user questions for each.
"""
