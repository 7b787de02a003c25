"""The run directory's on-disk contract, one owner (no torch): job.json, metrics.jsonl,
the checkpoints' state, attempts and restarts, and the pure readings made of them (progress,
stragglers, TensorBoard scalar names). The runtime writes through it; ``status``, ``report``,
``runs`` and submit's resume check read through it."""
