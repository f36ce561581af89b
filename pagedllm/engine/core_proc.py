"""The engine core's process: `python -m pagedllm.engine.core_proc`, started by ProcClient
(engine/core_client.py). It builds its core (engine/builder.py), then steps while there is work,
taking the frontend's messages between steps, and sends each step's outputs and stats back."""

from __future__ import annotations

import logging
import os
import queue
import threading
from multiprocessing.connection import Connection

from pagedllm.child_process import connect_to_parent
from pagedllm.core.messages import EngineCoreOutput
from pagedllm.engine.builder import make_engine_core
from pagedllm.engine.engine_core import EngineCore
from pagedllm.executor.cpu_binding import BIND_ENV

logger = logging.getLogger("pagedllm")


def run_engine_core(conn: Connection) -> None:
    """The engine core process: build the core, then step while there is work, taking messages
    between steps (waiting for them when idle), and send each step's outputs and stats."""
    try:
        args, model_config, cores = conn.recv()
        if cores is not None:
            bind_replica(cores)
        core = make_engine_core(args, model_config)
    except BaseException as exc:  # noqa: BLE001 - the frontend raises it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    # Outputs leave through a thread of their own: were the loop to block on a full pipe while the
    # frontend blocks sending it a long prompt, neither would move.
    outbox: queue.SimpleQueue = queue.SimpleQueue()
    sender = threading.Thread(target=_send_all, args=(conn, outbox), name="pagedllm-core-sender", daemon=True)
    sender.start()
    outbox.put(("ready", core.stats()))
    try:
        while True:
            rejected: list[EngineCoreOutput] = []
            snapshot = None
            # Idle: wait for messages, then take those there are; every batch is answered with a
            # step (empty where idle still), so that the frontend's stats follow an idle core's
            # releases and aborts.
            wait = None if not core.has_unfinished_requests() else 0
            while conn.poll(wait):
                message = conn.recv()
                if message[0] == "shutdown":
                    return
                if message[0] == "snapshot":
                    snapshot = core.snapshot()
                else:
                    rejected += _apply(core, message)
                wait = 0
            outputs = core.step() if core.has_unfinished_requests() else []
            outbox.put(("step", (rejected + outputs, core.stats(), snapshot)))
    except (EOFError, OSError):  # the frontend has gone (it exited without shutting the core down)
        return
    except BaseException as exc:  # noqa: BLE001 - the core's state is in doubt: the frontend stops
        logger.exception("engine core failed")
        outbox.put(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        outbox.put(None)
        sender.join()


def bind_replica(cores: list[list[int]]) -> None:
    """This engine core's process runs on its ranks' cores, and its executor binds each rank to its own."""
    os.sched_setaffinity(0, sorted({cpu for rank in cores for cpu in rank}))
    os.environ[BIND_ENV] = "|".join(",".join(map(str, rank)) for rank in cores)


def _send_all(conn: Connection, outbox: queue.SimpleQueue) -> None:
    while (item := outbox.get()) is not None:
        try:
            conn.send(item)
        except OSError:  # the frontend has gone
            return


def _apply(core: EngineCore, message: tuple) -> list[EngineCoreOutput]:
    """One message from the frontend; a request the core refuses ends with an error output."""
    if message[0] == "finish":
        core.finish_requests(message[1], message[2])
        return []
    try:
        core.add_request(message[1])
    except ValueError as exc:
        return [EngineCoreOutput(message[1].request_id, finish_reason="error", error=str(exc))]
    return []


if __name__ == "__main__":
    with connect_to_parent() as connection:
        run_engine_core(connection)
