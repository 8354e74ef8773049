"""Argument values several commands share: vbucket ids and lists (and their compact text).

Rules of this module: argparse ``type=`` functions raise ``ArgumentTypeError`` (usage,
exit 2); ``check_vbuckets`` raises ``CtlError`` once the real vbucket count is known.
No I/O, nothing heavy imported (``inspect`` must start fast).
"""

from __future__ import annotations

import argparse

from .output import CtlError

__all__ = [
    "DURABILITY_LEVELS",
    "address",
    "check_vbuckets",
    "durability_name",
    "ranges_text",
    "split_address",
    "vb_id",
    "vb_list",
]

#: ``--durability`` choices: the names ``KvClient`` takes (``kv_requests.LEVEL_NAMES``,
#: spelled out here so that parsing arguments does not load the SDK and trio).
DURABILITY_LEVELS = (
    "none",
    "majority",
    "majorityAndPersistActive",
    "persistToMajority",
    "persistActive",
)
_LEVEL_BY_LOWER = {name.lower(): name for name in DURABILITY_LEVELS}


def split_address(text: str) -> tuple[str, int]:
    """``"HOST:PORT"`` -> ``(host, port)`` (``[v6]:port`` too); ``ValueError`` if not one."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def address(text: str) -> str:
    """A node address ``HOST:PORT`` as given (it is sent to servers as is)."""
    try:
        split_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def vb_list(text: str) -> list[int]:
    """``"0,3,5-7"`` -> ``[0, 3, 5, 6, 7]``."""
    out: list[int] = []
    try:
        for part in text.split(","):
            lo, sep, hi = part.strip().partition("-")
            first, last = int(lo), int(hi) if sep else int(lo)
            if first < 0 or last < first or last > 0xFFFF:
                raise ValueError
            out.extend(range(first, last + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a vbucket list (like 3 or 0,2,5-7)"
        ) from None
    return sorted(set(out))


def vb_id(text: str) -> int:
    try:
        vb = int(text)
    except ValueError:
        vb = -1
    if not 0 <= vb <= 0xFFFF:
        raise argparse.ArgumentTypeError(f"{text!r} is not a vbucket id")
    return vb


def durability_name(text: str) -> str:
    """A ``--durability`` level in any case -> its spelling in ``DURABILITY_LEVELS``; an
    unknown name is returned as given, for argparse's ``choices`` to refuse."""
    return _LEVEL_BY_LOWER.get(text.lower(), text)


def ranges_text(vbs: list[int] | set[int]) -> str:
    """``[0, 1, 2, 3, 9]`` -> ``"0-3,9"`` (the inverse of ``vb_list``; empty: ``""``)."""
    out: list[str] = []
    run: list[int] = []
    for vb in sorted(set(vbs)):
        if run and vb == run[-1] + 1:
            run[-1] = vb
            continue
        if run:
            out.append(str(run[0]) if run[0] == run[1] else f"{run[0]}-{run[1]}")
        run = [vb, vb]
    if run:
        out.append(str(run[0]) if run[0] == run[1] else f"{run[0]}-{run[1]}")
    return ",".join(out)


def check_vbuckets(wanted: list[int] | None, count: int, where: str = "the server") -> list[int]:
    """``wanted`` (None: all of ``0..count-1``), refusing ids the store or server lacks."""
    if wanted is None:
        return list(range(count))
    bad = [vb for vb in wanted if not 0 <= vb < count]
    if bad:
        raise CtlError(f"vbucket {bad[0]} does not exist ({where} has 0..{count - 1})")
    return wanted
