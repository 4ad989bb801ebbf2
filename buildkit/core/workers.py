"""Long-lived daemon worker threads.

mlx gives every thread its own streams and tears them down when the thread
exits; a thread that ran mlx work and then exits during interpreter shutdown
aborts the process ("terminate called without an active exception") some of
the time. So threads that may touch mlx are created once per process, never
exit, and are daemons that simply stop with the process.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, wait

_pools: dict[str, Pool] = {}
_lock = threading.Lock()


class Pool:
    def __init__(self, name: str):
        self.name = name
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()

    def _worker(self) -> None:
        while True:
            fut, fn, args = self.jobs.get()
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as e:  # delivered to the waiter, like concurrent.futures
                    fut.set_exception(e)
            del fut, fn, args  # drop references to results while idle

    def submit(self, fn: Callable, *args, workers: int = 2) -> Future:
        """Run ``fn(*args)`` on one of (at least) ``workers`` threads of this pool."""
        with self.lock:
            while len(self.threads) < workers:
                t = threading.Thread(
                    target=self._worker, name=f"{self.name}-{len(self.threads)}", daemon=True
                )
                self.threads.append(t)
                t.start()
        fut: Future = Future()
        self.jobs.put((fut, fn, args))
        return fut


def pool(name: str) -> Pool:
    with _lock:
        if name not in _pools:
            _pools[name] = Pool(name)
        return _pools[name]


def imap(name: str, fn: Callable, items: Iterable, workers: int = 2, window: int = 64) -> Iterator:
    """``map`` over ``workers`` threads of pool ``name``, in order, at most ``window`` in flight.

    Only ``workers`` items run at once; the rest of the window is queued items and finished
    results waiting their turn, so it costs what the results hold (keep them small). It must be
    wide: results come out in order, and with a narrow window one big item at the head leaves
    the other workers idle once they have finished the small ones behind it.
    """
    p = pool(name)
    pending: deque[Future] = deque()
    try:
        for it in items:
            pending.append(p.submit(fn, it, workers=workers))
            if len(pending) >= window:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:  # on a failure, no work may outlive the caller (mlx aborts if it runs into exit)
        for fut in pending:
            fut.cancel()
        wait(pending)
