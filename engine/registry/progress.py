"""A rich progress display for a pull, on stderr (stdout stays the command's output)."""
from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TaskProgressColumn, TextColumn, TimeElapsedColumn

_LABELS = {"verify": "re-hash cached GGUF", "download": "download wheels (pip, hash-checked)",
           "assemble": "assemble + verify GGUF", "convert": "convert tensors"}


class RichPullProgress:
    """Use as a context manager; one bar per stage, added when the stage starts."""

    def __init__(self, title: str):
        self.title = title
        self._progress = Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                                  TimeElapsedColumn(), console=Console(stderr=True))
        self._tasks: dict[str, TaskID] = {}

    def __enter__(self) -> RichPullProgress:
        self._progress.console.print(self.title)
        self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.stop()

    def update(self, stage: str, done: int, total: int) -> None:
        if stage not in self._tasks:
            self._tasks[stage] = self._progress.add_task(_LABELS.get(stage, stage), total=total)
        self._progress.update(self._tasks[stage], completed=done, total=total)
