"""What a consumer prints while it waits for a producer that has not
started yet (trainers started before the producer are normal in a sweep,
and a producer's dataset set-up can take minutes): a line on stderr after
FIRST_S seconds, then every EVERY_S seconds, so a long wait is visibly a
wait, never a silent hang."""

from __future__ import annotations

import sys
import time

FIRST_S = 5.0
EVERY_S = 30.0


class AttachProgress:
    def __init__(self, name: str, timeout: float | None, stream=None):
        self.name = name
        self.timeout = timeout
        self.stream = stream
        self.started = time.monotonic()
        self.next_report = self.started + FIRST_S
        self.reported = False

    def tick(self) -> None:
        """Called after each failed attach attempt; prints when a report is due."""
        now = time.monotonic()
        if now < self.next_report:
            return
        self.next_report = now + EVERY_S
        self.reported = True
        limit = "no time limit" if self.timeout is None else f"giving up after {self.timeout:g} s"
        print(
            f"tsock: waiting for the producer of channel '{self.name}' to start: {now - self.started:.0f} s so far "
            f"({limit}; Ctrl-C to stop)",
            file=self.stream or sys.stderr,
            flush=True,
        )

    def attached(self) -> None:
        """Says the wait is over, if a wait was reported."""
        if self.reported:
            waited = time.monotonic() - self.started
            print(
                f"tsock: channel '{self.name}' found after {waited:.0f} s", file=self.stream or sys.stderr, flush=True
            )
