"""A run directory's life, one owner per file: job_record (job.json), claim (claim.json),
job_state (job_state.json), attempts (attempt.json, restarts.jsonl), provenance_record
(provenance.json), sweep_record (sweep.json), runs (the runs under a directory)."""
