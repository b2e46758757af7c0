"""A bare Ray Serve app of the same shape as ours: the floor ``bench http`` compares against.

A FastAPI ingress (one replica) parses the JSON body and calls a second
deployment (``EchoBackend``, three replicas by default) through a deployment
handle with Serve's default router; the backend does no work and returns
the body, which the ingress answers as JSON. Two hops and a JSON round trip,
as in the prefix-cache app (proxy -> ingress -> cache replica), with
nothing else: what Ray Serve itself costs on this machine.

(No ``from __future__ import annotations`` here: FastAPI must see the
``Request`` annotation itself on a Serve ingress class.)
"""


from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve

APP_NAME = "ray-serve-echo"
ROUTE_PREFIX = "/echo"

echo_api = FastAPI(title="ray-serve-echo", docs_url=None, redoc_url=None)


@serve.deployment(name="EchoBackend", ray_actor_options={"num_cpus": 0})
class EchoBackend:
    async def echo(self, body: dict) -> dict:
        return body


@serve.deployment(name="EchoIngress", num_replicas=1, max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0})
@serve.ingress(echo_api)
class EchoIngress:
    def __init__(self, backend):
        self.backend = backend

    @echo_api.post("/v1/completions")
    async def completions(self, request: Request):
        body = await request.json()
        return JSONResponse({"object": "text_completion", "echo": await self.backend.echo.remote(body)})


def build_echo_app(replicas: int = 3):
    return EchoIngress.bind(EchoBackend.options(num_replicas=replicas).bind())
