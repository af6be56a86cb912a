"""The model-facing layer: tokenizers and chat templates (tokenizer.py, chat.py), training data
with loss masks (dataset.py) and the GRPO objective (rl.py)."""
