"""The peers stalwart is measured against, as a careful user runs them: the same model, data,
sample order and step (ddp_step.py) under torchrun and under Ray Train's TorchTrainer."""
