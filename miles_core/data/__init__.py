from miles_core.data.dataset import (
    DatasetError,
    PromptSource,
    load_examples,
    read_jsonl,
    rl_examples,
    sft_examples,
    to_messages,
)
from miles_core.data.tasks import Example, Score, Task, get_task, register_task, task_names

__all__ = [
    "DatasetError",
    "Example",
    "PromptSource",
    "Score",
    "Task",
    "get_task",
    "load_examples",
    "sft_examples",
    "read_jsonl",
    "rl_examples",
    "register_task",
    "task_names",
    "to_messages",
]
