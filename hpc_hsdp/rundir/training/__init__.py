"""What training writes into the run directory and its pure readings: metrics (metrics.jsonl),
scalars (its TensorBoard names), pace (steps/s, the ETA), stragglers (the slow rank or node),
evals (evals/, evals.jsonl), model_record (model.json), staging_record (staging.json)."""
