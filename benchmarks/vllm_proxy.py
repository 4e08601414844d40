"""A minimal P/D proxy for vLLM's own NIXL connectors (benchmark anchors only).

Two modes, each the way vLLM's authors drive their connector:

* ``pull`` (``NixlConnector``), as ``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``:
  send the prefill leg to P (``max_tokens`` 1, not streamed, ``do_remote_decode``), wait
  for P's answer, copy its ``kv_transfer_params`` (P's engine id, block ids, side channel)
  into the decode leg, then stream D's answer back. D READs the KV from P.
* ``push`` (``NixlPushConnector``), as
  ``examples/disaggregated/disaggregated_serving/disagg_proxy_pushconnector_demo.py``:
  P's coordinates (engine id, NIXL side-channel host/port) are given up front; the prefill
  leg and the decode leg (``do_remote_prefill`` + those coordinates +
  ``remote_request_id``) are sent concurrently; D registers its blocks with P and P
  WRITEs into them. ``--sequential`` drains P first (what some versions of that example did).

Both legs carry the same ``X-Request-Id`` so vLLM's ids on P and D share a base id.
One shared aiohttp session with keep-alive (the upstream examples open one per request;
sharing only makes the anchor faster).

    python benchmarks/vllm_proxy.py --mode pull --prefill URL --decode URL --port N
    python benchmarks/vllm_proxy.py --mode push --prefill URL --decode URL --port N \
        --prefill-engine-id ID --prefill-host HOST --prefill-side-channel-port PORT
"""

from __future__ import annotations

import argparse
import asyncio
import uuid

import aiohttp
from aiohttp import web

_NONE_PARAMS = {"remote_engine_id": None, "remote_block_ids": None, "remote_host": None, "remote_port": None}


def prefill_leg(body: dict, transfer_id: str | None = None) -> dict:
    leg = dict(body)
    leg["max_tokens"] = 1
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    leg.pop("min_tokens", None)
    leg["stream"] = False
    leg.pop("stream_options", None)
    leg["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False, **_NONE_PARAMS}
    if transfer_id:
        leg["kv_transfer_params"]["transfer_id"] = transfer_id
    return leg


def push_decode_leg(body: dict, args: argparse.Namespace, request_id: str, transfer_id: str) -> dict:
    leg = dict(body)
    leg["kv_transfer_params"] = {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_engine_id": args.prefill_engine_id,
        "remote_host": args.prefill_host,
        "remote_port": args.prefill_side_channel_port,
        "tp_size": 1,
        "pp_size": 1,
        "remote_request_id": request_id,
        "transfer_id": transfer_id,
    }
    return leg


class Proxy:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.session: aiohttp.ClientSession | None = None

    async def startup(self, app: web.Application) -> None:
        # keep-alive below uvicorn's 5 s idle close, so a reused connection is never a dead one
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=1024, keepalive_timeout=4.0),
            timeout=aiohttp.ClientTimeout(total=None, sock_read=600))

    async def cleanup(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"mode": self.args.mode})

    async def _prefill(self, leg: dict, headers: dict) -> dict:
        assert self.session is not None
        async with self.session.post(f"{self.args.prefill}/v1/completions", json=leg, headers=headers) as r:
            doc = await r.json(content_type=None)
            if r.status != 200:
                raise web.HTTPBadGateway(text=f"prefill: HTTP {r.status}: {str(doc)[:300]}")
            return doc

    async def completions(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        body = await request.json()
        request_id = request.headers.get("X-Request-Id") or str(uuid.uuid4())
        headers = {"X-Request-Id": request_id}
        if self.args.mode == "pull":
            doc = await self._prefill(prefill_leg(body), headers)
            decode = dict(body)
            decode["kv_transfer_params"] = doc.get("kv_transfer_params")
            prefill_task = None
        else:
            transfer_id = f"xfer-{uuid.uuid4()}"
            prefill_task = asyncio.ensure_future(self._prefill(prefill_leg(body, transfer_id), headers))
            if self.args.sequential:
                await prefill_task
            decode = push_decode_leg(body, self.args, request_id, transfer_id)
        try:
            async with self.session.post(f"{self.args.decode}/v1/completions", json=decode, headers=headers) as r:
                resp = web.StreamResponse(status=r.status, headers={"Content-Type": r.headers.get(
                    "Content-Type", "text/event-stream")})
                await resp.prepare(request)
                async for chunk in r.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        finally:
            if prefill_task is not None:
                await prefill_task


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("pull", "push"), required=True)
    ap.add_argument("--prefill", required=True)
    ap.add_argument("--decode", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--prefill-engine-id")
    ap.add_argument("--prefill-host", default="127.0.0.1")
    ap.add_argument("--prefill-side-channel-port", type=int)
    ap.add_argument("--sequential", action="store_true", help="push: drain P before sending D")
    args = ap.parse_args()
    if args.mode == "push" and not (args.prefill_engine_id and args.prefill_side_channel_port):
        ap.error("push mode needs --prefill-engine-id and --prefill-side-channel-port")
    proxy = Proxy(args)
    app = web.Application(client_max_size=64 << 20)
    app.on_startup.append(proxy.startup)
    app.on_cleanup.append(proxy.cleanup)
    app.router.add_get("/healthz", proxy.health)
    app.router.add_post("/v1/completions", proxy.completions)
    try:
        import uvloop  # the pushsvc proxy runs on uvloop too
        uvloop.install()
    except ImportError:
        pass
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
