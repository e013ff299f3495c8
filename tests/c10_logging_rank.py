"""A rank whose C++ side logs as it fails: a TCPStore client to a port nobody listens on
logs c10d's '[E... socket.cpp] The client socket has timed out ...' lines (a lost gloo
peer logs 'connectFullMesh failed' alike), then raises; the rank catches it and ends
well (tests/test_ranks.py)."""

import datetime
import socket


def unreachable_store(_rank: int) -> None:
    import torch.distributed as dist

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    try:
        dist.TCPStore("127.0.0.1", port, is_master=False,
                      timeout=datetime.timedelta(seconds=0.3))
    except Exception as error:  # noqa: BLE001 -- the error is expected; its log is the test
        print(f"raised {type(error).__name__}", flush=True)
