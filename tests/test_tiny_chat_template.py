"""The tiny model ships the `tiny` TITO family's ChatML template (tools, reasoning, tool results),
and it renders plain chats and every built-in task's prompts to exactly the ids the earlier
role/content-only template gave: the demo's prompts, and so its curves, do not move."""

from __future__ import annotations

import pytest

from miles_core.data.dataset import to_messages
from miles_core.data.tasks import TASKS
from miles_core.models.tokenizer import build_tokenizer
from miles_core.tito.chatml import chat_template

# the template the tiny tokenizer shipped before it rendered tools and reasoning
ROLE_CONTENT_ONLY = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

PLAIN_CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2="}],
    [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "a\nb\tc"},
        {"role": "assistant", "content": "reply"},
        {"role": "user", "content": "again"},
    ],
    [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": "three"},
        {"role": "system", "content": "late system"},
    ],
]


def _ids(tok, template: str, messages, generation: bool) -> list[int]:
    text = tok.apply_chat_template(
        messages, chat_template=template, add_generation_prompt=generation, tokenize=False
    )
    return tok.encode(text, add_special_tokens=False)


CHAT_TEMPLATE = chat_template(keep_history_reasoning=True)  # the `tiny` family's


def test_the_tiny_tokenizer_ships_the_tiny_familys_template():
    assert build_tokenizer().chat_template == CHAT_TEMPLATE


@pytest.mark.parametrize("generation", [True, False])
def test_plain_chats_and_every_tasks_prompts_render_to_the_same_ids(generation):
    tok = build_tokenizer()
    chats = list(PLAIN_CHATS)
    for name in TASKS.names():
        chats += [to_messages(e.prompt) for e in TASKS.get(name).generate(32, seed=3)]
    assert len(chats) > len(PLAIN_CHATS) + 3 * 32  # every task gave prompts
    for messages in chats:
        old = _ids(tok, ROLE_CONTENT_ONLY, messages, generation)
        assert _ids(tok, CHAT_TEMPLATE, messages, generation) == old, messages
