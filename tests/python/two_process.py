"""Plumbing shared by the two-process (gloo, CPU) integration tests: a free port for the rendezvous, the
route counts as JSON keys, and how a worker hands its result back and leaves. Imported as `two_process`
(pytest puts this folder on sys.path; a worker run as a script has it as its own folder)."""
import json
import os
import pathlib
import socket
import sys


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def route_counts(stats):
    """An integration's stats() ({(route, reason): calls}) with "route: reason" string keys."""
    return {f"{p}{': ' + why if why else ''}": n for (p, why), n in stats.items()}


def finish_rank(dist, rank, world, result, out_path):
    """Gather every rank's result dict, rank 0 writes {"ranks": [...]} to out_path, then leave."""
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        pathlib.Path(out_path).write_text(json.dumps({"ranks": gathered}))
    dist.barrier()
    # Leave without tearing gloo down: its threads can abort the process (SIGABRT, "terminate called without
    # an active exception") at interpreter exit, after the result is written (seen about once in 50 runs).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
