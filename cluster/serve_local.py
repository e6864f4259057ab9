"""`brigade serve`, for now: one in-process engine behind a small OpenAI-compatible HTTP API.

A stand-in until the cluster (router + Ray workers) lands; stdlib only. One thread owns the
engine and loops on step(); HTTP handler threads only tokenize and validate (read-only) and
talk to it through queues, so no two threads ever mutate the engine.
"""
from __future__ import annotations

import contextlib
import json
import queue
import signal
import sys
import threading
import time
import traceback
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from cluster.cli import UsageError
from cluster.request_fields import SAMPLING_FIELDS, sampling_params, token_ids
from engine import EngineConfig, InvalidRequest, LLMEngine, RequestOutput, SamplingParams

DRAIN_S = 10.0  # how long SIGTERM waits for in-flight requests before closing anyway


class EngineLoop:
    """Owns the engine: only its thread calls add_request, step and abort."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.inbox: queue.Queue = queue.Queue()  # ("add", rid, ids, params, out) | ("abort", rid, ...)
        self.outboxes: dict[str, queue.Queue] = {}  # loop thread only
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def submit(self, ids: list[int], params: SamplingParams) -> tuple[str, queue.Queue]:
        """Returns the request id and a queue of its RequestOutputs (or one exception)."""
        rid, out = f"cmpl-{uuid.uuid4().hex}", queue.Queue()
        self.inbox.put(("add", rid, ids, params, out))
        return rid, out

    def abort(self, rid: str) -> None:
        self.inbox.put(("abort", rid, None, None, None))

    def _run(self) -> None:
        while not self.stopped.is_set():
            try:
                msg = self.inbox.get(block=not self.engine.has_unfinished(), timeout=0.1)
                while True:
                    self._handle(*msg)
                    msg = self.inbox.get_nowait()
            except queue.Empty:
                pass
            if self.engine.has_unfinished():
                self._step()

    def _handle(self, kind: str, rid: str, ids, params, out) -> None:
        if kind == "add":
            try:
                self.engine.add_request(rid, ids, params)
                self.outboxes[rid] = out
            except Exception as exc:
                out.put(exc)
        elif self.outboxes.pop(rid, None) is not None:
            self.engine.abort(rid)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # fail the in-flight requests rather than hang their clients
            traceback.print_exc()
            for rid, out in self.outboxes.items():
                with contextlib.suppress(Exception):
                    self.engine.abort(rid)
                out.put(exc)
            self.outboxes.clear()
            return
        for o in outputs:
            out = self.outboxes.pop(o.request_id, None) if o.finished else self.outboxes.get(o.request_id)
            if out is not None:
                out.put(o)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr: tuple[str, int], model_name: str):
        super().__init__(addr, Handler)
        self.model_name = model_name
        self.loop: EngineLoop  # set once the model is loaded, before serving starts
        self.draining = False
        self.in_flight = 0
        self.lock = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    server: Server

    def do_GET(self) -> None:
        if self.path == "/health":
            draining = self.server.draining
            self._send(503 if draining else 200, {"status": "draining" if draining else "ok"})
        elif self.path == "/v1/models":
            engine = self.server.loop.engine
            self._send(200, {"object": "list", "data": [{
                "id": self.server.model_name, "object": "model", "owned_by": "brigade",
                "max_model_len": engine.max_model_len}]})
        else:
            self._error(ApiError(404, f"no route GET {self.path}; try /health, /v1/models"))

    def do_POST(self) -> None:
        if self.path != "/v1/completions":
            return self._error(ApiError(404, f"no route POST {self.path}; try POST /v1/completions"))
        with self.server.lock:
            self.server.in_flight += 1
        try:
            self._completion(self._body())
        except ApiError as exc:
            self._error(exc)
        except InvalidRequest as exc:
            self._error(ApiError(400, str(exc), exc.field))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client left before its answer
        except Exception as exc:  # a bug: answer 500 rather than drop the connection
            traceback.print_exc()
            self._error(ApiError(500, f"internal error: {exc}"))
        finally:
            with self.server.lock:
                self.server.in_flight -= 1

    def _body(self) -> dict:
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        return body

    def _completion(self, body: dict) -> None:
        if self.server.draining:
            raise ApiError(503, "server is shutting down; retry on another replica")
        if body.get("model") not in (None, self.server.model_name):
            raise ApiError(404, f"model {body['model']!r} is not served here; see /v1/models", "model")
        if body.get("n", 1) != 1:
            raise ApiError(400, "only n=1 is supported", "n")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if not isinstance(prompt, str):
            prompt = token_ids(prompt, "prompt")
        params = sampling_params(body, SamplingParams(), SAMPLING_FIELDS)
        engine, loop = self.server.loop.engine, self.server.loop
        ids = engine.tokenize(prompt)
        engine.validate(ids, params)
        rid, out = loop.submit(ids, params)
        first = out.get()
        if isinstance(first, Exception):
            raise first if isinstance(first, InvalidRequest) else ApiError(500, f"engine error: {first}")
        created, stream = int(time.time()), bool(body.get("stream"))
        head = {"id": rid, "object": "text_completion", "created": created, "model": self.server.model_name}
        if not stream:
            final = first
            while not final.finished:
                final = self._next(out)
            return self._send(200, {**head, "choices": [_choice(final, final.text)], "usage": _usage(final)})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        try:
            o = first
            while True:
                self._event({**head, "choices": [_choice(o, o.new_text)]})
                if o.finished:
                    break
                o = self._next(out)
            if include_usage:
                self._event({**head, "choices": [], "usage": _usage(o)})
            self.wfile.write(b"data: [DONE]\n\n")
        except ApiError as exc:  # headers are out: report the failure in the stream
            self._event({"error": {"message": str(exc), "type": "server_error", "param": None}})
        except (BrokenPipeError, ConnectionResetError):
            loop.abort(rid)  # the client left: free its KV blocks

    def _next(self, out: queue.Queue) -> RequestOutput:
        item = out.get()
        if isinstance(item, Exception):
            raise ApiError(500, f"engine error: {item}")
        return item

    def _event(self, payload: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
        self.wfile.flush()

    def _send(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, exc: ApiError) -> None:
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        self._send(exc.status, {"error": {"message": str(exc), "type": kind, "param": exc.param}})


def _choice(o: RequestOutput, text: str) -> dict:
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": o.finish_reason}


def _usage(o: RequestOutput) -> dict:
    u = o.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def run(args, config: EngineConfig) -> int:
    try:  # bind before loading the model, so a taken port fails fast
        server = Server((args.host, args.http_port), args.model)
    except OSError as exc:
        raise UsageError(f"cannot listen on {args.host}:{args.http_port}: {exc.strerror or exc}; "
                         "pick another --http-port or --host") from None
    print(f"loading {config.model} ...", file=sys.stderr, flush=True)
    try:
        server.loop = loop = EngineLoop(LLMEngine(config))
    except BaseException:
        server.server_close()
        raise
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    loop.thread.start()
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    host, port = server.server_address[:2]
    print(f"Brigade serving {args.model} at http://{host}:{port}/v1 (Ctrl-C to stop)", flush=True)
    while not stop.wait(0.5):
        pass
    print("shutting down: finishing in-flight requests ...", file=sys.stderr, flush=True)
    server.draining = True
    server.shutdown()
    server.server_close()  # new clients are refused at once; handler threads carry on
    deadline = time.monotonic() + DRAIN_S
    while server.in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    loop.stopped.set()
    return 0
