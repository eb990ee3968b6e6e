"""The engine seam: the protocol every rollout engine implements and its wire types
(`protocol`, `wire`), the registry that builds a run's engine by name (`registry`), the fleet of
a run (`fleet`), engine servers as subprocesses and their HTTP client (`http`), health and
replacement (`supervisor`), SGLang's router in front of several engines (`router`,
`router_main`, `routed`), real SGLang servers (`sglang`), and our CPU engine with its
SGLang-protocol server (`cpu/`)."""
