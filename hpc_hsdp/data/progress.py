"""The progress line of ``prepare-data``: share of the input done, text bytes/s, tokens/s."""

from __future__ import annotations

import sys
import time
from typing import IO

from hpc_hsdp.plan.units import human_bytes, human_count


class Progress:
    """A progress line on stderr: input share, text bytes/s, tokens/s. Redrawn in place on a
    terminal; a line every ``interval`` seconds otherwise (logs)."""

    def __init__(self, stream: IO[str] | None = None, *, enabled: bool = True, interval: float | None = None):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = interval if interval is not None else (0.25 if self.tty else 15.0)
        self.start("", 0)

    def start(self, phase: str, total_disk_bytes: int) -> None:
        self.phase = phase
        self.total = total_disk_bytes
        self.disk = self.text = self.tokens = 0
        self.began = self.last = time.monotonic()
        self._drawn: tuple | None = None

    def update(self, *, disk_bytes: int = 0, text_bytes: int = 0, tokens: int = 0) -> None:
        self.disk += disk_bytes
        self.text += text_bytes
        self.tokens += tokens
        now = time.monotonic()
        if now - self.last >= self.interval:
            self.last = now
            self._draw(final=False)

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.began, 1e-9)
        share = f"{100 * self.disk / self.total:3.0f}% " if self.total else ""
        text = (
            f"{self.phase}: {share}{human_bytes(self.disk)}/{human_bytes(self.total)}, "
            f"{human_bytes(self.text / elapsed)}/s of text"
        )
        if self.tokens:
            text += f", {human_count(self.tokens / elapsed)} tokens/s, {human_count(self.tokens)} tokens"
        return f"{text}, {elapsed:.1f} s"

    def _draw(self, *, final: bool) -> None:
        state = (self.phase, self.disk, self.text, self.tokens)
        if not self.enabled or (final and not self.tty and state == self._drawn):
            return
        self._drawn = state
        if self.tty:
            self.stream.write("\r\x1b[2K" + self.line() + ("\n" if final else ""))
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()

    def finish(self) -> None:
        self._draw(final=True)
