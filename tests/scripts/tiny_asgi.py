"""A minimal ASGI app factory (`tiny_asgi:create`) for uvicorn-run wrappers in tests."""


def create():
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    return app
