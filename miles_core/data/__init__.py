from miles_core.data.dataset import (
    DatasetError,
    PromptSource,
    load_examples,
    read_jsonl,
    rl_examples,
    sft_examples,
    to_messages,
)
from miles_core.data.tasks import TASKS, Example, Score, Task

__all__ = [
    "DatasetError",
    "Example",
    "PromptSource",
    "Score",
    "TASKS",
    "Task",
    "load_examples",
    "sft_examples",
    "read_jsonl",
    "rl_examples",
    "to_messages",
]
