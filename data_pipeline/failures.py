"""How reading data fails: what a failure says about the source, and reading again.

`failure_kind` tells a network failure (worth retrying), a source that is gone, and bytes
that cannot be decoded (only that piece is lost) from a bug; `retry` tries an action
again while the network fails. A `DataFault` is what a run reports when a source fails
mid-run: its message names the source and where.
"""

from __future__ import annotations

import errno
import logging
import lzma
import socket
import sys
import time
import zlib

import pyarrow as pa

log = logging.getLogger(__name__)

RETRIES = 3
"""Attempts at reading a file's metadata or a unit's rows when the network fails, before
the source fails (each read again from the row it had reached)."""
RETRY_PAUSE = 1.0
"""Seconds before the second attempt; doubled before each later one."""


class DataFault(RuntimeError):
    """Data that failed while a run was reading it (a corrupt row group, a vanished file,
    an unreachable hub, too many unusable rows): the message names the source and where."""


_TRANSPORT_ERRORS = (
    ("http.client", "HTTPException"),  # urllib, and what requests and urllib3 wrap
    ("urllib3.exceptions", "HTTPError"),
    ("requests", "RequestException"),
    ("aiohttp", "ClientError"),  # fsspec's HTTP file system
    ("httpx", "HTTPError"),
    ("httpx2", "HTTPError"),  # huggingface_hub's HfFileSystem (hf:// files)
    ("huggingface_hub.errors", "HfHubHTTPError"),
)
"""(module, class): the base of each network library's errors. Most are no OSError, and
the OSErrors among them (requests', the hub's) are no builtin ConnectionError."""
_NETWORK_ERRNOS = frozenset(
    {errno.ENETDOWN, errno.ENETUNREACH, errno.ENETRESET, errno.EHOSTDOWN, errno.EHOSTUNREACH}
)
_CORRUPT_ERRORS = (EOFError, pa.ArrowException, zlib.error, lzma.LZMAError, UnicodeDecodeError)
"""Raised by decoding bytes that were read: a truncated or garbled compressed stream, a
parquet page arrow cannot decode (which pyarrow raises as a plain OSError, as gzip
raises BadGzipFile: see failure_kind)."""


def failure_kind(err: BaseException) -> str | None:
    """What a failure to read a unit of data says about the source:

    - 'transport': the network or a remote store failed (a connection, a timeout, an HTTP
      error of any library fsspec, the hub or datasets use): worth retrying; after the
      retries the source fails.
    - 'source': the file is gone or forbidden, or the system failed to read it (an OSError
      carrying an errno): the source fails.
    - 'corrupt': the bytes were read but cannot be decoded (a corrupt parquet page, a
      broken compressed stream): only this unit is lost (data.on_corrupt_row_group).
    - None: not a data error (a bug: let it raise).

    The network libraries are never imported here: an error of a library not imported
    cannot have been raised. A failure anywhere in the chain of causes counts (errors
    re-raised with the file's name keep theirs; fsspec's HTTP files raise FileNotFoundError
    from a connection that failed)."""
    chain = [err]
    while len(chain) < 16 and (cause := chain[-1].__cause__ or chain[-1].__context__):
        chain.append(cause)
    if any(_is_transport(e) for e in chain):
        return "transport"
    if any(
        isinstance(e, (FileNotFoundError, PermissionError))
        or (isinstance(e, OSError) and e.errno is not None)  # EIO, ESTALE, ...: the system's
        for e in chain
    ):
        return "source"
    if isinstance(err, (OSError, *_CORRUPT_ERRORS)) or _is_instance(err, "zstandard", "ZstdError"):
        return "corrupt"  # an OSError without errno: raised by a decoder (arrow, gzip)
    return None


def _is_transport(err: BaseException) -> bool:
    if isinstance(err, (ConnectionError, TimeoutError)):  # socket.timeout, FSTimeoutError too
        return True
    if isinstance(err, OSError) and (
        err.errno in _NETWORK_ERRNOS or isinstance(err, (socket.gaierror, socket.herror))
    ):
        return True
    return any(_is_instance(err, module, name) for module, name in _TRANSPORT_ERRORS)


def _is_instance(err: BaseException, module: str, name: str) -> bool:
    """isinstance(err, module.name), False if that module was never imported."""
    base = getattr(sys.modules.get(module), name, None)
    return isinstance(base, type) and isinstance(err, base)


def retry(action, path: str):
    """`action()`, attempted again (up to RETRIES in all) while the network fails; any
    other error at once."""
    for attempt in range(1, RETRIES + 1):
        try:
            return action()
        except Exception as err:
            if attempt == RETRIES or failure_kind(err) != "transport":
                raise
            retry_pause(attempt, path, err)
    raise AssertionError("unreachable")


def retry_pause(attempt: int, where: str, err: BaseException) -> None:
    """Wait before attempt `attempt` + 1 at reading `where`, which failed with `err`."""
    pause = RETRY_PAUSE * 2 ** (attempt - 1)
    log.warning("%s: %s; attempt %d of %d in %.0f s", where, err, attempt + 1, RETRIES, pause)
    time.sleep(pause)
