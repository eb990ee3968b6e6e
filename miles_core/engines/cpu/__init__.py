"""Our CPU rollout engine, the stand-in for SGLang: in process (`embedded`, `serving`, built by
the engine registry) and as an HTTP server speaking SGLang's native API (`server`, started as a
subprocess by `engines/http.py`). The client side beside this package reaches the server only
through that HTTP API and the `engines.protocol.RolloutEngine` protocol.
"""
