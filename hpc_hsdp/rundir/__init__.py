"""The run directory's on-disk contract, one owner per file (no torch), in sub-rooms by what
writes it: lifecycle/ (job.json, the claim, the job's state, attempts and restarts, provenance,
a sweep's record), training/ (metrics.jsonl and its readings: progress, stragglers, TensorBoard
scalar names; evals, model.json, staging.json), checkpointing/ (the checkpoints' state, the
checkpoint store) and observation/ (stacks, the flight recorder, debug sessions, trackers, the
fabric check, replica membership). The runtime writes through it; ``status``, ``report``,
``runs`` and submit's resume check read through it."""
