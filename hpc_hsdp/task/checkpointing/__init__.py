"""Checkpoints: saved, uploaded to a store, resumed and exported."""
