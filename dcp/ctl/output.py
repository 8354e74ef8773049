"""How dcpctl talks to people and to scripts: rich tables, JSON, one-line errors, progress.

Rules of this module:
- Every command builds plain data (dicts, lists) first and hands it to ``Output``; the
  same data becomes a rich table (people) or JSON (``--json``, scripts). JSON goes to
  stdout as one document, except for the streaming commands (``tail``, ``dump``), which
  write JSON Lines: one object per line, flushed as it happens.
- Anything that goes wrong is a ``CtlError``: one line on stderr, a non-zero exit, never
  a traceback. Its ``code`` is the exit status (1 failure, 2 usage).
- A progress bar is drawn only when stdout is a terminal and not in JSON mode; piped
  output never contains one. Lines printed while a bar is shown go above it.
- Keys and values from the server are printed without rich markup interpretation.
"""

from __future__ import annotations

import base64
import contextlib
import json
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

__all__ = ["CtlError", "Output", "preview", "value_doc"]

#: Width of tables when stdout is not a terminal (rich would otherwise squeeze to 80).
PIPE_WIDTH = 220


class CtlError(Exception):
    """A failure to report as ``dcpctl: <message>`` with exit status ``code``."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def preview(data: bytes, limit: int) -> str:
    """Printable text of a key or value, cut to ``limit`` characters (0 = no limit)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = repr(bytes(data))[2:-1]
    text = text.replace("\n", "\\n").replace("\r", "\\r")
    if limit and len(text) > limit:
        return text[: max(limit - 1, 1)] + "…"
    return text


def value_doc(value: bytes) -> dict[str, str]:
    """A value for JSON: text when it is UTF-8, else base64 with ``value_encoding``."""
    try:
        return {"value": value.decode("utf-8")}
    except UnicodeDecodeError:
        return {"value": base64.b64encode(value).decode(), "value_encoding": "base64"}


def _cell(value: Any) -> Text:
    if value is None:
        return Text("-")
    if isinstance(value, bool):
        return Text("yes" if value else "no")
    return Text(str(value))


class _NoProgress:
    def advance(self, n: float = 1) -> None:
        pass

    def update_total(self, total: float | None) -> None:
        pass

    def set_completed(self, n: float) -> None:
        pass


class _Bar:
    def __init__(self, progress: Progress, task: Any) -> None:
        self._progress = progress
        self._task = task

    def advance(self, n: float = 1) -> None:
        self._progress.advance(self._task, n)

    def update_total(self, total: float | None) -> None:
        self._progress.update(self._task, total=total)

    def set_completed(self, n: float) -> None:
        self._progress.update(self._task, completed=n)


class Output:
    """Where a command's results go (stdout) and how (table or JSON)."""

    def __init__(self, *, json_mode: bool, progress: bool = True) -> None:
        self.json_mode = json_mode
        tty = sys.stdout.isatty()
        self.console = Console(
            width=None if tty else PIPE_WIDTH, highlight=False, soft_wrap=not tty
        )
        self.show_progress = progress and tty and not json_mode
        self._live: Progress | None = None
        self._pending: list[str] = []  # lines waiting to go above the bar
        self._pending_since = 0.0

    # ------------------------------------------------------------------ JSON

    def json(self, obj: Any) -> None:
        """One JSON document on stdout."""
        sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False) + "\n")
        sys.stdout.flush()

    def json_line(self, obj: Any) -> None:
        """One JSON Lines record on stdout, flushed (streaming commands)."""
        sys.stdout.write(json.dumps(obj, separators=(",", ":")) + "\n")
        sys.stdout.flush()

    # ------------------------------------------------------------------ people

    def _print(self, renderable: Any) -> None:
        self._flush_pending()
        console = self._live.console if self._live is not None else self.console
        console.print(renderable, markup=False)

    def line(self, text: str) -> None:
        """One plain line, flushed at once (``tail`` piped into ``grep`` stays live)."""
        if self._live is not None:
            # Printing above a live bar re-renders it: batch lines (every 0.1 s).
            if not self._pending:
                self._pending_since = time.monotonic()
            self._pending.append(text)
            if time.monotonic() - self._pending_since > 0.1 or len(self._pending) > 5000:
                self._flush_pending()
        else:
            sys.stdout.write(text + "\n")
            sys.stdout.flush()

    def _flush_pending(self) -> None:
        if self._pending and self._live is not None:
            self._live.console.print(Text("\n".join(self._pending)), markup=False)
        self._pending.clear()

    def table(
        self,
        title: str | None,
        columns: Sequence[str],
        rows: Sequence[Sequence[Any]],
        *,
        footer: Sequence[Any] | None = None,
        numeric: Sequence[str] = (),
    ) -> None:
        """A table; ``numeric`` columns are right-aligned; ``footer`` is a totals row."""
        t = Table(
            title=title,
            title_justify="left",
            show_footer=footer is not None,
            header_style="bold",
            footer_style="bold",
        )
        for i, col in enumerate(columns):
            t.add_column(
                col,
                justify="right" if col in numeric else "left",
                footer=_cell(footer[i]) if footer is not None else "",
                overflow="fold",
            )
        for row in rows:
            t.add_row(*(_cell(v) for v in row))
        self._print(t)

    def pairs(self, title: str | None, items: Sequence[tuple[str, Any]]) -> None:
        """A two-column key/value table."""
        self.table(title, ["name", "value"], [(k, v) for k, v in items])

    # ------------------------------------------------------------------ progress

    @contextlib.contextmanager
    def progress(self, description: str, total: float | None) -> Iterator[Any]:
        """A progress bar on a terminal; a no-op object when piped, in JSON mode, or
        when there is no ``total`` (an endless stream has no progress to show)."""
        if not self.show_progress or total is None:
            yield _NoProgress()
            return
        progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
            transient=True,
        )
        task = progress.add_task(description, total=total)
        with progress:
            self._live = progress
            try:
                yield _Bar(progress, task)
            finally:
                self._flush_pending()
                self._live = None
