"""The built-in rollout engines, one module per engine registering itself under the module's
name (`engines/registry.py: ENGINES`). A new one is an `EngineKind` subclass: `build`, the weight
`routes` its engines take, and an `Options` class for settings of its own; see README.md."""
