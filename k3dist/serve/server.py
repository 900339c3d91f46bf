"""run.mode=serve on rank 0: the listening socket (bound before the load, so a taken port is refused up front),
uvicorn in a thread of its own, the engine loop in the main thread, and the end: drained after a signal (exit
128 + signal), or failed loudly with every request answered first."""

import importlib.util
import logging
import socket
import sys
import threading
import time
from dataclasses import dataclass

from ..base import dist, signals, store
from ..base.errors import K3Error
from ..base.failures import after_load

log = logging.getLogger("k3dist")


@dataclass(frozen=True)
class Sockets:
    """What rank 0 binds before the load: the HTTP socket, and the KV-event publisher's when serve.kv_events asks."""

    http: socket.socket
    events: object | None = None  # serve/kv_events.py's KVEvents


def listen(serve) -> Sockets:
    """The server's socket at serve.host and serve.port, bound and listening (port 0: a free one), once the serve
    extra is known to be there; with serve.kv_events, the KV-event publisher's socket too."""
    host, port, kv_events = serve.host, serve.port, serve.kv_events
    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        raise K3Error(f"run.mode=serve needs the serve extra (pip install 'k3dist[serve]'): no {', '.join(missing)}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, _, _, _, address = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        raise K3Error(f"serve.host={host} serve.port={port}: cannot listen there ({exc.strerror or exc})") from None
    sock.set_inheritable(False)
    if kv_events is None:
        return Sockets(sock)
    from .kv_events import KVEvents  # the events extra: imported only when asked for

    try:
        return Sockets(sock, KVEvents(kv_events))
    except K3Error:
        sock.close()
        raise


def serve(s, rt: dist.Runtime, engine, *, text, cfg, sock: Sockets, model_dir, pids: list[int]) -> dict:
    """Serve until a signal ends the drain (the process exits here with 128 + signal) or a failure is raised.
    `sock`: what `listen` bound; `pids`: every rank's process id, named in the ready line (which process is which
    rank)."""
    import uvicorn  # the serve extra: imported only by a server

    from .app import Front, build_app
    from .loop import EngineLoop
    from .metrics import Metrics
    from .response_store import ResponseStore
    from .worker_info import WorkerInfo

    name = s.serve.model_name or model_dir.name
    metrics = Metrics(s.generate.batch)
    events = sock.events
    if events is not None:
        events.attach(engine.prefix, s.prefix.every)
    loop = EngineLoop(engine, metrics, s.serve.max_waiting, s.serve.drain_s, kv_events=events)
    front = Front(
        loop,
        text,
        model_name=name,
        cap=s.cache.cap,
        vocab=cfg.vocab_size,
        api_key=s.serve.api_key,
        max_body=s.serve.max_body,
        unknown_fields=s.serve.unknown_fields,
        faults=s.fault,
        store=ResponseStore(s.serve.store_responses, s.serve.store_bytes),
        worker=WorkerInfo.of(model_dir, name, world=rt.world, cap=s.cache.cap, slots=s.generate.batch),
    )
    config = uvicorn.Config(build_app(front), log_level="warning", access_log=False, lifespan="off", log_config=None)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock.http]}, name="k3dist-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise K3Error(f"rank 0: the HTTP server did not start on {s.serve.host}:{s.serve.port}")
        time.sleep(0.01)
    signals.defer(loop.drain)
    if rt.world > 1:  # a follower signalled alone asks for the drain through the rendezvous store
        store.on_drain_asked(loop.drain)
    host, port = sock.http.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host  # an IPv6 address is bracketed in a URL
    print(
        f"k3dist: serving {name!r} at http://{host}:{port}/v1 (world {rt.world}, {s.generate.batch} slots of "
        f"{s.cache.cap} tokens; rank pids {' '.join(map(str, pids))})",
        file=sys.stderr,
        flush=True,
    )
    if events is not None:
        print(f"k3dist: KV events at {events.bound} (blocks of {s.prefix.every} tokens)", file=sys.stderr, flush=True)
    try:
        code = after_load(lambda: engine.runner.stage, rt, loop.run)
    except K3Error:
        loop.flushed()  # every request in flight has its error before the process ends
        raise
    loop.flushed()  # every answer sent, then uvicorn closes its connections
    server.should_exit = True
    thread.join(timeout=3)
    if events is not None:
        events.close()
    signals.end(code - 128)  # the one line (where this process speaks for the run), exit 128 + signal
    return {}  # pragma: no cover - end() does not return
