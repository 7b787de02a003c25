"""One SLURM command, bounded; and what this machine's SLURM configuration says.

Every call hpc-hsdp makes to ``sbatch``, ``squeue``, ``scontrol``, ``sacct``, ``scancel`` or
``sinfo`` goes through :func:`run_slurm`: a frozen ``slurmctld`` (or ``slurmdbd``) makes
SLURM's own clients wait for their ``MessageTimeout`` and retries, 30-40 s and more; here a
command that runs past ``HPC_HSDP_SLURM_TIMEOUT`` seconds (10 by default) is killed and
reported as :class:`SchedulerTimeout`, which names the daemon that did not answer.

A module of its own, standard library only, so that the SLURM backend
(:mod:`hpc_hsdp.scheduler.backends.slurm`), submitit's side of it (:mod:`hpc_hsdp.scheduler.backends.submitit_hooks`),
the requeue (:mod:`hpc_hsdp.scheduler.backends.slurm_task`, run on the task) and the replica supervisor all use
the one runner without importing one another.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import socket
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from hpc_hsdp.errors import SchedulerError, SpecError
from hpc_hsdp.job.options import DEFAULT_SLURM_TIMEOUT_S, SLURM_TIMEOUT_ENV

CONFIG_PATHS = ("/etc/slurm/slurm.conf", "/etc/slurm-llnl/slurm.conf", "/run/slurm/conf/slurm.conf")
"""Where SLURM's clients find their configuration when ``SLURM_CONF`` is unset (Debian's and
the upstream default, the old Debian one, and the cache of a configless node's slurmd/sackd)."""
ACCOUNTING_COMMANDS = ("sacct", "sacctmgr", "sreport")
"""Commands answered by the accounting daemon (slurmdbd), not the controller."""


class SchedulerTimeout(SchedulerError):
    """A SLURM command did not finish within its time: the daemon behind it did not answer."""

    def __init__(self, message: str, *, command: str, timeout_s: float) -> None:
        super().__init__(message)
        self.command = command
        self.timeout_s = timeout_s


def slurm_timeout_s(env: Mapping[str, str] | None = None) -> float:
    """Seconds one SLURM command may take: ``HPC_HSDP_SLURM_TIMEOUT``, else 10."""
    env = os.environ if env is None else env
    text = env.get(SLURM_TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_SLURM_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 3600:
        raise SpecError(f"{SLURM_TIMEOUT_ENV}={text!r} is not a number of seconds; give one in (0, 3600], e.g. 10")
    return value


def run_slurm(
    argv: Sequence[str],
    *,
    timeout_s: float | None = None,
    env: Mapping[str, str] | None = None,
    input: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run one SLURM command (text output captured; ``input`` on its stdin) for at most ``timeout_s`` seconds (default:
    :func:`slurm_timeout_s`). Past that, the command and everything it started are killed and
    :class:`SchedulerTimeout` is raised; a command that cannot be started raises
    :class:`SchedulerError`. A non-zero exit is returned, not raised: callers read what it said."""
    limit = slurm_timeout_s() if timeout_s is None else timeout_s
    name = Path(argv[0]).name
    try:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL if input is None else subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=None if env is None else dict(env),
            start_new_session=True,  # its own group: a timeout kills what it started too
        )
    except OSError as exc:
        raise SchedulerError(f"{name} could not be run ({exc.strerror or exc}); is SLURM installed here?") from None
    try:
        out, err = proc.communicate(input=input, timeout=limit)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise SchedulerTimeout(
            f"{daemon_of(name, env)} did not answer {name} within {limit:g} s",
            command=" ".join(argv[:3]),
            timeout_s=limit,
        ) from None
    except BaseException:  # Ctrl-C: the command goes with us
        _kill_group(proc)
        raise
    return subprocess.CompletedProcess(list(argv), proc.returncode, out, err)


class Runner(Protocol):
    """Runs one SLURM command: :func:`run_slurm`, or canned answers in tests."""

    def __call__(
        self,
        argv: Sequence[str],
        *,
        timeout_s: float | None = None,
        env: Mapping[str, str] | None = None,
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]: ...


TIMED_OUT = 124
"""``timeout``'s exit code when it stopped the command."""


def bounded_command(argv: Sequence[str], *, timeout_s: float | None = None) -> list[str]:
    """``argv`` under coreutils' ``timeout``, for a command that another library runs (submitit's
    ``sbatch``): exit code :data:`TIMED_OUT` when it ran past ``timeout_s``. As is without ``timeout``."""
    if shutil.which("timeout") is None:
        return list(argv)
    limit = slurm_timeout_s() if timeout_s is None else timeout_s
    return ["timeout", "--kill-after=2", f"{limit:g}", *argv]


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.communicate()


# ----------------------------------------------------------------------------- configuration


def slurm_config(env: Mapping[str, str] | None = None, *, which=shutil.which) -> Path | None:
    """The configuration file SLURM's clients read here: ``SLURM_CONF`` when set (whether or not
    it exists), else the first of :data:`CONFIG_PATHS` and ``<prefix>/etc/slurm.conf`` next to
    ``sbatch`` that exists; None when there is none (a configless client finds its controller by
    DNS, which only ``scontrol ping`` can tell)."""
    env = os.environ if env is None else env
    given = env.get("SLURM_CONF", "").strip()
    if given:
        return Path(given)
    candidates = [Path(p) for p in CONFIG_PATHS]
    sbatch = which("sbatch", path=env.get("PATH"))
    if sbatch:
        candidates.append(Path(sbatch).resolve().parent.parent / "etc" / "slurm.conf")
    return next((path for path in candidates if path.is_file()), None)


def config_value(config: Path | None, *keys: str) -> str | None:
    """The first value of the first of ``keys`` set in ``config`` (a host: its name, without
    ``(address)``); None when unknown."""
    if config is None:
        return None
    try:
        text = config.read_text(errors="replace")
    except OSError:
        return None
    for key in keys:
        match = re.search(rf"^\s*{key}\s*=\s*([^\s#(,]+)", text, re.IGNORECASE | re.MULTILINE)
        if match:
            return match.group(1)
    return None


def controller_host(config: Path | None) -> str | None:
    """The first ``SlurmctldHost`` (or old ``ControlMachine``) of ``config``; None when unknown."""
    return config_value(config, "SlurmctldHost", "ControlMachine")


def daemon_of(command: str, env: Mapping[str, str] | None = None) -> str:
    """Who answers ``command`` here, in words: ``the SLURM controller HOST`` or ``the SLURM
    accounting (slurmdbd on HOST)``."""
    config = slurm_config(env)
    if command in ACCOUNTING_COMMANDS:
        host = config_value(config, "AccountingStorageHost")
        return f"the SLURM accounting (slurmdbd on {host})" if host else "the SLURM accounting (slurmdbd)"
    return _name(controller_host(config))


@dataclass(frozen=True, kw_only=True)
class Ping:
    """What ``scontrol ping`` found out about this machine's SLURM."""

    answered: bool
    """The controller said it is UP."""
    host: str | None
    """The controller's host name (from the answer, else the configuration)."""
    config: Path | None
    """The configuration file the clients read (:func:`slurm_config`)."""
    configured: bool
    """SLURM is configured here: a configuration file, or a controller found without one
    (configless, by DNS). False only when ``scontrol`` itself says it has no configuration."""
    said: str
    """What went wrong, in words ('' when it answered)."""
    timeout_s: float

    @property
    def controller(self) -> str:
        return _name(self.host)


_NO_CONFIG_MARKERS = ("Could not establish a configuration source", "fetch_config")


def ping_controller(
    *, timeout_s: float | None = None, env: Mapping[str, str] | None = None, runner: Runner = run_slurm
) -> Ping:
    """``scontrol ping``, bounded: whether the controller answers, and whether SLURM is configured here."""
    env = os.environ if env is None else env
    limit = slurm_timeout_s(env) if timeout_s is None else timeout_s
    config = slurm_config(env)
    host = controller_host(config)
    found = functools.partial(Ping, config=config, timeout_s=limit)
    if config is not None and not config.exists():
        return found(answered=False, host=host, configured=True, said=f"SLURM_CONF={config} does not exist")
    try:
        ping = runner(["scontrol", "ping"], timeout_s=limit)
    except SchedulerTimeout:
        return found(
            answered=False, host=host, configured=True, said=f"{_name(host)} did not answer within {limit:g} s"
        )
    except SchedulerError as exc:
        return found(answered=False, host=host, configured=config is not None, said=str(exc))
    shown = re.search(r" at (\S+) is (UP|DOWN)", ping.stdout)
    host = shown.group(1) if shown else host
    if ping.returncode == 0 and shown and " is UP" in ping.stdout:
        return found(answered=True, host=host, configured=True, said="")
    said = " ".join((ping.stdout + ping.stderr).split()) or f"exit code {ping.returncode}"
    unconfigured = config is None and any(marker in said for marker in _NO_CONFIG_MARKERS)
    if unconfigured:  # scontrol's own words are its DNS SRV look-up's errors: none of them is the reason
        said = "no slurm.conf and no SLURM_CONF here, and DNS names no SLURM controller"
    return found(answered=False, host=host, configured=not unconfigured, said=said)


def _name(host: str | None) -> str:
    return f"the SLURM controller {host}" if host else "the SLURM controller"


# ----------------------------------------------------------------------------- is a node alive

PROBE_TIMEOUT_S = 3.0


def slurmd_address(node: str, *, timeout_s: float = 10.0) -> tuple[str, int] | None:
    """(NodeAddr, Port) of a node's slurmd from ``scontrol -o show node``; None when unknown."""
    try:
        shown = run_slurm(["scontrol", "-o", "show", "node", node], timeout_s=timeout_s)
    except SchedulerError:
        return None
    fields = dict(item.split("=", 1) for item in shown.stdout.split() if "=" in item)
    addr, port = fields.get("NodeAddr"), fields.get("Port", "6818")
    if shown.returncode != 0 or not addr or not port.isdigit():
        return None
    return addr, int(port)


def unreachable_nodes(nodes: Sequence[str], *, timeout_s: float = PROBE_TIMEOUT_S) -> list[str]:
    """The nodes whose slurmd refuses or does not answer a TCP connection within ``timeout_s``."""
    dead = []
    for node in nodes:
        address = slurmd_address(node)
        if address is None:
            continue  # unknown to scontrol here: say nothing rather than guess
        try:
            with socket.create_connection(address, timeout=timeout_s):
                pass
        except OSError:
            dead.append(node)
    return dead


# ----------------------------------------------------------------------------- the network's switches


def show_topology(*, timeout_s: float | None = None, env: Mapping[str, str] | None = None) -> str:
    """``scontrol show topology``: every switch (topology/tree) or block (topology/block) and its
    nodes, as text for :func:`hpc_hsdp.plan.switches.parse_scontrol_topology`; "" where SLURM has
    no topology plugin (it says so and exits non-zero). :class:`SchedulerError` where scontrol
    cannot be run, :class:`SchedulerTimeout` where the controller does not answer."""
    shown = run_slurm(["scontrol", "show", "topology"], timeout_s=timeout_s, env=env)
    return shown.stdout if shown.returncode == 0 else ""
