"""One TLS context per process for the HTTP clients made per agent episode.

httpx builds a fresh context for every client it creates, loading the CA bundle: ≈25 ms of CPU
per client, on the event loop that runs every episode in flight (an episode opened two: its
session's and its agent's OpenAI client), although they mostly speak plain HTTP on loopback.
The shared context is httpx's default one (verification unchanged); an `ssl.SSLContext` is safe
to share between clients and threads."""

from __future__ import annotations

import functools
import ssl

import httpx


@functools.cache
def shared_ssl_context() -> ssl.SSLContext:
    return httpx.create_ssl_context()
