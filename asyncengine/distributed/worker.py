"""Entry point of an `mp` tensor-parallel worker: `python -m asyncengine.distributed.worker`.

Its `WorkerSpec` arrives pickled on stdin, which rank 0 keeps open: the pipe's end means rank 0 is gone, and the
worker exits (0 after a clean stop, 1 otherwise) even if it is blocked in a collective at that moment.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading


def main() -> None:
    from asyncengine.distributed.executor import run_worker

    spec = pickle.load(sys.stdin.buffer)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s %(name)s[rank {spec.rank}]: %(message)s")
    stopped = threading.Event()

    def exit_when_rank0_is_gone():
        sys.stdin.buffer.read()  # blocks until the pipe ends
        os._exit(0 if stopped.is_set() else 1)

    threading.Thread(target=exit_when_rank0_is_gone, daemon=True).start()
    run_worker(spec)
    stopped.set()


if __name__ == "__main__":
    main()
