"""The address of this node that the job's other nodes reach: ``MASTER_ADDR`` of the batch shell.

The batch script runs on the job's first node, where rank 0 (and torch's TCP store) will
run. Its SLURM name is not always resolvable on the other nodes (sites that address
nodes by IP, names only the controller's ``slurm.conf`` knows), and the host name often
resolves to a loopback address (Debian's ``127.0.1.1``), which the other nodes cannot
reach. So the script says an address of its own, in this order:

1. a job on one node, or whose nodes are all this machine (the caller says so: the local
   emulator's backend, :func:`hpc_hsdp.scheduler.backends.task_backend`): ``127.0.0.1``;
2. the interface named by ``NCCL_SOCKET_IFNAME`` or ``GLOO_SOCKET_IFNAME`` (the first
   plain name of the list), as NCCL and gloo will use it;
3. a non-loopback address the host name resolves to;
4. the source address of the route to the outside (the default route's interface).

Nothing found: an error that names the fix (``--env MASTER_ADDR=...`` or the interface).

Rules 2-4 are :func:`reachable_address`: a replica group of a fault-tolerant job
(:mod:`hpc_hsdp.batch_shell.replica_supervisor`) whose first node is not the batch shell's asks them on that node.
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import socket
import struct
from collections.abc import Callable, Mapping

from hpc_hsdp.errors import SlurmEnvError
from hpc_hsdp.plan.topology import RENDEZVOUS_PORT_BASE, RENDEZVOUS_PORT_SPAN, expand_nodelist

IFNAME_VARIABLES = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
_ROUTE_PROBE = "10.255.255.255"  # a UDP "connect" only picks a route and source address; nothing is sent


def _usable(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return not (ip.is_loopback or ip.is_unspecified or ip.is_link_local or ip.is_multicast)


def _ipv4_of(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def interface_address(name: str) -> str | None:
    """The IPv4 address of network interface ``name`` (Linux), or None. As NCCL reads
    ``NCCL_SOCKET_IFNAME``: ``=ib0`` is that interface exactly, ``ib`` the first whose name
    starts so (ib0, ib1, ...)."""
    if name.startswith("="):
        return _ipv4_of(name[1:])
    for _, candidate in sorted(socket.if_nameindex()):
        if candidate.startswith(name):
            address = _ipv4_of(candidate)
            if address is not None:
                return address
    return None


def host_name_addresses() -> list[str]:
    """The addresses this host's own name resolves to (none when it does not resolve)."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        return []
    return [str(info[4][0]) for info in infos]


def route_source_address() -> str | None:
    """The source address the kernel picks for the outside (default route), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((_ROUTE_PROBE, 9))
            return sock.getsockname()[0]
        except OSError:
            return None


def named_interface(env: Mapping[str, str]) -> tuple[str, str] | None:
    """(variable, interface) of the first interface NCCL/gloo are told to use; an exclusion
    list (``^docker,lo``) names none."""
    for variable in IFNAME_VARIABLES:
        value = env.get(variable, "").strip()
        if not value or value.startswith("^"):
            continue
        first = value.split(",")[0].strip()
        if first.lstrip("="):
            return variable, first
    return None


def node_address(
    env: Mapping[str, str],
    *,
    one_machine: bool = False,
    by_interface: Callable[[str], str | None] = interface_address,
    by_host_name: Callable[[], list[str]] = host_name_addresses,
    by_route: Callable[[], str | None] = route_source_address,
) -> str:
    """An address of this node that the job's other nodes reach (see the module docstring);
    ``one_machine``: every node of the job is this machine."""
    nodelist = env.get("SLURM_JOB_NODELIST", "").strip()
    nodes = expand_nodelist(nodelist) if nodelist else ()
    here = env.get("SLURMD_NODENAME", "").strip()
    if nodes and here and here != nodes[0]:
        raise SlurmEnvError(
            f"the rendezvous address is rank 0's node's, {nodes[0]}, but this runs on {here}; "
            f"run it in the batch script (on the job's first node)"
        )
    if one_machine or len(nodes) == 1:
        return "127.0.0.1"
    return reachable_address(env, by_interface=by_interface, by_host_name=by_host_name, by_route=by_route)


def reachable_address(
    env: Mapping[str, str],
    *,
    by_interface: Callable[[str], str | None] = interface_address,
    by_host_name: Callable[[], list[str]] = host_name_addresses,
    by_route: Callable[[], str | None] = route_source_address,
) -> str:
    """An address of the node this runs on that other nodes reach: rules 2-4 of the module
    docstring (the interface NCCL/gloo are told to use, the host name's, the default route's)."""
    here = env.get("SLURMD_NODENAME", "").strip()
    named = named_interface(env)
    if named is not None:
        variable, name = named
        address = by_interface(name)
        if address is None:
            raise SlurmEnvError(
                f"{variable} names interface {name!r}, which has no IPv4 address on node {here or '?'}; "
                f"fix {variable} or set --env MASTER_ADDR=<address of the first node>"
            )
        return address
    for address in by_host_name():
        if _usable(address):
            return address
    address = by_route()
    if address is not None and _usable(address):
        return address
    raise SlurmEnvError(
        f"node {here or '?'} has no address the other nodes can reach (its name resolves only to loopback "
        f"or not at all, and no route leaves it); set --env MASTER_ADDR=<its address> or "
        f"--env NCCL_SOCKET_IFNAME=<its interface>"
    )


def hostfile_lines(env: Mapping[str, str], counts: tuple[int, ...], distribution: str) -> list[str]:
    """``SLURM_HOSTFILE`` for ``srun --distribution=arbitrary``: the node of each task, in
    task order, so that node K runs exactly ``counts[K]`` tasks (``block``: node by node;
    ``cyclic``: round-robin)."""
    nodelist = env.get("SLURM_JOB_NODELIST", "").strip()
    if not nodelist:
        raise SlurmEnvError("SLURM_JOB_NODELIST is not set; run this in the batch script of a SLURM job")
    nodes = expand_nodelist(nodelist)
    if len(nodes) != len(counts):
        raise SlurmEnvError(
            f"the job has {len(nodes)} nodes ({nodelist}) but the plan places tasks on {len(counts)}; "
            f"submit with --nodes {len(counts)}"
        )
    if distribution == "block":
        return [node for node, count in zip(nodes, counts) for _ in range(count)]
    return [node for round_ in range(max(counts)) for node, count in zip(nodes, counts) if round_ < count]


# ----------------------------------------------------------------------------- the rendezvous port

PORT_TRIES = 64
"""How many ports the batch script tries before giving up: the derived one, then the fallbacks."""
FALLBACK_PORT_BASE = 10000
"""Fallback ports are 10000-19999: no job derives one of them (another job's derived port, free
now but bound in a moment by that job's own rank 0, is never taken), and Linux hands out none of
them to outgoing connections (``ip_local_port_range`` starts at 32768)."""
FIRST_PORT_VARIABLE = "HPC_HSDP_RENDEZVOUS_PORT"
"""The first port to try, in place of the one derived from the job id (the local emulator
sets it to the port it reserved for the job)."""


def port_is_free(port: int) -> bool:
    """Whether a TCP server could listen on ``port`` on every address of this node now, as torch's
    TCP store will: a bind to the wildcard address with ``SO_REUSEADDR`` (so a port whose last
    connections linger in TIME_WAIT, such as the previous run's of a requeued job, counts as free,
    and one another process listens on does not), IPv4 and, where there is one, IPv6."""
    families = [(socket.AF_INET, "0.0.0.0")]
    if socket.has_ipv6:
        families.append((socket.AF_INET6, "::"))
    for family, address in families:
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no such family on this node
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((address, port))
        except OSError as exc:
            if family == socket.AF_INET6 and exc.errno == errno.EADDRNOTAVAIL:  # IPv6 disabled
                continue
            return False
        finally:
            sock.close()
    return True


def port_candidates(first: int, tries: int = PORT_TRIES) -> list[int]:
    """``first``, then, when it is a derived port (20000-29999), the fallbacks from
    ``first - 10000`` on, wrapping within 10000-19999; otherwise the ports after ``first``."""
    if RENDEZVOUS_PORT_BASE <= first < RENDEZVOUS_PORT_BASE + RENDEZVOUS_PORT_SPAN:
        offset = first - RENDEZVOUS_PORT_BASE
        fallbacks = [FALLBACK_PORT_BASE + (offset + k) % RENDEZVOUS_PORT_SPAN for k in range(tries - 1)]
        return [first, *fallbacks]
    return [port for port in range(first, min(first + tries, 65536))]


def pick_port(
    first: int,
    *,
    taken: frozenset[int] | set[int] = frozenset(),
    is_free: Callable[[int], bool] = port_is_free,
    tries: int = PORT_TRIES,
    where: str = "this node",
) -> int:
    """The first of :func:`port_candidates` that is not ``taken`` (held for another job) and free here."""
    for port in port_candidates(first, tries):
        if port not in taken and is_free(port):
            return port
    raise SlurmEnvError(
        f"no free port among the {tries} from {first} on {where}; set --env MASTER_PORT=<a free port> "
        f"or free one of them"
    )
