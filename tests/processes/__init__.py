"""Tests that start processes: multi-process torch.distributed (gloo on CPU), local emulator jobs, training runs."""
