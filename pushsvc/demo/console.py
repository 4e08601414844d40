"""What the demo prints while it works: step headings, plain lines, and live status lines.

On a terminal each server being started gets one line that updates in place (elapsed
seconds tick, then "ready after ..."); anywhere else (a pipe, CI) the same events come
out as plain lines, fewer of them. ``Console.stack_progress`` is the ``Stack`` progress
callback; it may be called from several threads at once (servers started in parallel).
"""

from __future__ import annotations

import re
import shutil
import sys
import threading
import time
from typing import TextIO

# The two messages ``Stack._wait`` reports, see pushsvc/launch.py.
_WAITING = re.compile(r"^\s*waiting for (?P<name>\S+) \.\.\. (?P<s>\d+)s$")
_READY = re.compile(r"^\s*(?P<name>\S+) ready after (?P<s>[\d.]+)s \((?P<where>.*)\)$")
_PLAIN_WAIT_EVERY_S = 15  # off a terminal, one "still waiting" line per server this often


class Console:
    def __init__(self, stream: TextIO = sys.stdout) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self._lock = threading.Lock()
        # The live block: the last lines on screen, keyed, in order; the cursor sits at the
        # start of the line below them. Plain lines go above the block while any of its
        # lines is still live; a finished line stays where it is.
        self._block: list[str] = []
        self._text: dict[str, str] = {}
        self._since: dict[str, float] = {}  # ticking lines: when they started
        self._finished: set[str] = set()
        self._ticker: threading.Thread | None = None
        self._closed = threading.Event()

    # ------------------------------------------------------------ plain output

    def line(self, text: str = "") -> None:
        with self._lock:
            if self._live():
                self._insert_above(text)
            else:
                self._block.clear()
                self.stream.write(text + "\n")
            self.stream.flush()

    def step(self, text: str) -> None:
        self.line()
        self.line(f"== {text}")

    # ------------------------------------------------------------ live lines

    def status(self, key: str, text: str, *, ticking: bool = False) -> None:
        """Show ``text`` on ``key``'s line (on a terminal only); ``ticking`` appends the
        seconds since the key first ticked, refreshed every second."""
        if not self.tty:
            return
        with self._lock:
            self._finished.discard(key)
            if ticking:
                self._since.setdefault(key, time.monotonic())
            else:
                self._since.pop(key, None)
            self._show(key, text)
            if ticking and self._ticker is None:
                self._ticker = threading.Thread(target=self._tick, name="demo-console", daemon=True)
                self._ticker.start()

    def finish(self, key: str, text: str) -> None:
        """``key``'s last word: replaces its live line on a terminal, a plain line elsewhere."""
        if not self.tty:
            self.line(text)
            return
        with self._lock:
            self._since.pop(key, None)
            self._finished.add(key)
            if self._block[-1:] == [key] and not self._live():
                # The bottom line and nothing live: write it whole, it may wrap.
                self._text[key] = text
                self.stream.write(f"\x1b[1A\r\x1b[2K{text}\n")
                self._block.clear()
                self.stream.flush()
                return
            self._show(key, text)

    def stack_progress(self, message: str) -> None:
        """``Stack``'s progress callback: "waiting for X ... Ns" and "X ready after Ns (url)"."""
        if m := _READY.match(message):
            self.finish(m["name"], f"  {m['name']:<15} ready after {float(m['s']):5.1f}s  {m['where']}")
        elif m := _WAITING.match(message):
            if self.tty:
                self.status(m["name"], f"  {m['name']:<15} starting ...", ticking=True)
            elif int(m["s"]) > 0 and int(m["s"]) % _PLAIN_WAIT_EVERY_S == 0:
                self.line(f"  {m['name']:<15} starting ... {m['s']}s")
        else:
            self.line(message)

    def freeze(self) -> None:
        """Leave the live lines as they are on screen; what follows prints below them."""
        with self._lock:
            self._block.clear()
            self._since.clear()

    def close(self) -> None:
        self._closed.set()
        self.freeze()

    # ------------------------------------------------------------ internals (lock held)

    def _live(self) -> bool:
        return any(k not in self._finished for k in self._block)

    def _show(self, key: str, text: str) -> None:
        self._text[key] = text
        if key in self._block:
            self._redraw(key)
        else:
            while self._block and self._block[0] in self._finished:
                self._block.pop(0)  # finished lines on top leave the block: it stays short
            self._finished.discard(key)
            self._block.append(key)
            self.stream.write(self._render(key) + "\n")
        self.stream.flush()

    def _render(self, key: str) -> str:
        text = self._text[key]
        if key in self._since:
            text += f" {time.monotonic() - self._since[key]:.0f}s"
        width = shutil.get_terminal_size().columns - 1
        return text[:width]  # a wrapped line would break the cursor arithmetic

    def _redraw(self, key: str) -> None:
        up = len(self._block) - self._block.index(key)
        self.stream.write(f"\x1b[{up}A\r\x1b[2K{self._render(key)}\x1b[{up}B\r")

    def _insert_above(self, text: str) -> None:
        self.stream.write(f"\x1b[{len(self._block)}A\r")
        for line in (text, *(self._render(k) for k in self._block)):
            self.stream.write(f"\x1b[2K{line}\n")

    def _tick(self) -> None:
        while not self._closed.wait(1.0):
            with self._lock:
                for key in [k for k in self._block if k in self._since]:
                    self._redraw(key)
                self.stream.flush()
