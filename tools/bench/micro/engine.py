"""Benchmark of the engine's hot paths: ingest (with dedup), flush to LMDB, disk backfill.

Usage:
    python -m tools.bench.micro.engine                 # 1 M items, 1024 vbuckets
    python -m tools.bench.micro.engine --items 20000   # a CI-sized run (seconds)

Phases (each timed on its own, one core):
  ingest    Bucket.set of N items (100-byte values) over N * key_ratio distinct keys, so
            the open checkpoints deduplicate; includes validation, key index, Item + wire
            body, checkpoint queue and the listener call.
  flush     Flusher.collect -> LmdbStorage.write_batch -> Flusher.complete until nothing
            is pending (20k-item batches, sync=True unless --no-sync); items/s counts the
            items written (after dedup).
  flush+del the same after N/4 more writes to existing keys: each item written also
            deletes the stored version it supersedes (steady state).
  backfill  BackfillScan over every vbucket from seqno 0, read in 4096-item chunks
            (decoded Items with their wire body).

Goals (docs/engine.md): ingest >= 500k/s, flush >= 300k/s, backfill >= 600k/s.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

from dcp.producer.engine import Bucket, EngineConfig
from dcp.protocol.codec import vbucket_for_key


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(
        prog="python -m tools.bench.micro.engine", description=__doc__.split("\n")[0]
    )
    p.add_argument("--items", type=int, default=1_000_000)
    p.add_argument("--vbuckets", type=int, default=1024)
    p.add_argument(
        "--key-ratio", type=float, default=0.5, help="distinct keys / items (dedup when < 1)"
    )
    p.add_argument("--value-size", type=int, default=100)
    p.add_argument("--batch", type=int, default=20_000, help="flush batch items")
    p.add_argument("--no-sync", action="store_true", help="LMDB sync=False")
    p.add_argument("--default-gc", action="store_true", help="keep CPython's default GC thresholds")
    p.add_argument("--dir", help="data dir (default: a temp dir, removed)")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    args = p.parse_args(argv)

    if not args.default_gc:
        gc.set_threshold(100_000, 50, 100)  # what the server does (dcp/producer/cli.py)
    n = args.items
    nkeys = max(1, int(n * args.key_ratio))
    rng = random.Random(42)
    keys = [b"key:%012d" % i for i in range(nkeys)]
    vbs = [vbucket_for_key(k, args.vbuckets) for k in keys]
    order = [rng.randrange(nkeys) for _ in range(n)]
    work = [(vbs[i], keys[i]) for i in order]
    value = b"v" * args.value_size

    tmp = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench-engine-"))
    cfg = EngineConfig(
        num_vbuckets=args.vbuckets,
        checkpoint_memory_quota=1 << 40,
        map_size=64 << 30,
        lmdb_sync=not args.no_sync,
    )
    seq = itertools.count(1)
    bucket = Bucket.open(tmp / "data", cfg, clock=time.time, uuid_source=lambda: next(seq))
    res: dict[str, float] = {"items": n, "keys": nkeys, "vbuckets": args.vbuckets}
    try:
        bset = bucket.set
        t0 = time.perf_counter()
        for vb, key in work:
            bset(vb, key, value)
        t1 = time.perf_counter()
        res["ingest_items_per_s"] = n / (t1 - t0)
        res["checkpoint_items"] = sum(vb.checkpoints.num_items() for vb in bucket.vbuckets)
        res["checkpoint_memory_mb"] = bucket.checkpoint_memory() / 2**20

        f = bucket.flusher
        storage = bucket.storage
        written = 0
        write_s = 0.0
        t0 = time.perf_counter()
        while (batch := f.collect(args.batch)) is not None:
            w0 = time.perf_counter()
            storage.write_batch(batch)
            write_s += time.perf_counter() - w0
            f.complete(batch)
            written += batch.num_items
        t1 = time.perf_counter()
        res["flushed_items"] = written
        res["flush_items_per_s"] = written / (t1 - t0)
        res["flush_write_batch_only_items_per_s"] = written / write_s if write_s else 0.0

        # updates of stored keys: each flushed item now also deletes the version it
        # supersedes on disk (the steady state of a long-running bucket)
        upd = work[: max(1, n // 4)]
        for vb, key in upd:
            bset(vb, key, value)
        updated = 0
        t0 = time.perf_counter()
        while (batch := f.collect(args.batch)) is not None:
            storage.write_batch(batch)
            f.complete(batch)
            updated += batch.num_items
        t1 = time.perf_counter()
        res["update_flushed_items"] = updated
        res["update_flush_items_per_s"] = updated / (t1 - t0)

        total = 0
        t0 = time.perf_counter()
        for vb in range(args.vbuckets):
            with storage.open_backfill(vb, 0) as scan:
                while items := scan.read(4096):
                    total += len(items)
        t1 = time.perf_counter()
        res["backfill_items"] = total
        res["backfill_items_per_s"] = total / (t1 - t0)
        res["disk_mb"] = storage.stats()["used_bytes"] / 2**20
    finally:
        bucket.close()
        if not args.dir:
            shutil.rmtree(tmp, ignore_errors=True)

    if args.json:
        print(json.dumps({k: round(v, 1) for k, v in res.items()}))
    else:
        print(f"items={n} keys={nkeys} vbuckets={args.vbuckets} sync={not args.no_sync}")
        print(
            f"ingest   {res['ingest_items_per_s']:>12,.0f} items/s   (goal >= 500,000)"
            f"  [{res['checkpoint_items']:,} items left after dedup, "
            f"{res['checkpoint_memory_mb']:.0f} MiB checkpoints]"
        )
        print(
            f"flush    {res['flush_items_per_s']:>12,.0f} items/s   (goal >= 300,000)"
            f"  [write_batch alone {res['flush_write_batch_only_items_per_s']:,.0f}/s, "
            f"{written:,} items]"
        )
        print(
            f"flush+del{res['update_flush_items_per_s']:>12,.0f} items/s   (updates: each "
            f"deletes its superseded version; {updated:,} items)"
        )
        print(
            f"backfill {res['backfill_items_per_s']:>12,.0f} items/s   (goal >= 600,000)"
            f"  [{total:,} items, {res['disk_mb']:.0f} MiB on disk]"
        )
    return res


if __name__ == "__main__":
    main()
