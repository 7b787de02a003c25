"""The ``hpc-hsdp`` command: thin click commands over the library.

Subcommands live in their own modules and are imported only when invoked, so that
``hpc-hsdp plan`` or ``render`` loads neither torch nor the other commands. A user
error prints one line, ``hpc-hsdp: error: ...``, and exits with 2.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

import click

from hpc_hsdp._version import __version__
from hpc_hsdp.errors import HsdpError, SpecError
from hpc_hsdp.files import UnsafeTarget
from hpc_hsdp.files import write_atomically as write
from hpc_hsdp.plan.units import terminal_safe

EXIT_USAGE = 2

# name -> (module under hpc_hsdp.cli, attribute, one-line help shown by `hpc-hsdp --help`)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "plan": ("plan_cmd", "plan", "Show which GPU of which node holds each rank and group, before submitting."),
    "layout": ("layout_cmd", "layout", "Inside a SLURM task: print the layout this task derives (JSON)."),
    "render": ("render_cmd", "render", "Write the sbatch script of a job (what submit sends), from Jinja2 templates."),
    "run": ("run_cmd", "run", "On each task (started by srun or torchrun): build the mesh, verify it, train."),
    "submit": ("submit_cmd", "submit", "Render the job and submit it (SLURM via submitit, or the local emulator)."),
    "check": ("check_cmd", "check", "Measure every node and link of an allocation in a short job of its own."),
    "status": ("jobs_cmd", "status", "State of a submitted job (from its run directory or job id)."),
    "logs": ("jobs_cmd", "logs", "Print or follow a job's per-rank logs."),
    "cancel": ("jobs_cmd", "cancel", "Cancel a submitted job."),
    "stacks": ("stacks_cmd", "stacks", "Every rank's stack of a running job, grouped, without stopping it."),
    "debug": ("stacks_cmd", "debug", "Stop one rank of a running job in pdb at a step boundary and attach to it."),
    "export": (
        "export_cmd",
        "export",
        "A run's checkpoint as a transformers directory or one safetensors file (offline).",
    ),
    "prepare-data": (
        "prepare_data_cmd",
        "prepare_data",
        "Tokenize text or JSONL into token files for --data (no torch).",
    ),
    "runs": ("jobs_cmd", "runs", "List the runs under a directory: state, step, loss, last activity."),
    "report": ("report_cmd", "report", "Draw runs (HTML, PNG, SVG): loss, throughput, per-rank step times, restarts."),
}


def _module_exists(module: str) -> bool:
    return importlib.util.find_spec(f"hpc_hsdp.cli.{module}") is not None


def _stdout_closed() -> None:
    """A reader that stopped early (``hpc-hsdp logs JOB | head``) is not an error: end quietly
    with 0, and keep Python from complaining when it flushes stdout at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
    sys.exit(0)


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(name for name, (module, _, _) in COMMANDS.items() if _module_exists(module))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS or not _module_exists(COMMANDS[name][0]):
            return None
        module, attribute, _ = COMMANDS[name]
        return getattr(importlib.import_module(f"hpc_hsdp.cli.{module}"), attribute)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except BrokenPipeError:  # before click turns it into exit status 1
            _stdout_closed()

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][2]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="hpc-hsdp")
def cli() -> None:
    """HSDP on SLURM, correct by construction.

    \b
    hpc-hsdp plan   --nodes 2 --gpus-per-node 8 --shard 4     # see the groups
    hpc-hsdp render --nodes 2 --shard 4 -o train.sbatch        # read the script
    hpc-hsdp submit --nodes 2 --shard 4 --wait                 # run it
    """


def fail(message: str) -> None:
    """Print one error line (its control characters escaped: an error may quote a run's files)
    and exit with the usage-error code."""
    click.echo(f"hpc-hsdp: error: {terminal_safe(message)}", err=True)
    sys.exit(EXIT_USAGE)


def write_atomically(path: Path, text: str, *, mode: int = 0o755) -> None:
    """:func:`hpc_hsdp.files.write_atomically`, with a failure as a one-line user error."""
    try:
        write(path, text, mode=mode)
    except UnsafeTarget:
        raise
    except OSError as exc:
        raise SpecError(
            f"cannot write {str(path)!r} ({exc.strerror}); check that its directory exists and is writable"
        ) from None


def main(argv: list[str] | None = None) -> None:
    try:
        code = cli.main(args=argv, prog_name="hpc-hsdp", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("hpc-hsdp: aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        fail(" ".join(exc.format_message().split()))
    except (HsdpError, UnsafeTarget) as exc:
        fail(" ".join(str(exc).split()))
    sys.exit(code if isinstance(code, int) else 0)
