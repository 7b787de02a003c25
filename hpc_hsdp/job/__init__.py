"""A job before and around its run (no torch): the job spec and its config files, the
sbatch script rendered from the templates, the checks made before the job waits in the
queue, and one backend per scheduler (:mod:`hpc_hsdp.scheduler.backends`: SLURM through submitit,
the local emulator) that submits, watches and cancels it. What a task runs is named by a
module path, so nothing here imports the runtime."""
