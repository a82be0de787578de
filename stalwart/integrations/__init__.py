"""What stalwart plugs into: Ray Tune (`stalwart.integrations.tune`) and TensorBoard."""
