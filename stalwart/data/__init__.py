"""Datasets stalwart builds for a task: instruction and text data, tokenized once, packed."""
