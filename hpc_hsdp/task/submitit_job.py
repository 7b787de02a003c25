"""What each task of a submitted job runs: ``python -u -m hpc_hsdp.task.submitit_job FOLDER``.

``submit`` hands sbatch the script ``render`` writes, with this command where ``render``
puts ``python -m hpc_hsdp run``. It is submitit's ``python -m submitit.core._submit
FOLDER``, ending the process as ``hpc-hsdp run`` does (:func:`hpc_hsdp.task.entry.end_task`).
"""

from __future__ import annotations

import sys
import traceback
from typing import NoReturn

from submitit.core.submission import process_job

from hpc_hsdp.task.entry import end_task, exit_code


def run_submitit_job(folder: str) -> NoReturn:
    """Submitit's own job runner (it loads the pickled call, runs it, pickles the result),
    then :func:`~hpc_hsdp.task.entry.end_task` with the status the runner would have
    left the process with."""
    try:
        process_job(folder)
    except SystemExit as stop:  # task_main after a signal stop: 0 (requeued) or 75
        end_task(exit_code(stop))
    except BaseException:  # submitit logged it and pickled it as the job's result
        traceback.print_exc()
        end_task(1)
    end_task(0)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m hpc_hsdp.task.submitit_job SUBMITIT_FOLDER (the command of a submitted job's tasks)")
    run_submitit_job(sys.argv[1])
