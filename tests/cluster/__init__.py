"""Tests against the real dev SLURM cluster (scripts/dev-cluster; marker ``slurm``, fixture ``slurm_cluster``)."""
