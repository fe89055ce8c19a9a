"""Reading a child process's pseudo-terminal in tests (the CLI's spinner, the chat UI)."""

from __future__ import annotations

import os
import threading


def start_drain(master: int) -> tuple[threading.Thread, list[bytes]]:
    """Read everything the child writes to the terminal whose master side is ``master`` on a
    daemon thread, so the child never blocks on a full buffer; returns the thread (it ends
    when the child's side closes) and the list the chunks are appended to."""
    got: list[bytes] = []

    def drain():
        while True:
            try:
                b = os.read(master, 65536)
            except OSError:  # EIO: the child's side is closed
                return
            if not b:
                return
            got.append(b)

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    return t, got
