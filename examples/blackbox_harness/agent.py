"""A black-box agent harness: it knows nothing of miles. It gets an OpenAI base URL
(OPENAI_BASE_URL) and a task (MILES_TASK, JSON with "prompt"), and uses the official `openai`
client the way agent frameworks do:

1. the main agent plans;
2. it spawns a sub-agent with a fresh conversation of its own for one sub-task;
3. its context is compacted midway: the history is replaced by a summary (not append-only);
4. it finishes and prints its result as one JSON line, {"reward": …, "turns": …}.

Through the session server every call is recorded token-faithfully: the sub-agent and the
compaction each start a new branch of the session's trajectory tree, and every leaf becomes a
training sample of the same rollout.

    OPENAI_BASE_URL=http://127.0.0.1:30100/sessions/<id>/v1 MILES_TASK='{"prompt": "..."}' \
        python examples/blackbox_harness/agent.py
"""

from __future__ import annotations

import json
import os

from openai import OpenAI

MAX_TOKENS = int(os.environ.get("HARNESS_MAX_TOKENS", "16"))


def ask(client: OpenAI, messages: list[dict]) -> str:
    r = client.chat.completions.create(model="policy", messages=messages, max_tokens=MAX_TOKENS)
    return r.choices[0].message.content or ""


def main() -> None:
    client = OpenAI(api_key=os.environ.get("OPENAI_API_KEY", "none"), max_retries=0)
    task = json.loads(os.environ["MILES_TASK"])
    turns = 0
    main_agent = [{"role": "user", "content": f"plan: {task['prompt']}"}]
    plan = ask(client, main_agent)
    turns += 1
    main_agent += [{"role": "assistant", "content": plan}, {"role": "user", "content": "step 1"}]
    step = ask(client, main_agent)
    turns += 1
    main_agent.append({"role": "assistant", "content": step})
    # a sub-agent: its own conversation, same endpoint
    sub_agent = [{"role": "user", "content": f"subtask of {task['prompt']}: check"}]
    found = ask(client, sub_agent)
    turns += 1
    # compaction: the main agent's history becomes one summary message
    main_agent = [
        {"role": "user", "content": f"summary: planned, did step 1, sub-agent said {found[:8]!r}"}
    ]
    final = ask(client, main_agent)
    turns += 1
    reward = float("a" in final)  # the harness's own grader
    print(json.dumps({"reward": reward, "turns": turns}))


if __name__ == "__main__":
    main()
