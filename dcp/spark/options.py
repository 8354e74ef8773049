"""Reader options: parsed and validated once, into a small picklable ``SourceConfig``.

Rules of this module:
- Spark hands options over as strings in a case-insensitive map; names are matched
  case-insensitively here too, and an unknown option is an error (a typo must not be
  silently ignored).
- Validation happens when the reader is built (query start), with a message naming the
  option, never later inside an executor.
- ``SourceConfig`` holds plain values only: it travels to planner and executor processes
  by pickle.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import OptionError

__all__ = ["OPTIONS", "SourceConfig", "parse_options", "parse_vbuckets"]

#: Every option the source understands (lower-case name -> one-line help).
OPTIONS = {
    "host": "server address (default 127.0.0.1)",
    "port": "server port (default 11210)",
    "vbuckets": "vbuckets to read: 'all' (default) or a list like '0,4,8-15'",
    "startingoffsets": "stream start: 'earliest' (default), 'latest' or offsets as JSON",
    "startingoffsetsfile": "file that keeps the resolved starting offsets (required for "
    "'latest'); written once, atomically, then always read back",
    "maxrowsperbatch": "upper bound of rows (seqnos) per micro-batch, cut on snapshot "
    "boundaries; at least one snapshot per batch (default: no bound)",
    "maxrowspermicrobatch": "alias of maxRowsPerBatch",
    "numpartitions": "Spark partitions (tasks) per batch; vbuckets are spread over them "
    "(default: CPU count of the driver)",
    "onrollback": "'fail' (default): stop the query on a rollback; 'rewind': emit an "
    "op='rollback' row and continue from the rollback seqno",
    "onmergedsnapshot": "'fail' (default for streams) or 'reread' (default for batch reads):"
    " what to do when a planned range can no longer be served exactly",
    "timeout": "socket timeout in seconds (default 30)",
    "retrytimeout": "seconds an executor keeps retrying a lost connection (default 30)",
    "plancachems": "how long the driver reuses the server's high seqnos (default 250)",
    "arrowbatchrows": "rows per Arrow record batch handed to Spark (default 65536)",
}

_ALIASES = {"maxrowspermicrobatch": "maxrowsperbatch"}


@dataclass(frozen=True, slots=True)
class SourceConfig:
    host: str = "127.0.0.1"
    port: int = 11210
    vbuckets: tuple[int, ...] | None = None  # None = every vbucket the server has
    starting_offsets: str = "earliest"  # 'earliest', 'latest' or JSON text
    starting_offsets_file: str | None = None
    max_rows_per_batch: int | None = None
    num_partitions: int = 0  # 0 = CPU count
    on_rollback: str = "fail"
    on_merged_snapshot: str = "fail"
    timeout: float = 30.0
    retry_timeout: float = 30.0
    plan_cache_seconds: float = 0.25
    arrow_batch_rows: int = 65536

    @property
    def partitions(self) -> int:
        return self.num_partitions or max(1, os.cpu_count() or 1)


def parse_vbuckets(text: str) -> tuple[int, ...] | None:
    """'all' -> None; '0,2,8-11' -> (0, 2, 8, 9, 10, 11)."""
    text = text.strip()
    if text.lower() in ("", "all", "*"):
        return None
    out: set[int] = set()
    try:
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if lo > hi:
                    raise ValueError(f"{lo} > {hi}")
                out.update(range(lo, hi + 1))
            else:
                out.add(int(part))
    except ValueError as exc:
        raise OptionError(
            f"option vbuckets={text!r}: expected 'all' or a list like '0,4,8-15' ({exc})"
        ) from exc
    if not out or min(out) < 0 or max(out) > 0xFFFF:
        raise OptionError(f"option vbuckets={text!r}: vbuckets must be 0..65535")
    return tuple(sorted(out))


def _int(name: str, raw: str, lo: int, hi: int | None = None) -> int:
    try:
        v = int(raw.strip())
    except ValueError:
        raise OptionError(f"option {name}={raw!r}: expected an integer") from None
    if v < lo or (hi is not None and v > hi):
        bound = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
        raise OptionError(f"option {name}={raw!r}: must be {bound}")
    return v


def _float(name: str, raw: str, lo: float) -> float:
    try:
        v = float(raw.strip())
    except ValueError:
        raise OptionError(f"option {name}={raw!r}: expected a number") from None
    if not v >= lo:
        raise OptionError(f"option {name}={raw!r}: must be >= {lo}")
    return v


def _choice(name: str, raw: str, choices: tuple[str, ...]) -> str:
    v = raw.strip().lower()
    if v not in choices:
        raise OptionError(f"option {name}={raw!r}: expected one of {', '.join(choices)}")
    return v


def parse_options(options: Mapping[str, str], *, streaming: bool) -> SourceConfig:
    """Validate Spark's option map into a ``SourceConfig``.

    ``streaming`` picks the defaults that differ: a batch read re-reads merged snapshots
    by default (it has no replay contract), a stream fails on them.
    """
    opts: dict[str, str] = {}
    for k, v in options.items():
        key = _ALIASES.get(k.lower(), k.lower())
        if key not in OPTIONS:
            raise OptionError(
                f"unknown option {k!r}; known options: "
                f"{', '.join(sorted(n for n in OPTIONS if n not in _ALIASES))}"
            )
        if v is None:
            continue
        opts[key] = str(v)
    kw: dict[str, object] = {"on_merged_snapshot": "fail" if streaming else "reread"}
    if "host" in opts:
        if not opts["host"].strip():
            raise OptionError("option host must not be empty")
        kw["host"] = opts["host"].strip()
    if "port" in opts:
        kw["port"] = _int("port", opts["port"], 1, 65535)
    if "vbuckets" in opts:
        kw["vbuckets"] = parse_vbuckets(opts["vbuckets"])
    if "startingoffsets" in opts:
        so = opts["startingoffsets"].strip()
        if so.lower() in ("earliest", "latest"):
            so = so.lower()
        elif not so.startswith("{"):
            raise OptionError(
                f"option startingOffsets={so!r}: expected 'earliest', 'latest' or a JSON object"
            )
        kw["starting_offsets"] = so
    if "startingoffsetsfile" in opts:
        kw["starting_offsets_file"] = opts["startingoffsetsfile"].strip() or None
    if kw.get("starting_offsets") == "latest" and not kw.get("starting_offsets_file"):
        raise OptionError(
            "startingOffsets=latest needs option startingOffsetsFile: 'latest' is resolved "
            "once and must read back identically after a restart, and Spark does not tell a "
            "Python source its checkpoint location. Give a path (e.g. inside the checkpoint "
            "directory) where the resolved offsets are kept."
        )
    if "maxrowsperbatch" in opts:
        kw["max_rows_per_batch"] = _int("maxRowsPerBatch", opts["maxrowsperbatch"], 1)
    if "numpartitions" in opts:
        kw["num_partitions"] = _int("numPartitions", opts["numpartitions"], 1, 100_000)
    if "onrollback" in opts:
        kw["on_rollback"] = _choice("onRollback", opts["onrollback"], ("fail", "rewind"))
    if "onmergedsnapshot" in opts:
        kw["on_merged_snapshot"] = _choice(
            "onMergedSnapshot", opts["onmergedsnapshot"], ("fail", "reread")
        )
    if "timeout" in opts:
        kw["timeout"] = _float("timeout", opts["timeout"], 0.1)
    if "retrytimeout" in opts:
        kw["retry_timeout"] = _float("retryTimeout", opts["retrytimeout"], 0.0)
    if "plancachems" in opts:
        kw["plan_cache_seconds"] = _int("planCacheMs", opts["plancachems"], 0) / 1000.0
    if "arrowbatchrows" in opts:
        kw["arrow_batch_rows"] = _int("arrowBatchRows", opts["arrowbatchrows"], 1)
    return SourceConfig(**kw)  # type: ignore[arg-type]
