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
import threading
from multiprocessing.connection import Client, Connection, Listener

_AUTHKEY_ENV = "PAGEDLLM_CHILD_AUTHKEY"


def start_child(module: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, Connection]:
    """Start `python -m module ADDRESS` and take its connection (it connects first thing); raises
    ChildStartError if it exits before it connects (an interpreter that cannot import us)."""
    authkey = secrets.token_bytes(32)
    address = os.path.join(tempfile.mkdtemp(prefix="pagedllm-"), "child.sock")
    process = None
    try:
        with Listener(address, "AF_UNIX", authkey=authkey) as listener:
            process = subprocess.Popen(
                [sys.executable, "-m", module, address], env={**os.environ, **(env or {}), _AUTHKEY_ENV: authkey.hex()}
            )
            accepted = threading.Event()
            threading.Thread(target=_unblock_if_exits, args=(process, address, authkey, accepted), daemon=True).start()
            try:
                connection = listener.accept()  # the socket file goes with the listener
            finally:
                accepted.set()
        if process.poll() is not None:
            connection.close()
            raise ChildStartError(f"{module} exited with code {process.returncode} as it started")
    except BaseException as exc:
        if process is not None and process.poll() is None:
            process.kill()
        if isinstance(exc, (OSError, EOFError)):  # it died mid-handshake
            raise ChildStartError(f"{module} failed as it started: {exc!r}") from exc
        raise
    finally:
        if process is not None and process.poll() is not None:
            process.wait()
        os.rmdir(os.path.dirname(address))
    return process, connection


class ChildStartError(RuntimeError):
    """A child process ended before it could take messages."""


def _unblock_if_exits(process: subprocess.Popen, address: str, authkey: bytes, accepted: threading.Event) -> None:
    """Should the child exit before it connects, connect in its place: the parent's accept returns
    and it sees the child gone, rather than waiting for ever."""
    while not accepted.wait(0.2):
        if process.poll() is not None:
            try:
                Client(address, "AF_UNIX", authkey=authkey).close()
            except Exception:  # noqa: BLE001 - the parent accepted at the same moment and closed
                pass
            return


def connect_to_parent() -> Connection:
    """In the child's `__main__`: the connection to the parent that started it."""
    return Client(sys.argv[1], "AF_UNIX", authkey=bytes.fromhex(os.environ.pop(_AUTHKEY_ENV)))
