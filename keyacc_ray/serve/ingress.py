"""The OpenAI-compatible HTTP ingress (FastAPI): parses and validates, tokenizes, streams
server-sent events, formats errors in OpenAI's shape, and serves /v1/models, /health and
/metrics. Each request is walked through its hops by a `RequestDriver` (the router decides, the
pools' token streams come straight here). KV never passes through here: hand-offs carry only a
reference to it, from one pool to the next."""

import asyncio
import hmac
import json
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from ray import serve

import keyacc_ray
from keyacc_ray.config import env_api_keys, env_operator_keys
from keyacc_ray.errors import InvalidRequest, KeyaccError
from keyacc_ray.serve import metrics as prom
from keyacc_ray.serve import protocol, tools
from keyacc_ray.serve.aio import wait_at_most
from keyacc_ray.serve.heap import freeze_startup_heap
from keyacc_ray.serve.driver import RemoteRouter, RequestDriver
from keyacc_ray.serve.mux import MuxClient
from keyacc_ray.serve.messages import ErrorItem, TokenChunk, Trace

log = logging.getLogger("ray.serve")
METRICS_ROUTER_TIMEOUT_S = 2.0
app = FastAPI(title="keyacc-ray", docs_url=None, redoc_url=None)


def error_response(status: int, body: dict, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(body, status_code=status, headers=headers)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException):
    """Unknown paths and methods get OpenAI-shaped errors too (registered before serve.ingress
    captures the app)."""
    return error_response(exc.status_code, {"error": {"message": str(exc.detail), "type": "invalid_request_error",
                                                      "param": None, "code": None}})


def _retry_after(status: int) -> dict | None:
    return {"Retry-After": "1"} if status in (429, 503) else None


async def _first(it) -> list:
    try:
        return await it.__anext__()
    except StopAsyncIteration:
        return []


async def _close(its) -> None:
    """Stop every choice's driver (its pool aborts the sequence)."""
    for it in its:
        await it.aclose()


async def _merged(firsts: list[list], its: list):
    """(choice index, item) of every choice's stream as they come, each choice's in order.
    Closing this closes every stream still going (their pools abort the sequences)."""
    if len(its) == 1:  # the common case: no task, no queue
        try:
            for i in firsts[0]:
                yield 0, i
            async for batch in its[0]:
                for i in batch:
                    yield 0, i
        finally:
            await its[0].aclose()
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(k: int, it) -> None:
        try:
            async for batch in it:
                q.put_nowait((k, batch))
            q.put_nowait((k, None))
        except Exception as e:  # noqa: BLE001 - raised where the response is made
            q.put_nowait((k, e))

    for k, first in enumerate(firsts):
        q.put_nowait((k, first))
    tasks = [asyncio.get_running_loop().create_task(pump(k, it)) for k, it in enumerate(its)]
    try:
        live = len(its)
        while live:
            k, batch = await q.get()
            if batch is None:
                live -= 1
            elif isinstance(batch, Exception):
                raise batch
            else:
                for i in batch:
                    yield k, i
    finally:  # cancelled, each stream's driver stops its hop (the generators are busy in the tasks)
        for t in tasks:
            t.cancel()


def _sse(obj) -> str:
    # ASCII-escaped JSON: raw U+2028, U+0085, \x1c... are legal inside JSON strings but are line
    # breaks to many SSE line splitters (httpx's aiter_lines among them), which would cut an event.
    return f"data: {json.dumps(obj)}\n\n"


@serve.ingress(app)  # FastAPI routing only; serve.deployment(...) is applied in app.py
class Ingress:
    def __init__(self, router, pools: dict, model: str, served_model_name: str, max_model_len: int,
                 allow_route_pinning: bool | str = True, max_body_bytes: int = 1 << 20,
                 api_keys_file: str | None = None, operator_keys_file: str | None = None,
                 trust_remote_code: bool = False, generation_config: str = "auto",
                 tool_call_parser: str | None = "hermes", stream_mux: bool = True,
                 pool_replicas: dict | None = None):
        """router: the Router deployment's handle; pools: the pool handles by hop key
        ("gpu_prefill", "gpu_decode", "cpu_decode/0", ...); pool_replicas: how many replicas
        each has (1 where not said)."""
        from transformers import AutoTokenizer

        self.router = router
        mux = None
        if stream_mux:  # one token stream per pool replica it sends hops to (serve/mux.py)
            def subscribe(hop: str, sub):
                return pools[hop].options(stream=True, _by_reference=False).subscribe.remote(sub)

            async def ack(hop: str, a):
                return await pools[hop].options(_by_reference=False).mux_ack.remote(a)

            mux = MuxClient(f"ingress-{uuid.uuid4().hex[:12]}", subscribe, ack)
        self.driver = RequestDriver(RemoteRouter(router), pools, mux, pool_replicas)
        self.tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)
        self.vocab_size = len(self.tokenizer)  # once: transformers rebuilds the vocabulary to count it
        self.sampling_defaults = protocol.generation_defaults(model) if generation_config == "auto" else {}
        if self.sampling_defaults:
            log.warning("keyacc ingress: default sampling parameters from the model's generation_config.json: %s "
                        "(generation_config: vllm for neutral ones)", self.sampling_defaults)
        self.model_name = served_model_name
        self.tool_call_parser = tool_call_parser
        self.prom = prom.Metrics(served_model_name, f"ingress-{uuid.uuid4().hex[:8]}")
        self._pusher: asyncio.Task | None = None  # ships this replica's request figures to the monitor
        self.max_model_len = max_model_len
        self.allow_pinning = allow_route_pinning
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())
        self._ignored_seen: set[str] = set()  # request fields already warned about
        self.operator_keys = env_operator_keys(operator_keys_file)
        self.api_keys = env_api_keys(api_keys_file) | self.operator_keys
        log.info("keyacc ingress: %s; route pinning: %s", "API keys required" if self.api_keys else
                 "no API keys (open)", allow_route_pinning)
        freeze_startup_heap("ingress")

    def _key(self, request: Request) -> str | None:
        auth = request.headers.get("authorization", "")
        return auth[7:].strip() if auth[:7].lower() == "bearer " else None

    @staticmethod
    def _known(key: str | None, keys: frozenset[str]) -> bool:
        return key is not None and any(hmac.compare_digest(key.encode(), k.encode()) for k in keys)

    def _auth_error(self, request: Request):
        """401 unless the request carries a valid key (when keys are configured)."""
        if self.api_keys and not self._known(self._key(request), self.api_keys):
            self._count("errors_401")
            return error_response(401, {"error": {"message": "invalid or missing API key (Authorization: Bearer ...)",
                                                  "type": "invalid_request_error", "param": None,
                                                  "code": "invalid_api_key"}})
        return None

    def _may_pin(self, request: Request) -> bool:
        if self.allow_pinning == "operators":
            return self._known(self._key(request), self.operator_keys)
        return bool(self.allow_pinning)

    def _count(self, key: str) -> None:
        self.prom.count_http(key)

    def _ensure_pusher(self) -> None:
        if self._pusher is None or self._pusher.done():
            self._pusher = asyncio.get_running_loop().create_task(self._push_loop())

    async def _push_loop(self) -> None:
        """Every INGRESS_REPORT_S, this replica's cumulative request figures to the load monitor
        (fire and forget): any ingress replica's /metrics then shows every replica's requests."""
        import ray

        from keyacc_ray.serve.monitor import MONITOR_NAME, MONITOR_NAMESPACE

        monitor, sent, sent_at = None, None, 0.0
        while True:
            await asyncio.sleep(prom.INGRESS_REPORT_S)
            stats, now = self.prom.local.to_dict(), time.monotonic()
            if stats == sent and now - sent_at < prom.INGRESS_HEARTBEAT_S:
                continue  # nothing new (an idle server sends next to nothing)
            try:
                monitor = monitor or ray.get_actor(MONITOR_NAME, namespace=MONITOR_NAMESPACE)
                monitor.report_ingress.remote(self.prom.replica, stats)
                sent, sent_at = stats, now
            except Exception:  # noqa: BLE001 - the monitor restarting: next time
                monitor = None

    # ---- endpoints ---------------------------------------------------------------------
    @app.get("/health")
    async def health(self):
        return {"status": "ok"}

    @app.get("/version")
    async def version(self):
        """As vLLM's server: the serving software's version (no key needed, as /health)."""
        return {"version": keyacc_ray.__version__}

    @app.get("/v1/models")
    async def models(self, request: Request):
        if (err := self._auth_error(request)) is not None:
            return err
        return {"object": "list", "data": [self._model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, request: Request):
        """OpenAI's retrieve-model (`client.models.retrieve(id)`)."""
        if (err := self._auth_error(request)) is not None:
            return err
        if model_id != self.model_name:
            return error_response(404, {"error": {"message": f"the model '{model_id}' does not exist",
                                                  "type": "invalid_request_error", "param": "model",
                                                  "code": "model_not_found"}})
        return self._model_card()

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "keyacc-ray",
                "max_model_len": self.max_model_len}

    @app.get("/metrics")
    async def metrics(self, request: Request):
        if (err := self._auth_error(request)) is not None:
            return err
        try:  # the router down or slow: what this replica has (its last snapshot, its own series)
            snap = await wait_at_most(self.router.snapshot_dict.remote(), METRICS_ROUTER_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - any failure of the router's answer
            snap = None
        self._ensure_pusher()
        return PlainTextResponse(self.prom.render(snap), media_type=prom.CONTENT_TYPE)

    @app.get("/keyacc/requests")
    async def requests_in_flight(self, request: Request):
        """For operators: the oldest requests the router counts, with where each is (a hop, or
        `held` at the router) and for how long: which one a growing
        `keyacc_oldest_request_age_seconds` is. An operator key where operator keys are set."""
        if (err := self._auth_error(request)) is not None:
            return err
        if self.operator_keys and not self._known(self._key(request), self.operator_keys):
            self._count("errors_403")
            return error_response(403, {"error": {"message": "this endpoint needs an operator key",
                                                  "type": "permission_error", "param": None, "code": None}})
        raw = request.query_params.get("limit", "50")
        if not raw.isdigit() or not 1 <= int(raw) <= 1000:
            self._count("errors_400")
            return error_response(400, InvalidRequest(f"'limit' must be an integer in [1, 1000], got {raw!r}",
                                                      param="limit").to_dict())
        try:
            rows = await wait_at_most(self.router.requests_in_flight.remote(int(raw)), METRICS_ROUTER_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - the router down or slow
            return error_response(503, {"error": {"message": f"the router did not answer: {e.__class__.__name__}",
                                                  "type": "unavailable", "param": None, "code": None}},
                                  {"Retry-After": "1"})
        return {"object": "list", "data": rows}

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._handle(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat(self, request: Request):
        return await self._handle(request, "chat")

    # vLLM's tokenizer endpoints: tokenize as this server does, without the model's files
    @app.post("/tokenize")
    async def tokenize(self, request: Request):
        return await self._tokenizer_call(request, lambda d: protocol.tokenize(
            d, tokenizer=self.tokenizer, served_names={self.model_name}, max_model_len=self.max_model_len))

    @app.post("/detokenize")
    async def detokenize(self, request: Request):
        return await self._tokenizer_call(request, lambda d: protocol.detokenize(
            d, tokenizer=self.tokenizer, served_names={self.model_name}, vocab_size=self.vocab_size))

    @app.get("/tokenizer_info")
    async def tokenizer_info(self, request: Request):
        if (err := self._auth_error(request)) is not None:
            return err
        return protocol.tokenizer_info(self.tokenizer, self.vocab_size)

    async def _tokenizer_call(self, request: Request, call):
        if (err := self._auth_error(request)) is not None:
            return err
        try:
            return call(protocol.load_json(await request.body(), self.max_body_bytes))
        except KeyaccError as e:
            self._count(f"errors_{e.status_code}")
            return error_response(e.status_code, e.to_dict())

    def _warn_ignored(self, data: dict) -> None:
        """vLLM's treatment of fields it does not know: a warning naming them (here once per field
        name per replica, so a client that always sends one does not flood the log)."""
        new = sorted({k[:64] for k in protocol.ignored_fields(data)} - self._ignored_seen)
        if new and len(self._ignored_seen) < 1024:
            self._ignored_seen.update(new)
            log.warning("these request fields are not used by this server and were ignored: %s", new)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    # ---- the request path --------------------------------------------------------------
    async def _handle(self, request: Request, kind: str):
        self._ensure_pusher()
        self._count(f"{kind}_requests")
        if (err := self._auth_error(request)) is not None:
            return err
        try:
            body = await request.body()
            data = protocol.load_json(body, self.max_body_bytes)
            p = protocol.parse(data, kind, tokenizer=self.tokenizer, served_names={self.model_name},
                               max_model_len=self.max_model_len, allow_pinning=self._may_pin(request),
                               vocab_size=self.vocab_size, defaults=self.sampling_defaults,
                               tool_parser=self.tool_call_parser,
                               request_id=protocol.client_request_id(request.headers.get("x-request-id")))
        except KeyaccError as e:
            self._count(f"errors_{e.status_code}")
            return error_response(e.status_code, e.to_dict())
        except (TypeError, ValueError, OverflowError) as e:
            err = InvalidRequest(f"invalid request: {e}")
            return error_response(400, err.to_dict())
        self._warn_ignored(data)
        timer = prom.RequestTimer(self.prom, len(p.requests))
        its = [self.driver.run(r).__aiter__() for r in p.requests]
        # Wait for every choice's first tokens before answering, so an error found downstream
        # still gets a proper status code instead of a 200 stream.
        try:
            if len(its) == 1:
                firsts = [await _first(its[0])]
            else:  # every choice's first batch; all of them settled before any is closed
                firsts = await asyncio.gather(*map(_first, its), return_exceptions=True)
                if bad := next((f for f in firsts if isinstance(f, BaseException)), None):
                    raise bad
        except Exception as e:  # noqa: BLE001 - a bug in the request path: this request only
            log.exception("request %s failed", p.response_id)
            await _close(its)
            return error_response(503, {"error": {"message": f"service unavailable: {e.__class__.__name__}",
                                                  "type": "unavailable", "param": None, "code": None}},
                                  {"Retry-After": "1"})
        for first in firsts:
            errs = [i for i in first if isinstance(i, ErrorItem)]
            if errs and not any(isinstance(i, TokenChunk) for i in first):
                await _close(its)
                self._count(f"errors_{errs[0].status_code}")
                return error_response(errs[0].status_code, errs[0].body, _retry_after(errs[0].status_code))
        items = _merged(firsts, its)
        # (Serve's proxy echoes the X-Request-Id header in the response, as vLLM does)
        if p.stream:
            return StreamingResponse(self._sse_stream(p, items, timer), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._collect(p, items, timer)

    async def _collect(self, p, items, timer):
        n = len(p.requests)
        text, ids, lp_ids = [[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)]
        reason, n_out, traces = [None] * n, [0] * n, [{} for _ in range(n)]
        lps = [[] for _ in range(n)] if p.request.params.get("logprobs") is not None else None
        prompt_lps: list = [None] * n  # each choice's prompt scores, from its first chunk
        seen, cached = [False] * n, [0] * n
        async for k, i in items:
            if isinstance(i, TokenChunk):
                if not seen[k]:
                    prompt_lps[k] = i.prompt_logprobs
                    cached[k] = i.num_cached_tokens  # (the first hop's: where the prompt was prefilled)
                timer.tokens(k, len(i.token_ids))
                t, covered, entries, generated = protocol.as_sent(p, k, i, not seen[k])
                seen[k] = True
                text[k].append(t)
                ids[k].extend(generated)
                lp_ids[k].extend(covered)
                if lps is not None:
                    lps[k].extend(entries)
                n_out[k] = 0 if p.echo_only else i.num_output_tokens or n_out[k]
                reason[k] = i.finish_reason or reason[k]
            elif isinstance(i, ErrorItem):
                await items.aclose()
                return error_response(i.status_code, i.body, _retry_after(i.status_code))
            elif isinstance(i, Trace):
                traces[k] = i.to_dict()
                timer.finish(k, traces[k], reason[k], n_out[k])
        timer.prompt(p.num_prompt_tokens, p.n, p.request.params.get("max_tokens"))
        calls: list = [None] * n
        if p.tools is not None:  # the calls in each choice's output; what is left is its content
            for k in range(n):
                out = tools.ToolOutput(p.tools)
                head, _ = out.feed("".join(text[k]))
                tail, _ = out.finish()
                text[k], calls[k], reason[k] = [head + tail], out.calls, out.finish_reason(reason[k])
        choices = [protocol.choice_body(p, k, "".join(text[k]), reason[k], ids[k],
                                        protocol.logprobs_body(p.kind, lp_ids[k], lps[k] if lps else None,
                                                               self._token_text), delta=False, tool_calls=calls[k])
                   for k in range(n)]
        body = protocol.full_body(p, choices, sum(n_out), traces, protocol.cached_tokens(p, cached))
        if p.prompt_logprobs is not None:  # vLLM: per choice in completions, once per response in chat
            scored = [protocol.prompt_logprobs_body(p, k, prompt_lps[k], self._token_text) for k in range(n)]
            if p.kind == "chat":
                body["prompt_logprobs"] = scored[0]
            else:
                for choice, s in zip(body["choices"], scored):
                    choice["prompt_logprobs"] = s
        return body

    async def _sse_stream(self, p, items, timer):
        created = int(time.time())
        n = len(p.requests)
        n_out, reason, cached = [0] * n, [None] * n, [0] * n
        def usage_so_far(body: dict, k: int) -> dict:  # vLLM's continuous_usage_stats: the choice's count so far
            if p.continuous_usage:
                body["usage"] = protocol.usage(p.num_prompt_tokens, n_out[k], cached[k])
            return body

        if p.kind == "chat":
            for k in range(n):
                head = protocol.chunk_body(p, created, "", None, index=k)
                head["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                yield _sse(usage_so_far(head, k))
        pending = [None] * n  # only a choice's finishing chunk waits, so its trace can ride on it
        offset, seen = [0] * n, [False] * n
        outs = [tools.ToolOutput(p.tools) for _ in range(n)] if p.tools is not None else None
        # chunks of nothing but text (and token ids where asked): their events made from those alone
        plain = (outs is None and not p.continuous_usage and not p.echo_only
                 and all(r.params.get("logprobs") is None for r in p.requests))
        text_event = [protocol.sse_text_event(p, created, k) for k in range(n)] if plain else None
        async for k, i in items:
            if isinstance(i, TokenChunk):
                timer.tokens(k, len(i.token_ids))
                n_out[k] = 0 if p.echo_only else i.num_output_tokens or n_out[k]
                reason[k] = i.finish_reason or reason[k]
                if text_event is not None and seen[k] and i.finish_reason is None:
                    event = text_event[k](i.text, i.token_ids)
                    if event is not None:
                        yield event
                        continue
                if not seen[k]:
                    cached[k] = i.num_cached_tokens  # (the first hop's: where the prompt was prefilled)
                text, covered, entries, generated = protocol.as_sent(p, k, i, not seen[k])
                seen[k] = True
                calls = None
                if outs is not None:  # tool calls read from the text as it comes
                    text, calls = outs[k].stream(text, i.finish_reason is not None)
                    reason[k] = outs[k].finish_reason(reason[k])
                lps = protocol.logprobs_body(p.kind, covered, entries, self._token_text, offset[k])
                if lps is not None and p.kind != "chat" and lps["tokens"]:
                    offset[k] = lps["text_offset"][-1] + len(lps["tokens"][-1])
                body = usage_so_far(protocol.chunk_body(p, created, text, i.finish_reason and reason[k], generated,
                                                        lps, k, calls), k)
                if i.finish_reason is None:
                    yield _sse(body)
                else:
                    pending[k] = body
            elif isinstance(i, ErrorItem):
                for body in filter(None, pending):
                    yield _sse(body)
                yield _sse(i.body)
                yield "data: [DONE]\n\n"
                await items.aclose()
                return
            elif isinstance(i, Trace):  # a choice's last item
                body = pending[k] or protocol.chunk_body(p, created, "", reason[k], [], index=k)
                pending[k] = None
                body["keyacc"] = i.to_dict()
                timer.finish(k, body["keyacc"], reason[k], n_out[k])
                if p.include_usage:
                    body["usage"] = None
                usage_so_far(body, k)
                yield _sse(body)
        for body in filter(None, pending):
            yield _sse(body)
        timer.prompt(p.num_prompt_tokens, p.n, p.request.params.get("max_tokens"))
        if p.include_usage:
            body = protocol.chunk_body(p, created, "", None)
            body["choices"] = []
            body["usage"] = protocol.usage(p.num_prompt_tokens, sum(n_out), protocol.cached_tokens(p, cached))
            yield _sse(body)
        yield "data: [DONE]\n\n"
