"""The training: the built-in loop and TrainingRun over the one engine, its step coordinator, the
model it builds and the step it runs; the engine's parts (data, optimizer, schedule, metrics, staging)."""
