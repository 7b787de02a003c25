"""The submit host: what the commands and the Python API run before a job starts and around it
(preflight, render, submission, sweeps, the job's handle, claims, stacks and debug sessions)."""
