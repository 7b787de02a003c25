"""The batch shell: what a job's rendered script runs between its steps (python -m): the replica
supervisor, the fabric check's verdict, the code snapshot's check, an eval job's wrapper."""
