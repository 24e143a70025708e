"""The OpenAI-compatible HTTP server (Starlette on uvicorn) in front of the slot scheduler.

Routes: POST /v1/chat/completions and /v1/completions (streamed as server-sent events or whole),
GET /v1/models, /health and /metrics (Prometheus text). Handlers never touch the device: they
submit to the `Scheduler`, whose model thread sends their events back through an asyncio queue.
A full waiting queue answers 429, a malformed body 400; a client that disconnects (or a stop
string that matches) cancels the request, which frees its slot before the next round.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import uuid

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from specjax.errors import UserError
from specjax.serve import protocol
from specjax.serve.metrics import ServeMetrics
from specjax.serve.scheduler import LoopSink, QueueFull, Scheduler


class TextStream:
  """Incremental detokenization with stop strings: the text of all tokens so far, emitted as
  deltas that never end inside a multi-byte character or a possible stop-string prefix."""

  def __init__(self, tokenizer, stop: list[str]):
    self.tok, self.stop = tokenizer, stop
    self.ids: list[int] = []
    self.sent = ""
    self.stopped = False

  def push(self, ids: list[int]) -> str:
    """The new text after `ids`; sets `stopped` when a stop string appeared (cut before it)."""
    self.ids += ids
    if self.tok is None or self.stopped:
      return ""
    full = self.tok.decode(self.ids)
    for s in self.stop:
      at = full.find(s, max(0, len(self.sent) - len(s)))
      if at >= 0:
        self.stopped, full = True, full[:at]
    hold = 0 if self.stopped else self._held(full)
    out = full[len(self.sent):len(full) - hold]
    self.sent += out
    return out

  def _held(self, full: str) -> int:
    if full.endswith("\ufffd"):
      return len(full) - len(self.sent)
    return max([k for s in self.stop for k in range(1, len(s)) if full.endswith(s[:k])], default=0)

  def flush(self) -> str:
    """Held-back text at the end of generation."""
    full = "" if self.tok is None or self.stopped else self.tok.decode(self.ids)
    out = full[len(self.sent):]
    self.sent += out
    return out


class Server:
  """Holds the scheduler, the tokenizer and the metrics; builds the Starlette app."""

  def __init__(self, scheduler: Scheduler, tokenizer, *, vocab: int, capacity: int, model_name: str,
               metrics: ServeMetrics):
    self.scheduler, self.tokenizer, self.metrics = scheduler, tokenizer, metrics
    self.vocab, self.capacity, self.model_name = vocab, capacity, model_name

  def app(self) -> Starlette:
    routes = [Route("/v1/chat/completions", self.chat, methods=["POST"]),
              Route("/v1/completions", self.completions, methods=["POST"]),
              Route("/v1/models", self.models, methods=["GET"]),
              Route("/health", self.health, methods=["GET"]),
              Route("/metrics", self.metrics_text, methods=["GET"])]
    return Starlette(routes=routes, lifespan=self._lifespan)

  @contextlib.asynccontextmanager
  async def _lifespan(self, app):
    """The model loop runs while the app does."""
    if not self.scheduler.healthy:
      self.scheduler.start()
    yield
    self.scheduler.stop()

  async def health(self, request: Request) -> Response:
    ok = self.scheduler.healthy
    body = {"status": "ok" if ok else "error", "running": self.scheduler.running(),
            "waiting": self.scheduler.queue_length(), "slots": self.scheduler.engine.b}
    if not ok and self.scheduler.error is not None:
      body["error"] = f"{type(self.scheduler.error).__name__}: {self.scheduler.error}"
    return JSONResponse(body, status_code=200 if ok else 503)

  async def metrics_text(self, request: Request) -> Response:
    self.metrics.set_load(self.scheduler.queue_length(), self.scheduler.running())
    # the adaptive controller's host-side state, read when asked for (not on every call of rounds)
    control = self.scheduler.engine.control
    if control is not None and control.costs is not None:
      self.metrics.adaptive(control.record())
    return Response(self.metrics.render(), media_type=self.metrics.content_type)

  async def models(self, request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                     "owned_by": "specjax"}]})

  async def chat(self, request: Request) -> Response:
    return await self._complete(request, chat=True)

  async def completions(self, request: Request) -> Response:
    return await self._complete(request, chat=False)

  def _error(self, code: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    self.metrics.refused(code)
    return JSONResponse(protocol.error_body(message, kind, code), status_code=code)

  async def _complete(self, request: Request, chat: bool) -> Response:
    """Parse, submit, then answer as a stream or as one body."""
    try:
      body = json.loads(await request.body())
      parsed = protocol.parse(body, chat=chat, tokenizer=self.tokenizer, vocab=self.vocab,
                              capacity=self.capacity, max_draft=self.scheduler.engine.max_draft)
    except (ValueError, UserError) as e:       # JSONDecodeError is a ValueError
      return self._error(400, str(e) if isinstance(e, UserError) else f"the body is not valid JSON: {e}")
    if not self.scheduler.healthy:
      return self._error(503, "the model loop is not running", "server_error")
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    try:
      handle = self.scheduler.submit(parsed.gen, LoopSink(loop, queue))
    except QueueFull as e:
      return self._error(429, str(e), "rate_limit_error")
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    model = parsed.model or self.model_name
    if parsed.stream:
      return StreamingResponse(self._sse(handle, queue, parsed, chat, rid, model), media_type="text/event-stream")
    return await self._whole(request, handle, queue, parsed, chat, rid, model)

  async def _events(self, handle, queue: asyncio.Queue, parsed):
    """(text delta, token ids, finish reason or None, usage or None) as the model thread reports
    them; a matched stop string cancels the request and finishes it as "stop"."""
    text = TextStream(self.tokenizer, parsed.stop)
    stopped = False
    while True:
      e = await queue.get()
      if "tokens" in e:
        if stopped:
          continue
        delta = text.push(e["tokens"])
        stopped = text.stopped
        if stopped:
          self.scheduler.cancel(handle)
        yield delta, e["tokens"], None, None
        continue
      if e.get("error"):
        raise RuntimeError(e["error"])
      reason = "stop" if stopped or e["finish_reason"] == "stop" else e["finish_reason"]
      usage = protocol.usage(len(parsed.gen.prompt), handle.n_out, e["usage"])
      yield text.flush(), [], reason, usage
      return

  async def _sse(self, handle, queue, parsed, chat: bool, rid: str, model: str):
    """Server-sent events: one chunk per call of rounds, a final chunk with the finish reason, usage when
    asked (`stream_options.include_usage`), then [DONE]. Leaving early cancels the request."""
    def chunk(choices, usage=None):
      return f"data: {json.dumps(protocol.envelope(chat, rid, model, choices, True, usage))}\n\n"
    try:
      if chat:
        yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
      async for delta, ids, finish, usage in self._events(handle, queue, parsed):
        if delta or ids or finish:
          yield chunk([protocol.choice(chat, delta, ids, finish, delta=True)])
        if finish and parsed.include_usage:
          yield chunk([], usage)
      yield "data: [DONE]\n\n"
    except RuntimeError as e:
      yield f"data: {json.dumps(protocol.error_body(str(e), 'server_error', 500))}\n\n"
    finally:
      if not handle.finished:
        self.scheduler.cancel(handle)     # the client went away: free the slot

  async def _whole(self, request: Request, handle, queue, parsed, chat: bool, rid: str, model: str) -> Response:
    """Collect the whole answer; a client that disconnects meanwhile cancels it (polled each second)."""
    async def watch():
      while not handle.finished:
        await asyncio.sleep(1.0)
        if await request.is_disconnected():
          self.scheduler.cancel(handle)
          return
    watcher = asyncio.create_task(watch())
    text, ids = [], []
    try:
      async for delta, new, finish, usage in self._events(handle, queue, parsed):
        text.append(delta)
        ids += new
        if finish:
          choice = protocol.choice(chat, "".join(text), ids, finish, delta=False)
          return JSONResponse(protocol.envelope(chat, rid, model, [choice], False, usage))
    except RuntimeError as e:
      return self._error(500, str(e), "server_error")
    finally:
      watcher.cancel()
    return Response(status_code=499)


def run_in_thread(app, host: str = "127.0.0.1", port: int = 0):
  """Start uvicorn on a background thread; returns (server, base URL). `server.should_exit = True`
  stops it. Port 0 picks a free port."""
  import socket

  import uvicorn
  sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  sock.bind((host, port))
  server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=30))
  threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
  while not server.started:
    threading.Event().wait(0.02)
  return server, f"http://{host}:{sock.getsockname()[1]}"
