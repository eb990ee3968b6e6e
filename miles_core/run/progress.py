"""Step progress for long work: a rich progress bar in the CLI, log lines elsewhere (e.g. Prefect UI runs)."""

from __future__ import annotations

import logging
from typing import Protocol

log = logging.getLogger("miles")


class Reporter(Protocol):
    def start(self, total: int, description: str) -> None: ...

    def update(self, step: int, fields: dict[str, float]) -> None: ...

    def stop(self) -> None: ...


class LogReporter:
    def __init__(self, every: int = 10):
        self.every = every
        self.description = ""

    def start(self, total: int, description: str) -> None:
        self.description, self.total = description, total

    def update(self, step: int, fields: dict[str, float]) -> None:
        if step % self.every == 0 or step + 1 == getattr(self, "total", 0):
            text = " ".join(f"{k}={v:.4g}" for k, v in fields.items())
            log.info("%s step %d/%d %s", self.description, step + 1, self.total, text)

    def stop(self) -> None:
        pass


class RichReporter:
    """A live bar: step, the latest fields (reward, step time), elapsed and remaining time."""

    def __init__(self) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            transient=False,
        )
        self.task_id = None

    def start(self, total: int, description: str) -> None:
        if self.task_id is None:
            self.progress.start()
        else:
            self.progress.stop_task(self.task_id)
        self.task_id = self.progress.add_task(description, total=total, info="")

    def update(self, step: int, fields: dict[str, float]) -> None:
        info = "  ".join(f"{k} {v:.3f}" for k, v in fields.items())
        self.progress.update(self.task_id, completed=step + 1, info=info)

    def stop(self) -> None:
        if self.task_id is not None:
            self.progress.stop()
            self.task_id = None


_reporter: Reporter = LogReporter()


def set_reporter(reporter: Reporter) -> None:
    global _reporter
    _reporter = reporter


def reporter() -> Reporter:
    return _reporter
