"""Reader options: parsed and validated once, into a small picklable ``SourceConfig``.

Rules of this module:
- Spark hands options over as strings in a case-insensitive map; names are matched
  case-insensitively here too, and an unknown option is an error (a typo must not be
  silently ignored) that suggests the nearest known names.
- Kafka's option names are accepted where they mean the same thing (``_ALIASES``;
  ``failOnDataLoss`` maps onto ``onRollback``), so a Kafka query ports with few edits.
- Validation happens at ``load()`` (``DcpDataSource.schema``, mode-neutral) and again
  when the batch or stream reader is built (the options of the other mode are refused
  there), with a message naming the option, never later inside an executor.
- ``SourceConfig`` holds plain values only: it travels to planner and executor processes
  by pickle. Credentials and TLS settings are resolved here too (``security.py``,
  environment fallbacks included); the password never appears in a message or ``repr``.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from dcp.protocol.cluster_config import Address, ConfigError, parse_addresses

from .errors import OptionError
from .security import Credentials, TlsFiles, check_plain, resolve_security

__all__ = ["OPTIONS", "SourceConfig", "parse_options", "parse_vbuckets"]

#: Every option the source understands (lower-case name -> one-line help).
OPTIONS = {
    "host": "server address (default 127.0.0.1), or a cluster's bootstrap list "
    "'h1:p1,h2:p2' (a host without ':port' uses option port)",
    "port": "server port (default 11210)",
    "vbuckets": "vbuckets to read: 'all' (default) or a list like '0,4,8-15'",
    "startingoffsets": "where to start: 'earliest' (default), 'latest' (streams) or offsets "
    "as JSON",
    "endingoffsets": "batch reads: where to end: 'latest' (default: the high seqnos when "
    "the read is planned) or offsets as JSON",
    "startingoffsetsfile": "file that keeps the resolved starting offsets (required for "
    "'latest'); written once, atomically, then always read back",
    "maxrowsperbatch": "upper bound of rows (seqnos) per micro-batch, cut on snapshot "
    "boundaries; at least one snapshot per batch (default: no bound)",
    "maxrowspermicrobatch": "alias of maxRowsPerBatch",
    "maxoffsetspertrigger": "alias of maxRowsPerBatch (Kafka's name)",
    "minrowsperbatch": "streams: plan no batch until this many rows (seqnos) are new, or "
    "maxTriggerDelay passed (default: no minimum)",
    "minoffsetspertrigger": "alias of minRowsPerBatch (Kafka's name)",
    "maxtriggerdelay": "with minRowsPerBatch: the longest a batch waits for it, e.g. '15m', "
    "'30s', '500ms' (default 15m)",
    "numpartitions": "Spark partitions (tasks) per batch; vbuckets are spread over them "
    "(default: CPU count of the driver)",
    "onrollback": "'fail' (default): stop the query on a rollback; 'rewind': emit an "
    "op='rollback' row and continue from the rollback seqno",
    "failondataloss": "Kafka's name: 'true' = onRollback=fail, 'false' = onRollback=rewind",
    "onmergedsnapshot": "'fail' (default for streams) or 'reread' (default for batch reads):"
    " what to do when a planned range can no longer be served exactly",
    "timeout": "socket timeout in seconds (default 30)",
    "retrytimeout": "seconds the planner and executors keep retrying a lost connection; "
    "'forever' (or -1) never gives up (default 30)",
    "plancachems": "how long the driver reuses the server's high seqnos (default 250)",
    "arrowbatchrows": "rows per Arrow record batch handed to Spark (default 65536)",
    "username": "user to log in as (SASL; default: DCP_USERNAME, else no login)",
    "password": "that user's password (default: DCP_PASSWORD)",
    "mechanism": "SASL mechanism: SCRAM-SHA512 (default), SCRAM-SHA256 or PLAIN (PLAIN only "
    "over TLS or to a loopback host)",
    "tls": "'true': connect with TLS (the system's CAs unless tlsCaFile); 'false': never, "
    "whatever the environment says (default: on when a CA or client certificate is given)",
    "tlscafile": "CA file (PEM) to verify the server with; turns TLS on (default: DCP_TLS_CA)",
    "tlscertfile": "client certificate (PEM, with its key unless tlsKeyFile) for mutual TLS; "
    "turns TLS on (default: DCP_TLS_CERT)",
    "tlskeyfile": "the client certificate's key file (default: DCP_TLS_KEY)",
    "stableonly": "'true': read only changes no single node failure can roll back "
    "(batches are planned up to the stable seqnos, and each task waits until its range "
    "is stable; needs the 'stats' privilege); 'false' (default): read as soon as written",
}

_ALIASES = {
    "maxrowspermicrobatch": "maxrowsperbatch",
    "maxoffsetspertrigger": "maxrowsperbatch",
    "minoffsetspertrigger": "minrowsperbatch",
}
#: Options that only mean something for one kind of read.
_STREAM_ONLY = ("maxrowsperbatch", "minrowsperbatch", "maxtriggerdelay", "startingoffsetsfile")
_BATCH_ONLY = ("endingoffsets",)
#: Spellings as the documentation writes them (for messages).
_NAMES = {
    n: n
    for n in (
        "host",
        "port",
        "vbuckets",
        "timeout",
        "username",
        "password",
        "mechanism",
        "tls",
    )
} | {
    "startingoffsets": "startingOffsets",
    "endingoffsets": "endingOffsets",
    "startingoffsetsfile": "startingOffsetsFile",
    "maxrowsperbatch": "maxRowsPerBatch",
    "maxrowspermicrobatch": "maxRowsPerMicroBatch",
    "maxoffsetspertrigger": "maxOffsetsPerTrigger",
    "minrowsperbatch": "minRowsPerBatch",
    "minoffsetspertrigger": "minOffsetsPerTrigger",
    "maxtriggerdelay": "maxTriggerDelay",
    "numpartitions": "numPartitions",
    "onrollback": "onRollback",
    "failondataloss": "failOnDataLoss",
    "onmergedsnapshot": "onMergedSnapshot",
    "retrytimeout": "retryTimeout",
    "plancachems": "planCacheMs",
    "arrowbatchrows": "arrowBatchRows",
    "tlscafile": "tlsCaFile",
    "tlscertfile": "tlsCertFile",
    "tlskeyfile": "tlsKeyFile",
    "stableonly": "stableOnly",
}


@dataclass(frozen=True, slots=True)
class SourceConfig:
    host: str = "127.0.0.1"  # the first bootstrap address
    port: int = 11210
    #: every bootstrap address (option host as a list); () = just (host, port)
    bootstrap: tuple[Address, ...] = ()
    vbuckets: tuple[int, ...] | None = None  # None = every vbucket the server has
    starting_offsets: str = "earliest"  # 'earliest', 'latest' or JSON text
    starting_offsets_file: str | None = None
    ending_offsets: str = "latest"  # batch reads: 'latest' or JSON text
    max_rows_per_batch: int | None = None
    min_rows_per_batch: int = 0
    max_trigger_delay: float = 900.0
    num_partitions: int = 0  # 0 = CPU count
    on_rollback: str = "fail"
    on_merged_snapshot: str = "fail"
    timeout: float = 30.0
    retry_timeout: float = 30.0  # math.inf: retry forever
    plan_cache_seconds: float = 0.25
    arrow_batch_rows: int = 65536
    credentials: Credentials | None = None  # None: no login
    tls: TlsFiles | None = None  # None: plain TCP
    #: executors ask for stable-only streams (DCP_CONTROL stable_only, docs/spark.md)
    stable_only: bool = False

    @property
    def addresses(self) -> tuple[Address, ...]:
        """The bootstrap list: where the cluster config is asked for, in this order."""
        return self.bootstrap or ((self.host, self.port),)

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


def _duration(name: str, raw: str) -> float:
    """'15m', '30s', '500ms', '2h' or plain seconds."""
    text = raw.strip().lower()
    for suffix, scale in (("ms", 0.001), ("s", 1.0), ("m", 60.0), ("h", 3600.0)):
        if text.endswith(suffix) and text[: -len(suffix)].strip().replace(".", "", 1).isdigit():
            return float(text[: -len(suffix)]) * scale
    try:
        v = float(text)
    except ValueError:
        raise OptionError(
            f"option {name}={raw!r}: expected a duration like '15m', '30s' or '500ms'"
        ) from None
    if v < 0:
        raise OptionError(f"option {name}={raw!r}: must be >= 0")
    return v


def _hosts(raw: str, port: int) -> dict[str, object]:
    """Option host: one address (``HOST`` or ``HOST:PORT``) or a bootstrap list; a host
    without a port uses option ``port``. One address keeps the single-server shape
    (``bootstrap`` empty) so a single server is read exactly as before."""
    text = raw.strip()
    if not text:
        raise OptionError("option host must not be empty")
    if "," not in text and text.count(":") != 1 and not text.startswith("["):
        return {"host": text}  # a bare host name (or an unbracketed IPv6 literal)
    try:
        addrs = parse_addresses(text, default_port=port)
    except ConfigError as exc:
        raise OptionError(
            f"option host={raw!r}: expected HOST, HOST:PORT or a list like "
            f"'h1:11210,h2:11210' ({exc})"
        ) from None
    host, first_port = addrs[0]
    if len(addrs) == 1:
        return {"host": host, "port": first_port}
    return {"host": host, "port": first_port, "bootstrap": tuple(addrs)}


def _unknown(name: str) -> OptionError:
    known = sorted(_NAMES[n] for n in OPTIONS)
    near = difflib.get_close_matches(name.lower(), list(OPTIONS), n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(repr(_NAMES[n]) for n in near)}?" if near else ""
    return OptionError(f"unknown option {name!r}{hint} Known options: {', '.join(known)}")


def _offsets_text(name: str, raw: str, words: tuple[str, ...]) -> str:
    text = raw.strip()
    if text.lower() in words:
        return text.lower()
    if not text.startswith("{"):
        raise OptionError(
            f"option {name}={text!r}: expected {' or '.join(repr(w) for w in words)} "
            f"or a JSON object"
        )
    return text


def parse_options(options: Mapping[str, str], *, streaming: bool | None) -> SourceConfig:
    """Validate Spark's option map into a ``SourceConfig``.

    ``streaming`` picks the defaults that differ (a batch read re-reads merged snapshots
    by default: it has no replay contract; a stream fails on them) and refuses the other
    mode's options; None (at ``load()``, before the mode is known) checks every option
    on its own.
    """
    opts: dict[str, str] = {}
    given: dict[str, str] = {}  # canonical name -> the name the user wrote
    for k, v in options.items():
        key = _ALIASES.get(k.lower(), k.lower())
        if key not in OPTIONS:
            raise _unknown(k)
        if key in given and given[key].lower() != k.lower():
            raise OptionError(f"options {given[key]!r} and {k!r} are the same option: give one")
        given[key] = k
        if v is None:
            continue
        opts[key] = str(v)
    if streaming is True:
        wrong = [given[k] for k in _BATCH_ONLY if k in opts]
        if wrong:
            raise OptionError(
                f"option {wrong[0]} is for batch reads (spark.read); a stream runs until "
                f"stopped (use trigger(availableNow=True) to drain and stop)"
            )
    elif streaming is False:
        wrong = [given[k] for k in _STREAM_ONLY if k in opts]
        if wrong:
            raise OptionError(
                f"option {wrong[0]} is for streams (spark.readStream); a batch read reads "
                f"(startingOffsets, endingOffsets] in one go"
            )
    kw: dict[str, object] = {"on_merged_snapshot": "reread" if streaming is False else "fail"}
    if "port" in opts:
        kw["port"] = _int("port", opts["port"], 1, 65535)
    if "host" in opts:
        kw.update(_hosts(opts["host"], kw.get("port", 11210)))  # type: ignore[arg-type]
    if "vbuckets" in opts:
        kw["vbuckets"] = parse_vbuckets(opts["vbuckets"])
    if "startingoffsets" in opts:
        so = _offsets_text("startingOffsets", opts["startingoffsets"], ("earliest", "latest"))
        if so == "latest" and streaming is False:
            raise OptionError(
                "option startingOffsets='latest' means nothing for a batch read (it would "
                "read nothing): give 'earliest' or offsets as JSON"
            )
        kw["starting_offsets"] = so
    if "endingoffsets" in opts:
        kw["ending_offsets"] = _offsets_text("endingOffsets", opts["endingoffsets"], ("latest",))
    if "startingoffsetsfile" in opts:
        kw["starting_offsets_file"] = opts["startingoffsetsfile"].strip() or None
    if (
        streaming is not False
        and kw.get("starting_offsets") == "latest"
        and not kw.get("starting_offsets_file")
    ):
        raise OptionError(
            "startingOffsets=latest needs option startingOffsetsFile: 'latest' is resolved "
            "once and must read back identically after a restart, and Spark does not tell a "
            "Python source its checkpoint location. Give a path (e.g. inside the checkpoint "
            "directory) where the resolved offsets are kept."
        )
    if "maxrowsperbatch" in opts:
        kw["max_rows_per_batch"] = _int(given["maxrowsperbatch"], opts["maxrowsperbatch"], 1)
    if "minrowsperbatch" in opts:
        kw["min_rows_per_batch"] = _int(given["minrowsperbatch"], opts["minrowsperbatch"], 1)
    if "maxtriggerdelay" in opts:
        kw["max_trigger_delay"] = _duration("maxTriggerDelay", opts["maxtriggerdelay"])
    lo, hi = kw.get("min_rows_per_batch", 0), kw.get("max_rows_per_batch")
    if isinstance(lo, int) and isinstance(hi, int) and lo > hi:
        raise OptionError(
            f"option {given['minrowsperbatch']}={kw['min_rows_per_batch']} is above "
            f"{given['maxrowsperbatch']}={kw['max_rows_per_batch']}: no batch could satisfy both"
        )
    if "numpartitions" in opts:
        kw["num_partitions"] = _int("numPartitions", opts["numpartitions"], 1, 100_000)
    if "onrollback" in opts:
        kw["on_rollback"] = _choice("onRollback", opts["onrollback"], ("fail", "rewind"))
    if "failondataloss" in opts:
        fail = _choice("failOnDataLoss", opts["failondataloss"], ("true", "false")) == "true"
        policy = "fail" if fail else "rewind"
        if kw.get("on_rollback", policy) != policy:
            raise OptionError(
                f"options failOnDataLoss={opts['failondataloss']} and "
                f"onRollback={kw['on_rollback']} contradict each other: give one"
            )
        kw["on_rollback"] = policy
    if "onmergedsnapshot" in opts:
        kw["on_merged_snapshot"] = _choice(
            "onMergedSnapshot", opts["onmergedsnapshot"], ("fail", "reread")
        )
    if "timeout" in opts:
        kw["timeout"] = _float("timeout", opts["timeout"], 0.1)
    if "retrytimeout" in opts:
        raw = opts["retrytimeout"].strip().lower()
        if raw in ("forever", "inf", "infinite", "-1"):
            kw["retry_timeout"] = math.inf
        else:
            kw["retry_timeout"] = _float("retryTimeout", opts["retrytimeout"], 0.0)
    if "plancachems" in opts:
        kw["plan_cache_seconds"] = _int("planCacheMs", opts["plancachems"], 0) / 1000.0
    if "stableonly" in opts:
        kw["stable_only"] = _choice("stableOnly", opts["stableonly"], ("true", "false")) == "true"
    if "arrowbatchrows" in opts:
        kw["arrow_batch_rows"] = _int("arrowBatchRows", opts["arrowbatchrows"], 1)
    creds, tls = resolve_security(str(kw.get("host", "127.0.0.1")), opts)
    kw["credentials"], kw["tls"] = creds, tls
    bootstrap: tuple[Address, ...] = kw.get("bootstrap", ())  # type: ignore[assignment]
    for other, _ in bootstrap[1:]:  # every node gets the password, not just the first
        check_plain(other, creds, tls is not None)
    return SourceConfig(**kw)  # type: ignore[arg-type]
