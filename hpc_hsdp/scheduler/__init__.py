"""The scheduler as every place sees it: backends/ (SLURM, the local emulator's, the choice by name,
a task's environment), emulator/, a job's state and first failure, the one restart policy."""
