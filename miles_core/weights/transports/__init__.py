"""The built-in weight transports, one module per transport, each registering itself under the
module's name (`weights/transport.py: TRANSPORTS`). A new one needs a `route` its engines take,
`push`, and an `Options` class if it has settings of its own; see README.md."""
