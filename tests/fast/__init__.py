"""Fast tests: pure and mocked-SLURM, in this process (quick CLI subprocesses at most): no process group, no emulator job, no cluster."""
