"""Experiment runner: configs, models, data, training loop and results."""
