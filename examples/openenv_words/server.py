"""A tiny OpenEnv environment, built and served with `openenv-core`'s own server (`create_app`):
reset(word=...) asks the agent to say a word; each step takes {"message": ...} and pays 1.0 when
the message is the word (then the episode is done), else asks again, for up to `max_tries` steps.

    python examples/openenv_words/server.py --port 8031

Train against it with `miles_core.envs.openenv_agent:run_agent` (docs/agents-and-sessions.md, "OpenEnv environments").
"""

from __future__ import annotations

import argparse
import uuid

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class SayAction(Action):
    message: str


class SayObservation(Observation):
    prompt: str = ""


class SayWordEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True  # one instance per WebSocket session

    def __init__(self) -> None:
        super().__init__()
        self._word, self._max_tries = "", 2
        self._state = State(episode_id=str(uuid.uuid4()), step_count=0)

    def reset(self, seed=None, episode_id=None, word: str = "cat", max_tries: int = 2, **_):
        self._word, self._max_tries = word, max_tries
        self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0)
        return SayObservation(prompt=f"say {word}", done=False, reward=0.0)

    def step(self, action: SayAction, timeout_s=None, **_) -> SayObservation:
        self._state.step_count += 1
        solved = action.message.strip() == self._word
        done = solved or self._state.step_count >= self._max_tries
        prompt = "correct" if solved else f"no: say {self._word}"
        return SayObservation(prompt=prompt, done=done, reward=float(solved))

    @property
    def state(self) -> State:
        return self._state


app = create_app(
    SayWordEnvironment, SayAction, SayObservation, env_name="say_word", max_concurrent_envs=256
)

if __name__ == "__main__":
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
