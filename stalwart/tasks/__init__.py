"""Built-in tasks: ready-made TrainTasks for common runs (a pretrained Hugging Face causal LM)."""
