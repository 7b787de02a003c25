"""The local emulator: run a rendered sbatch script on this machine as SLURM would.

:mod:`.launch` starts a detached supervisor (:mod:`.supervisor`) that runs the very script
``render`` produced under ``bash``, with the job-level variables of a real allocation
(:mod:`.allocation`) and an ``srun`` of ours first on PATH. That ``srun`` (:mod:`.srun`) starts
one process per task, each with the task-level variables a real step gives it
(``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURMD_NODENAME``, ... from
:func:`hpc_hsdp.plan.slurm_env.task_environments`), writes each task's output to the
``--output``/``--error`` patterns (:mod:`.slurm_patterns`), and, like
``srun --kill-on-bad-exit``, ends the step when one task fails. Every task runs on CPU; each
job holds a rendezvous port of its own (:mod:`.ports`).

The supervisor records the job's state in ``<logs>/<job id>_local.json`` (:mod:`.state_files`);
:class:`~.emulated_job.LocalJob` reads it, so status, logs and cancel work from the run directory
alone, and signals only the supervisor the emulator started (:mod:`.processes`). The backend
that puts the emulator behind the interface every scheduler has is
:class:`hpc_hsdp.scheduler.backends.local.LocalBackend`. Its processes run
``python -m hpc_hsdp.scheduler.emulator srun|supervise|array``.
"""
