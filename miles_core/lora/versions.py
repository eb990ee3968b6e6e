"""Adapter versions, for engines that cannot replace a loaded adapter in place (they lack
`LORA_UPSERT`, engines/protocol.py: SGLang refuses a second load under a name it holds).

Each push of adapter `<name>` is loaded as a new adapter `<name>@v<version>` from its peft
directory (`/load_lora_adapter`); then the engine client sends the requests naming `<name>` under
the new name (`served_adapters`, {name: served name}); then the version it replaced is unloaded.
Between pushes an engine holds one version of each adapter, during a push two, so its adapter
limit is twice the run's adapters (lora/adapter.py: engine_spec).

A refused load unloads the versions this push loaded on that engine and re-points nothing: the
versions before keep serving, and the push raises PushFailed. A request in flight across a push
would finish on a version that is then unloaded, so a run with such an engine refuses what
generates during a push, and what names adapters by their own name (config/run.py).
"""

from __future__ import annotations

import contextlib

from miles_core.engines.protocol import EngineRequestRejected, ProcessUnavailable
from miles_core.lora.names import adapter_of, version_name
from miles_core.weights.remote import PushFailed


def push_versions(engine, directories: dict[str, str], version: int) -> None:
    """Loads each adapter of `directories` ({name: peft directory}) on `engine` as its version
    `version`, points the engine's requests at it, and unloads every other version of it the
    engine holds (the one it replaced; at the first push, the adapter the engine was started
    with, if it holds one). PushFailed for a refused load, after unloading what this push
    loaded, or for a refused unload (the new versions serve, the old one stays loaded)."""
    loaded: dict[str, str] = {}
    held = None  # the engine's adapters, as its last load answered them (SGLang's and ours)
    for name, directory in directories.items():
        new = version_name(name, version)
        try:
            answer = engine.load_lora_adapter(new, directory)
        except (EngineRequestRejected, ProcessUnavailable) as err:
            for done in loaded.values():
                with contextlib.suppress(EngineRequestRejected, ProcessUnavailable):
                    engine.unload_lora_adapter(done)
            raise PushFailed(
                f"engine at {engine.url} did not load adapter {new} from {directory}: {err}; "
                "the versions before keep serving"
            ) from err
        loaded[name] = new
        held = answer.get("loaded_adapters", held)
    replaced = {name: engine.served_adapters.get(name) for name in loaded}
    engine.served_adapters.update(loaded)
    for name, new in loaded.items():
        if held is not None:
            stale = [h for h in held if h != new and adapter_of(h) == name]
        else:  # an engine that does not list its adapters: the version this push replaced
            stale = [replaced[name]] if replaced[name] not in (None, new) else []
        for old in stale:
            try:
                engine.unload_lora_adapter(old)
            except (EngineRequestRejected, ProcessUnavailable) as err:
                raise PushFailed(
                    f"engine at {engine.url} serves adapter {new} but did not unload {old}, "
                    f"the version it replaced: {err}"
                ) from err
