"""The ``HETFLOW_COMM_*`` variables a backend gives each rank of a TCP communicator, read here.

``hetflow.operators`` reads no environment: its :func:`~hetflow.operators.tcpcomm.connect`
takes everything as arguments.  A backend that starts ranks one by one without MPI
(:mod:`hetflow.tasks.backends.dask`) sets ``HETFLOW_COMM_RANK``, ``HETFLOW_COMM_SIZE``,
``HETFLOW_COMM_RENDEZVOUS`` (rendezvous file path), ``HETFLOW_COMM_SECRET_FILE``,
``HETFLOW_COMM_HOST`` (address to listen on, default ``127.0.0.1``) and optionally
``HETFLOW_COMM_TIMEOUT`` (seconds, default 3600; 0 waits forever) and
``HETFLOW_COMM_CONNECT_TIMEOUT`` (default 120); the worker calls :func:`connect_from_env`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hetflow.operators.tcpcomm import OnFailure, TcpComm


def connect_from_env(on_failure: OnFailure = "exit", env: Mapping[str, str] | None = None) -> TcpComm:
    """:func:`~hetflow.operators.tcpcomm.connect` with the ``HETFLOW_COMM_*`` variables of ``env``
    (default ``os.environ``).

    :raises ValueError: a required variable is missing (the message names it).
    """
    from hetflow.operators import tcpcomm

    env = os.environ if env is None else env
    try:
        rank, size = int(env["HETFLOW_COMM_RANK"]), int(env["HETFLOW_COMM_SIZE"])
        rendezvous, secret_file = env["HETFLOW_COMM_RENDEZVOUS"], env["HETFLOW_COMM_SECRET_FILE"]
    except KeyError as exc:
        raise ValueError(f"the TCP communicator needs the environment variable {exc.args[0]} "
                         "(HETFLOW_COMM_RANK, _SIZE, _RENDEZVOUS, _SECRET_FILE)") from None
    timeout = float(env.get("HETFLOW_COMM_TIMEOUT", "3600"))
    return tcpcomm.connect(rank, size, rendezvous=rendezvous, secret=tcpcomm.read_secret(secret_file),
                           host=env.get("HETFLOW_COMM_HOST", "127.0.0.1"), timeout=timeout if timeout > 0 else None,
                           connect_timeout=float(env.get("HETFLOW_COMM_CONNECT_TIMEOUT", "120")),
                           on_failure=on_failure)
