"""A start-up roll call for multi-process runs, before JAX's distributed runtime starts.

JAX's coordination service aborts the whole process when a peer never shows up
(a C++ fatal error, after its timeout) and does not say which peer. So the
processes first meet here: process 0 listens on the coordinator's port + 1,
every other process says hello with its id, and process 0 answers ``go`` once
all are present, or names the missing ids when the timeout runs out. Only this
roll call travels over this socket; all training traffic goes through JAX.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import socket
import time


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    """Where this process sits in a multi-process run.

    Attributes:
      coordinator_address: ``host:port`` of process 0's coordination service.
      num_processes: how many processes take part.
      process_id: this process, in ``[0, num_processes)``.
      source: what it was detected from (``"explicit"``, ``"environment"``, or
        JAX's cluster detectors: ``"SlurmCluster"``, ``"GceTpuCluster"``, ...).
    """

    coordinator_address: str
    num_processes: int
    process_id: int
    source: str


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` (IPv6 hosts in brackets) as ``(host, port)``."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine's loopback (then servers bind to it alone)."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def rendezvous_address(group: ProcessGroup) -> tuple[str, int]:
    """The roll call's ``(host, port)``: the coordinator's host, its port + 1."""
    host, port = split_address(group.coordinator_address)
    return host, port + 1


def meet(group: ProcessGroup, *, timeout_s: float) -> None:
    """Returns once every process of ``group`` has arrived.

    Raises:
      TimeoutError: naming the process ids that did not arrive in ``timeout_s``
        (on process 0 and on every process that did arrive), or saying that
        process 0 never answered.
      ValueError: two processes with the same id, or disagreeing process counts.
    """
    deadline = time.monotonic() + timeout_s
    if group.process_id == 0:
        _host(group, deadline, timeout_s)
    else:
        _join(group, deadline, timeout_s)


def _host(group: ProcessGroup, deadline: float, timeout_s: float) -> None:
    host, port = rendezvous_address(group)
    arrived: dict[int, socket.socket] = {}
    bind = host if is_loopback(host) else ""  # a real cluster: every interface
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    with socket.create_server((bind, port), family=family, reuse_port=False) as server:
        server.settimeout(0.2)
        try:
            while len(arrived) < group.num_processes - 1 and time.monotonic() < deadline:
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    continue
                process_id = _read_hello(conn, group, arrived)
                arrived[process_id] = conn
            missing = sorted(set(range(1, group.num_processes)) - set(arrived))
            reply = f"missing {','.join(map(str, missing))}\n" if missing else "go\n"
            for conn in arrived.values():
                _send(conn, reply)
        finally:
            for conn in arrived.values():
                conn.close()
    if missing:
        raise TimeoutError(_missing_message(group, missing, timeout_s, host, port))


def _read_hello(conn: socket.socket, group: ProcessGroup, arrived: dict) -> int:
    conn.settimeout(10)
    words = conn.makefile().readline().split()
    if len(words) != 3 or words[0] != "hello":
        conn.close()
        raise ValueError(f"Unexpected roll-call message {words!r} on the rendezvous port.")
    process_id, count = int(words[1]), int(words[2])
    if count != group.num_processes:
        raise ValueError(
            f"Process {process_id} was started for {count} processes, process 0 for "
            f"{group.num_processes}; start every process with the same count."
        )
    if process_id in arrived or not 0 < process_id < group.num_processes:
        raise ValueError(f"Process id {process_id} arrived twice or is out of range.")
    return process_id


def _join(group: ProcessGroup, deadline: float, timeout_s: float) -> None:
    host, port = rendezvous_address(group)
    conn = None
    while conn is None:
        try:
            conn = socket.create_connection((host, port), timeout=1)
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"Process {group.process_id}: process 0 never answered at {host}:{port} "
                    f"(the coordinator {group.coordinator_address}, port + 1) within "
                    f"{timeout_s:.0f} s; is process 0 running, and is that address right "
                    f"({group.source})?"
                ) from None
            time.sleep(0.1)
    with conn:
        _send(conn, f"hello {group.process_id} {group.num_processes}\n")
        conn.settimeout(max(deadline - time.monotonic(), 0) + 5)
        try:
            words = conn.makefile().readline().split()
        except TimeoutError:
            words = []
    if words == ["go"]:
        return
    if words and words[0] == "missing":
        missing = [int(x) for x in words[1].split(",")]
        raise TimeoutError(_missing_message(group, missing, timeout_s, host, port))
    raise TimeoutError(
        f"Process {group.process_id}: no answer from process 0 at {host}:{port} within "
        f"{timeout_s:.0f} s."
    )


def _send(conn: socket.socket, text: str) -> None:
    try:
        conn.sendall(text.encode())
    except OSError:
        pass  # that process is gone; its own error says why


def _missing_message(group, missing, timeout_s, host, port) -> str:
    return (
        f"Processes {missing} of {group.num_processes} did not arrive within {timeout_s:.0f} s "
        f"(process {group.process_id} waited at the roll call on {host}:{port}, coordinator "
        f"{group.coordinator_address}, detected from {group.source}). Start them with the "
        f"same coordinator and process count, or raise the timeout."
    )
