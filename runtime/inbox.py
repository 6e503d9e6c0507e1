"""An actor's inbox: control messages jump the queue; data messages are bounded.

The IO thread fills it; the compute loop drains it. Control (leases, preemption, shutdown) lives in
its own lane that is always served first and is never refused, so it cannot queue behind bulk data.
The data lane has a fixed capacity: when it is full `put_data` says so and the IO thread stops
reading its data socket, which pushes back on senders through ZeroMQ's high-water marks.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any


class Inbox:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"inbox capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._control: deque[Any] = deque()
        self._data: deque[Any] = deque()
        self._cond = threading.Condition()
        self.control_event = threading.Event()  # set while control is waiting: long steps poll it
        self._woken = False  # a `wake` not yet seen by a `get`: kept, so one that comes first is not lost

    def put_control(self, item: Any) -> None:
        with self._cond:
            self._control.append(item)
            self.control_event.set()
            self._cond.notify()

    def put_data(self, item: Any, *, force: bool = False) -> bool:
        """Queues `item`; False (and nothing queued) when the data lane is full, unless `force`: work the
        coordinator sends is bounded by what it asked for (its credits), and is never refused."""
        with self._cond:
            if len(self._data) >= self.capacity and not force:
                return False
            self._data.append(item)
            self._cond.notify()
            return True

    def wake(self) -> None:
        """Ends a `get` that is waiting, or the next one, with nothing: another thread of the actor has work
        for `step`. Remembered until a `get` sees it: a wake that came while the compute loop was in `step`
        was lost, and the loop slept its idle wait (1 s) with an environment's answer ready to send."""
        with self._cond:
            self._woken = True
            self._cond.notify_all()

    def has_room(self) -> bool:
        return len(self._data) < self.capacity

    def get(self, timeout: float | None) -> tuple[bool, Any] | None:
        """(is_control, item), control first; None if nothing arrived within `timeout` (0 = poll)."""
        with self._cond:
            if not self._control and not self._data and timeout != 0 and not self._woken:
                self._cond.wait(timeout)
            self._woken = False
            if self._control:
                item = self._control.popleft()
                if not self._control:
                    self.control_event.clear()
                return True, item
            if self._data:
                return False, self._data.popleft()
            return None

    def __len__(self) -> int:
        return len(self._control) + len(self._data)
