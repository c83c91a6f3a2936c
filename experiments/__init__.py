"""Experiments: models and tasks that run on replicator, one package each."""
