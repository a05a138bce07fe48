"""``ucm pd-proxy``: prefill/decode disaggregation over a shared ucm store.

An OpenAI-compatible front for two pools of ``vllm serve`` instances that share one ucm
store (``redis``, or ``posix`` on a shared filesystem): prefill instances run with
``kv_role="kv_producer"``, decode instances with ``kv_role="kv_consumer"``. For each
``/v1/completions`` or ``/v1/chat/completions`` request the proxy

1. sends a copy to a prefill instance with one output token, which computes the prompt's
   KV and publishes it to the store before it answers;
2. sends the original request to a decode instance, which finds the prompt's blocks in
   the store, loads them instead of computing them, and generates the answer;
3. relays the decode instance's response (streamed or not) to the client unchanged.

Each pool is balanced by least outstanding requests (ties in turn). A prefill failure
is returned to the client as is; other paths (``/v1/models``, ``/health``) go to a
decode instance.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

logger = logging.getLogger(__name__)

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
"""Requests split into a prefill and a decode part; anything else goes to decode."""
_HOP_HEADERS = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding"}
)


@dataclass
class Pool:
    """Instances of one role, balanced by least outstanding requests."""

    urls: Sequence[str]
    """Base URLs (``http://host:port``) of the instances."""
    outstanding: dict[str, int] = field(default_factory=dict)
    """Requests in flight per instance."""
    _turn: itertools.count[int] = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("a pool needs at least one instance URL")
        self.outstanding = {url.rstrip("/"): 0 for url in self.urls}

    def pick(self) -> str:
        """Return the instance with the fewest requests in flight (ties in turn)."""
        fewest = min(self.outstanding.values())
        candidates = [url for url, n in self.outstanding.items() if n == fewest]
        return candidates[next(self._turn) % len(candidates)]


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """Return the request to send to prefill: the same prompt, one output token.

    Args:
        body: The client's request body.
    """
    prefill = {key: value for key, value in body.items() if key != "stream_options"}
    prefill.update(stream=False, max_tokens=1, min_tokens=0)
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    return prefill


class PDProxy:
    """The proxy's request handling; :meth:`app` builds the aiohttp application."""

    def __init__(self, prefill: Sequence[str], decode: Sequence[str]) -> None:
        """Set up the pools.

        Args:
            prefill: Base URLs of the prefill (``kv_producer``) instances.
            decode: Base URLs of the decode (``kv_consumer``) instances.

        Raises:
            ValueError: A pool is empty.
        """
        self.prefill = Pool(prefill)
        self.decode = Pool(decode)
        self._session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        """Return the aiohttp application serving the proxy."""
        application = web.Application(client_max_size=64 << 20)
        application.router.add_route("*", "/{path:.*}", self._handle)
        application.on_startup.append(self._open)
        application.on_cleanup.append(self._close)
        return application

    async def _open(self, _: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        self._session = aiohttp.ClientSession(timeout=timeout)

    async def _close(self, _: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if request.method == "POST" and request.path in GENERATION_PATHS:
            try:
                body = await request.json()
            except ValueError:
                return web.json_response({"error": "the body is not JSON"}, status=400)
            failed = await self._prefill(request.path, body, request.headers)
            if failed is not None:
                return failed
        return await self._relay(request, await request.read())

    async def _prefill(self, path: str, body: dict[str, Any], headers: Any) -> web.Response | None:
        """Run the prefill part; return an error response, or None once it succeeded."""
        assert self._session is not None
        url = self.prefill.pick()
        self.prefill.outstanding[url] += 1
        try:
            async with self._session.post(
                url + path, json=prefill_request(body), headers=_forwarded(headers)
            ) as reply:
                payload = await reply.read()
                if reply.status != 200:
                    logger.warning("prefill %s answered %d: %s", url, reply.status, payload[:200])
                    return web.Response(
                        status=reply.status, body=payload, content_type=reply.content_type
                    )
        except aiohttp.ClientError as exc:
            return web.json_response({"error": f"prefill instance {url}: {exc}"}, status=502)
        finally:
            self.prefill.outstanding[url] -= 1
        return None

    async def _relay(self, request: web.Request, body: bytes) -> web.StreamResponse:
        """Send the request to a decode instance and stream its response back."""
        assert self._session is not None
        url = self.decode.pick()
        self.decode.outstanding[url] += 1
        try:
            async with self._session.request(
                request.method,
                url + request.path_qs,
                data=body,
                headers=_forwarded(request.headers),
            ) as reply:
                response = web.StreamResponse(
                    status=reply.status,
                    headers={
                        k: v for k, v in reply.headers.items() if k.lower() not in _HOP_HEADERS
                    },
                )
                await response.prepare(request)
                async for chunk in reply.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        except aiohttp.ClientError as exc:
            return web.json_response({"error": f"decode instance {url}: {exc}"}, status=502)
        finally:
            self.decode.outstanding[url] -= 1


def _forwarded(headers: Any) -> dict[str, str]:
    """Return the client's headers worth forwarding (authorization, content type...)."""
    return {k: v for k, v in headers.items() if k.lower() not in _HOP_HEADERS | {"host"}}


def serve(prefill: Sequence[str], decode: Sequence[str], host: str, port: int) -> None:
    """Run the proxy until interrupted.

    Args:
        prefill: Base URLs of the prefill instances.
        decode: Base URLs of the decode instances.
        host: The address to listen on.
        port: The port to listen on.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    proxy = PDProxy(prefill, decode)
    logger.info("ucm pd-proxy on %s:%d: prefill %s, decode %s", host, port, prefill, decode)
    web.run_app(proxy.app(), host=host, port=port, print=None, loop=asyncio.new_event_loop())
