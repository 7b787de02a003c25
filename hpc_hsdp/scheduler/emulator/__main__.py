"""``python -m hpc_hsdp.scheduler.emulator``: the emulator's processes (its srun, a job's supervisor, an
array's runner), as :mod:`hpc_hsdp.scheduler.emulator.launch` starts them."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from hpc_hsdp.scheduler.emulator.srun import srun
from hpc_hsdp.scheduler.emulator.supervisor import run_array, supervise


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["srun"]:
        return srun(argv[1:])
    if argv[:1] == ["supervise"] and len(argv) == 2:
        return supervise(argv[1])
    if argv[:1] == ["array"] and len(argv) == 2:
        return run_array(argv[1])
    print(
        "usage: python -m hpc_hsdp.scheduler.emulator srun [srun options] command... | supervise STATE_FILE",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
