"""One session's trajectory tree: every chat request either extends a node (its messages start
with that node's conversation, then add only non-assistant messages) or, when the harness rewrote
history, starts a new branch from a fresh render. Nodes hold token ids, never text: a node's ids
are its parent's ids + the appended messages' ids (family.append) + the engine's completion ids,
so the trainer sees exactly what the engine saw and produced.

Each leaf becomes one Sample: the ids after the branch's first prompt are the response, with
loss mask 1 on generated tokens and 0 on appended ones; all leaves share the session's rollout
id (per-rollout loss normalisation weighs a session once, whatever its number of leaves).
Declared per-token fields follow the ids: each turn's rows are appended to its parent's, with
the field's fill value on the appended ids (`TokenField.join`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from miles_core.tito import Message, TitoFamily
from miles_core.tito.diff import token_diff
from miles_core.token_fields import join_fields
from miles_core.types import FINISH_REASON_TO_STATUS, Sample, Status

MAX_NODES = 1024


def same_message(a: Message, b: Message) -> bool:
    """Whether a message the harness sent equals the one stored (reasoning is not compared:
    clients usually drop it; tool-call arguments are compared as JSON values)."""
    if a.get("role") != b.get("role") or (a.get("content") or "") != (b.get("content") or ""):
        return False
    if a.get("role") == "tool" and a.get("tool_call_id") != b.get("tool_call_id"):
        return False
    calls_a, calls_b = a.get("tool_calls") or [], b.get("tool_calls") or []
    if len(calls_a) != len(calls_b):
        return False
    for x, y in zip(calls_a, calls_b, strict=True):
        fx, fy = x.get("function", {}), y.get("function", {})
        if fx.get("name") != fy.get("name") or _args(fx) != _args(fy):
            return False
    return True


def _args(function: dict) -> Any:
    raw = function.get("arguments")
    try:
        return json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError:
        return raw


@dataclass
class Node:
    id: int
    parent: int | None
    messages: list[Message]  # the conversation through this node's assistant reply
    tools: list[dict] | None
    ids: list[int]  # branch prompt + everything after it, through this node's completion
    prompt_length: int  # the branch's first render (the sample's prompt)
    loss_mask: list[int]  # per id after the prompt: 1 generated, 0 appended
    log_probs: list[float]  # per id after the prompt (0.0 where appended)
    versions: list[int]  # weight version of each generation on the path
    finish_reason: str
    children: list[int] = field(default_factory=list)
    checked: bool = False  # its reply has been compared with what the harness sent back
    # declared per-token fields along the path (token_fields.join: fill rows where appended)
    fields: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class Turn:
    """Where a request attaches and the ids to send to the engine."""

    parent: Node | None
    ids: list[int]
    prompt_length: int
    loss_mask: list[int]
    log_probs: list[float]
    versions: list[int]
    appended: int  # ids added for the new messages (0 on a fresh branch)
    fields: dict[str, np.ndarray] = field(default_factory=dict)  # the parent's


class Trajectory:
    def __init__(self, family: TitoFamily, rollout_id: str):
        self.family = family
        self.rollout_id = rollout_id
        self.nodes: list[Node] = []
        self.branches = 0  # requests that did not extend an existing node
        # replies whose canonical render (of what the harness sent back) differs from the
        # engine's ids: (node id, first differing position in the reply), and the edits
        self.divergences: list[tuple[int, int]] = []
        self.token_edits = 0  # single-token edits (Levenshtein) over those replies
        self.total_ids = 0  # token ids stored over all nodes (the session server caps it)

    def attach(self, messages: list[Message], tools: list[dict] | None) -> Turn:
        """The node this request extends (deepest match), or a fresh branch."""
        if len(self.nodes) >= MAX_NODES:
            raise ValueError(f"session has {MAX_NODES} turns already; start a new session")
        parent = self._deepest_match(messages, tools)
        if parent is None:
            self.branches += bool(self.nodes)
            ids = self.family.prompt(messages, tools)
            return Turn(None, ids, len(ids), [], [], [], 0)
        added = self.family.append(messages[len(parent.messages) :], tools)
        if parent.finish_reason == "length":  # the reply was cut off: close it as a render would
            added = self.family.stop_ids[:1] + added
        return Turn(
            parent,
            parent.ids + added,
            parent.prompt_length,
            parent.loss_mask + [0] * len(added),
            parent.log_probs + [0.0] * len(added),
            list(parent.versions),
            len(added),
            parent.fields,
        )

    def _deepest_match(self, messages, tools) -> Node | None:
        best = None
        for node in self.nodes:
            n = len(node.messages)
            if n >= len(messages) or node.tools != tools:
                continue  # nothing new to answer, or other tools
            if any(m.get("role") == "assistant" for m in messages[n:]):
                continue
            if all(same_message(a, b) for a, b in zip(messages[:n], node.messages, strict=True)):
                if best is None or n > len(best.messages):
                    best = node
        return best

    def record(
        self,
        turn: Turn,
        messages: list[Message],
        tools: list[dict] | None,
        reply: Message,
        output_ids: list[int],
        log_probs: list[float],
        version: int,
        finish_reason: str,
        token_fields: dict[str, np.ndarray] | None = None,
    ) -> Node:
        """The node for the engine's completion of `turn`; `token_fields` are the declared
        per-token fields of that completion (`GenerateResponse.token_fields`)."""
        node = Node(
            id=len(self.nodes),
            parent=turn.parent.id if turn.parent else None,
            messages=list(messages) + [reply],
            tools=tools,
            ids=turn.ids + output_ids,
            prompt_length=turn.prompt_length,
            loss_mask=turn.loss_mask + [1] * len(output_ids),
            log_probs=turn.log_probs + list(log_probs),
            versions=turn.versions + [version],
            finish_reason=finish_reason,
            fields=join_fields(turn.fields, token_fields or {}, turn.appended),
        )
        if turn.parent is not None:
            turn.parent.children.append(node.id)
        self.nodes.append(node)
        self.total_ids += len(node.ids)
        return node

    def count_mismatches(self, turn: Turn, messages: list[Message]) -> int:
        """Single-token edits between the engine's ids and the canonical render of the
        harness's assistant messages for the replies they repeat, along the path `turn` extends
        (0 for an append-only harness whose model output is canonical); each differing reply is
        recorded in `divergences` with where it first parts (tito/diff.py). The session keeps
        the engine's ids either way; this measures what a re-tokenizing trainer would get wrong."""
        bad = 0
        node = turn.parent
        while node is not None and not node.checked:  # each reply is compared once
            node.checked = True
            sent = messages[len(node.messages) - 1]
            generated = self._completion_ids(node)
            if node.finish_reason == "length":
                generated = generated + self.family.stop_ids[:1]
            canonical = self.family.completion(sent, node.tools)
            diff = token_diff(generated, canonical)
            if not diff.equal:
                self.divergences.append((node.id, diff.first_divergence))
                bad += diff.edits
            node = self.nodes[node.parent] if node.parent is not None else None
        self.token_edits += bad
        return bad

    def _completion_ids(self, node: Node) -> list[int]:
        """The node's own generated ids (for a cut-off reply, with the stop id a render adds)."""
        start = len(node.ids)
        while start > node.prompt_length and node.loss_mask[start - node.prompt_length - 1]:
            start -= 1
        return node.ids[start:]

    def leaves(self) -> list[Node]:
        return [n for n in self.nodes if not n.children]

    def samples(self, reward: float | None = None) -> list[Sample]:
        """One Sample per leaf, sharing this session's rollout id."""
        out = []
        for i, leaf in enumerate(self.leaves()):
            status = FINISH_REASON_TO_STATUS.get(leaf.finish_reason, Status.FAILED)
            sample = Sample(
                group_index=0,
                index=i,
                rollout_id=self.rollout_id,
                prompt=leaf.messages[:1],
                tokens=list(leaf.ids),
                response_length=len(leaf.ids) - leaf.prompt_length,
                loss_mask=list(leaf.loss_mask),
                rollout_log_probs=list(leaf.log_probs),
                weight_versions=sorted(set(leaf.versions)),
                reward=reward,
                status=status,
                token_fields=dict(leaf.fields),
                metadata={"node": leaf.id, "turns": len(leaf.versions), "leaves": 0},
            )
            out.append(sample)
        for s in out:
            s.metadata["leaves"] = len(out)
        return out
