"""``dcpctl metrics``: fetch the server's Prometheus metrics and show them as a table.

Rules of this module:
- One HTTP/1.1 ``GET /metrics`` over a plain trio socket to ``--metrics-port`` (the
  server's flag of that name; metrics are off unless it was given). The text is parsed
  with ``prometheus_client.parser``; ``--raw`` prints it unchanged.
- HELP/TYPE comments are dropped from the table; ``--grep`` keeps samples whose name
  contains the given text.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import trio
from prometheus_client.parser import text_string_to_metric_families

from .output import CtlError, Output
from .remote import os_error_text

__all__ = ["cmd_metrics", "fetch_metrics"]


async def fetch_metrics(host: str, port: int, timeout: float, path: str = "/metrics") -> str:
    where = f"{host}:{port}"
    try:
        with trio.fail_after(timeout):
            stream = await trio.open_tcp_stream(host, port)
            async with stream:
                await stream.send_all(
                    f"GET {path} HTTP/1.1\r\nHost: {where}\r\nConnection: close\r\n\r\n".encode()
                )
                data = b""
                while chunk := await stream.receive_some(1 << 16):
                    data += chunk
    except trio.TooSlowError:
        raise CtlError(f"metrics endpoint {where} did not answer within {timeout:g} s") from None
    except (OSError, trio.BrokenResourceError) as exc:
        raise CtlError(f"cannot fetch metrics from {where}: {os_error_text(exc)}") from None
    head, _, body = data.partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0].decode("latin-1")
    if " 200 " not in status + " ":
        raise CtlError(f"metrics endpoint {where}{path} answered {status or 'nothing'!r}")
    return body.decode("utf-8", "replace")


def _samples(text: str) -> list[dict[str, Any]]:
    out = []
    try:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                value: Any = s.value
                if float(value).is_integer():
                    value = int(value)
                out.append({"name": s.name, "labels": dict(s.labels), "value": value})
    except ValueError as exc:
        raise CtlError(f"the metrics endpoint sent unparsable text: {exc}") from None
    return out


async def cmd_metrics(args: argparse.Namespace, out: Output) -> int:
    if not args.metrics_port:
        raise CtlError(
            "give --metrics-port: the port the server was started with "
            "(--metrics-port; metrics are off by default)",
            2,
        )
    text = await fetch_metrics(args.host, args.metrics_port, args.timeout)
    if args.raw:
        sys.stdout.write(text)
        return 0
    samples = [s for s in _samples(text) if not args.grep or args.grep in s["name"]]
    if out.json_mode:
        out.json({"metrics": samples})
        return 0
    out.table(
        f"metrics from {args.host}:{args.metrics_port}",
        ["metric", "labels", "value"],
        [
            [s["name"], ",".join(f"{k}={v}" for k, v in s["labels"].items()), s["value"]]
            for s in samples
        ],
        numeric=["value"],
    )
    return 0
