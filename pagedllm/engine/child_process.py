"""A child process as a fresh interpreter (`python -m MODULE`) joined to its parent by a Unix
socket of pickled messages: how the engine core's process and the tensor-parallel ranks start.
Not a fork (a forked copy of a process with OpenMP, tokenizer and server threads is not safe), nor
multiprocessing's spawn, which runs the user's main script again in the child."""
from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tempfile
from multiprocessing.connection import Client, Connection, Listener

_AUTHKEY_ENV = "PAGEDLLM_CHILD_AUTHKEY"


def start_child(module: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, Connection]:
    """Start `python -m module ADDRESS` and take its connection (it connects first thing)."""
    authkey = secrets.token_bytes(32)
    address = os.path.join(tempfile.mkdtemp(prefix="pagedllm-"), "child.sock")
    with Listener(address, "AF_UNIX", authkey=authkey) as listener:
        process = subprocess.Popen([sys.executable, "-m", module, address],
                                   env={**os.environ, **(env or {}), _AUTHKEY_ENV: authkey.hex()})
        connection = listener.accept()  # the socket file goes with the listener
    os.rmdir(os.path.dirname(address))
    return process, connection


def connect_to_parent() -> Connection:
    """In the child's `__main__`: the connection to the parent that started it."""
    return Client(sys.argv[1], "AF_UNIX", authkey=bytes.fromhex(os.environ.pop(_AUTHKEY_ENV)))
