"""The ``tls`` benchmark: stream-memory and ingest over TLS against plaintext, same run,
same server (goal: TLS >= 0.6x plaintext), and logins per second (SCRAM-SHA512, PLAIN).

Rules of this module:
- Each run starts a fresh server with both listeners (``--tls-port`` with a certificate
  made for the run by ``trustme``) and stops it by PID before it returns. The plaintext
  and TLS halves alternate (the order flips every repetition) so machine noise hits both.
- The workers are the usual ones (``worker.py``): the TLS half gives them the
  ``DCP_TLS_CA`` environment variable, which turns the SDK's TLS on, and the TLS port.
  STAT (flush waits) always uses the plaintext port.
- Logins: one server with a users file (``dcpctl user add``'s writer, default iterations);
  ``--clients`` concurrent loops connect, HELLO, authenticate and close for a fixed time
  (SCRAM: the client derives the key, the server only checks HMACs; PLAIN: the server
  derives it, one PBKDF2 per login). Server CPU per login is reported beside the rate.
- Nothing here asserts speed: the goal is evaluated and reported, never enforced.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .procs import OurServer, Profiler, Worker, free_port, wait_persisted
from .scenarios import Ctx, _finish, _scenario

__all__ = ["GOAL_RATIO", "tls"]

#: TLS throughput must be at least this fraction of plaintext (issue #18).
GOAL_RATIO = 0.6
_LOGIN_SECONDS = 3.0
_PASSWORD = "bench-password"


def _certs(directory: Path) -> dict[str, str]:
    import trustme

    directory.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    files = {
        k: str(directory / n) for k, n in (("ca", "ca.pem"), ("cert", "c.pem"), ("key", "k.pem"))
    }
    ca.cert_pem.write_to_path(files["ca"])
    leaf.private_key_pem.write_to_path(files["key"])
    with open(files["cert"], "wb") as f:
        for blob in leaf.cert_chain_pems:
            f.write(blob.bytes())
    return files


@contextlib.contextmanager
def _tls_env(ca: str | None) -> Iterator[None]:
    """Workers started inside see ``DCP_TLS_CA`` (TLS on) when ``ca`` is given."""
    old = os.environ.get("DCP_TLS_CA")
    if ca:
        os.environ["DCP_TLS_CA"] = ca
    else:
        os.environ.pop("DCP_TLS_CA", None)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("DCP_TLS_CA", None)
        else:
            os.environ["DCP_TLS_CA"] = old


def _server(ctx: Ctx, sc: Any, certs: dict[str, str], items: int, **extra: Any) -> OurServer:
    return ctx.server(
        sc,
        tls_port=free_port(),
        tls_cert=certs["cert"],
        tls_key=certs["key"],
        checkpoint_memory_quota=max(256 * 1024 * 1024, items * 1024),
        **extra,
    )


def _memory_run(ctx: Ctx, certs: dict[str, str], items: int, tls: bool) -> dict[str, Any]:
    """As stream-memory: the consumer registers its streams first, the writes go in over
    plaintext, then the consumer drains them from memory, over TLS or not."""
    sc = ctx.scratch()
    srv = _server(ctx, sc, certs, items)
    port = int(srv.extra["tls_port"]) if tls else srv.port
    try:
        with _tls_env(certs["ca"] if tls else None):
            cons = Worker(
                "ours-consumer",
                ctx.wparams(port=port, expect=items, clients=1, mode="memory"),
                ctx.o.log_dir,
            )
        try:
            cons.expect("registered", 120)
            _write(ctx, srv.port, items, None)
            wait_persisted(srv.port, ctx.o.timeout)
            prof = Profiler().start(server=srv.proc.pid, client=cons.proc.pid)
            cpu0 = srv.cpu_split()
            cons.send("go")
            res = cons.expect("result", ctx.o.timeout)
            prof.stop()
        finally:
            cons.close()
        n = sum(res["counts"])
        res.update(count=n, expected=items, rate=items / res["seconds"], tls=tls)
        return _finish(res, srv, cpu0, n)
    finally:
        srv.stop()
        sc.close()


def _write(ctx: Ctx, port: int, items: int, ca: str | None) -> dict[str, Any]:
    with _tls_env(ca):
        w = Worker(
            "ours-writer", ctx.wparams(port=port, items=items, batch=ctx.o.batch), ctx.o.log_dir
        )
    try:
        w.expect("ready", 60)
        w.send("go")
        return w.expect("result", ctx.o.timeout)
    finally:
        w.close()


def _ingest_run(ctx: Ctx, certs: dict[str, str], items: int, tls: bool) -> dict[str, Any]:
    sc = ctx.scratch()
    srv = _server(ctx, sc, certs, items)
    try:
        cpu0 = srv.cpu_split()
        port = int(srv.extra["tls_port"]) if tls else srv.port
        res = _write(ctx, port, items, certs["ca"] if tls else None)
        res.update(expected=items, rate=res["count"] / res["seconds"], tls=tls)
        return _finish(res, srv, cpu0, res["count"])
    finally:
        srv.stop()
        sc.close()


def _login_run(ctx: Ctx, mechanism: str, clients: int) -> dict[str, Any]:
    import trio

    from dcp.consumer import KvClient
    from dcp.producer.users import add_user

    sc = ctx.scratch()
    users = Path(sc.path) / "users.toml"
    add_user(users, "bench", ["all"], _PASSWORD)
    srv = ctx.server(sc, users_file=str(users))
    count = 0

    async def loop(deadline: float) -> None:
        nonlocal count
        while time.perf_counter() < deadline:
            async with KvClient(
                "127.0.0.1",
                srv.port,
                num_vbuckets=ctx.o.vbuckets,
                username="bench",
                password=_PASSWORD,
                mechanism=mechanism,
                tls=False,
            ):
                count += 1

    async def main() -> None:
        deadline = time.perf_counter() + _LOGIN_SECONDS
        async with trio.open_nursery() as nursery:
            for _ in range(clients):
                nursery.start_soon(loop, deadline)

    try:
        cpu0 = srv.cpu_split()
        c0 = time.process_time()
        t0 = time.perf_counter()
        trio.run(main)
        seconds = time.perf_counter() - t0
        res = {
            "count": count,
            "seconds": seconds,
            "rate": count / seconds,
            "client_cpu_s": time.process_time() - c0,
            "mechanism": mechanism,
        }
        res = _finish(res, srv, cpu0, count)
        res["server_cpu_us_per_login"] = res.pop("server_cpu_us_per_item")
        return res
    finally:
        srv.stop()
        sc.close()


def tls(ctx: Ctx) -> dict[str, Any]:
    """The whole ``tls`` result: one row per measurement (see the module rules)."""
    o = ctx.o
    sc = ctx.scratch()
    try:
        certs = _certs(Path(sc.path) / "pki")
        runs: dict[str, dict[bool, list[dict[str, Any]]]] = {
            "memory": {True: [], False: []},
            "ingest": {True: [], False: []},
        }
        for rep in range(o.reps):
            order = [False, True] if rep % 2 == 0 else [True, False]
            for mode in order:
                side = "tls" if mode else "plaintext"
                ctx.step(f"tls: stream-memory {side} rep {rep + 1}/{o.reps}")
                runs["memory"][mode].append(_memory_run(ctx, certs, o.items, mode))
                ctx.step(f"tls: ingest {side} rep {rep + 1}/{o.reps}")
                runs["ingest"][mode].append(_ingest_run(ctx, certs, o.items, mode))
        clients = max(o.clients) if isinstance(o.clients, list) else 4
        logins = {}
        for mech in ("SCRAM-SHA512", "PLAIN"):
            ctx.step(f"tls: {mech} logins")
            logins[mech] = [_login_run(ctx, mech, clients) for _ in range(o.reps)]
    finally:
        sc.close()
    ok = all(r["count"] == r["expected"] for m in runs.values() for rs in m.values() for r in rs)
    params = {"items": o.items, "batch": o.batch, "login_clients": clients}
    plain_name = "plaintext, same server"
    rows = [
        _scenario(
            f"tls {what}",
            metric,
            params,
            runs[key][True],
            runs[key][False],
            plain_name,
            ctx,
            ok,
        )
        for key, what, metric in (
            ("memory", "stream-memory", "mutations/s"),
            ("ingest", "ingest", "writes/s"),
        )
    ]
    for mech, rs in logins.items():
        rows.append(_scenario(f"logins {mech}", "logins/s", params, rs, None, None, ctx, True))
    ratios = {r["name"]: r["ratio"] for r in rows[:2]}
    return {
        "name": "tls",
        "metric": "TLS vs plaintext throughput; logins per second",
        "params": params,
        "rows": rows,
        "ours": rows[0]["ours"],
        "peer": None,
        "peer_name": None,
        "peer_skipped": "no peer: TLS is compared with our own plaintext port",
        "ratio": None,
        "ok": ok,
        "tls_ratios": ratios,
        "login_server_cpu_us": {
            mech: statistics.median(r["server_cpu_us_per_login"] or 0 for r in rs)
            for mech, rs in logins.items()
        },
    }
