"""The one decorator every step-level task uses: no input hashing, no result persistence
(tasks pass live runtime objects by reference, within one flow run)."""

from functools import partial

from prefect import task
from prefect.cache_policies import NO_CACHE

step_task = partial(task, cache_policy=NO_CACHE, persist_result=False)
