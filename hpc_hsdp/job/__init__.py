"""A job before and around its run (no torch): the job spec and its config files, the
sbatch script rendered from the templates, the checks made before the job waits in the
queue, and the one place that talks to the scheduler (SLURM through submitit, or the local
emulator). What a task runs is named by a module path, so nothing here imports the runtime."""
