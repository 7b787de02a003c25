"""The one root error of hpc-hsdp.

Every error a user can cause is an :class:`HsdpError`; its message names the value that
was given and ends with how to fix it. The CLI prints it as one line and exits with 2.
"""

from __future__ import annotations


class HsdpError(ValueError):
    """A user-facing error: what was wrong, and the fix."""


class TopologyError(HsdpError):
    """The nodes, tasks and shard size do not form a valid HSDP layout."""


class SlurmEnvError(HsdpError):
    """The SLURM environment of a task is missing a variable or contradicts itself."""


class SpecError(HsdpError):
    """A job option, config file or profile holds an invalid value."""


class DataError(SpecError):
    """Token data that cannot be trained on, or not continued from a checkpoint: what is
    wrong with which file, and the fix."""


class InputNotFound(SpecError):
    """A file, directory or module the job names is not found on the machine that looked (submit's
    checks look on the submitting machine: a path only the compute nodes see is not found there)."""


class DataNotFound(DataError, InputNotFound):
    """Token data that is not there."""


class SchedulerError(HsdpError):
    """The scheduler refused or could not be reached (every backend's: SLURM's, the emulator's)."""
