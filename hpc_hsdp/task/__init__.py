"""The task: what runs on each rank of a job, the only part of hpc-hsdp that imports torch (with
``models/<adapter>.py``).

``entry`` (what each task runs; ``torchrun``, ``submitit_job``) starts it and ``fabric_check`` is the
check's; ``training/`` trains (loop, engine, coordinator, model, step); ``parallelism/``,
``checkpointing/``, ``resilience/`` and ``observation/`` are the parts the engine is handed."""
