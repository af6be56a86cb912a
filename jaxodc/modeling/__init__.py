"""The model-facing layer: Hugging Face checkpoints in (`hf_load.load_hf`) and out
(`hf_export.export_hf`, `Trainer.export_hf`), the Llama family as a linen model (`llama`), the
safetensors format at the byte level (`safetensors_io`), random checkpoints and data (`synthetic`),
tokenizers and chat templates (`tokenizer`, `chat`), training data with loss masks (`dataset`) and
the GRPO objective (`rl`)."""
