"""The cluster tier for generated ids: recorded outputs shared across nodes through Redis or Valkey.

A node's shared memory holds what *this* node's model generated. When a conversation moves
to another node (a router that is not sticky, data-parallel replicas on other nodes), the
new node would re-encode the earlier outputs canonically, and its prompt ids would stop
being an extension of what the first node served — the KV a router scores and a
distributed KV store (LMCache, Mooncake) keys by token-id hashes misses. This module keeps
a copy of every verified recorded output in a Redis/Valkey database that all sidecars of a
cluster share:

* **write-through** (:class:`TierFeed`, :meth:`ArTier.write`): a verified recorded output's
  *segment* entries (output text → output ids, keyed like the local segment-AR entries) are
  written with a TTL, in the background (bounded; a full queue drops). Outputs are recorded
  by whichever process on the node has them (vLLM's API servers, in their own processes, or
  the sidecar for ``RecordOutput``), so the sidecar follows the segment's log for them: every
  segment record, whoever wrote it, reaches the tier within FOLLOW_S.
* **read on a local miss** (:meth:`ArTier.fetch`): when no recorded output applies to a
  kv-stable Tokenize locally, the candidate segment keys of its tail are asked for in one
  round trip (MGET; a pipeline per node in cluster mode); the engine verifies each value
  again and keeps the good ones in the node's shared memory, so the next turns read them
  locally.

What crosses the wire: keys are ``tokcache:ar:<fingerprint>:<hex of the 16-byte segment
key>`` — salted SHA-256 hashes, never text. A value is ``TCA1`` + the tokenizer
fingerprint (16 bytes) + the ids as little-endian uint32 (:func:`encode_value`). Only
segment entries go to the tier: they compose across turns (a conversation of k outputs
is k records, O(n) bytes), while a prefix-AR entry carries the whole prompt's ids (O(n²)
over a conversation), and the segment entries alone rebuild the same ids on the reading
node (the prompt's pieces are encoded canonically around them, as the writer did).

Fail-open: every call has a deadline (``--ar-store-timeout-ms``), failures open a circuit
breaker (no call while open, one probe after ``BREAKER_RESET_S``), and nothing here ever
raises into a request: a tier that is down or slow costs at most one deadline per call
until the breaker opens, then nothing.

URLs: ``redis://[user:password@]host:port[/db]``, ``rediss://…`` (TLS), and
``redis+cluster://host:port`` / ``rediss+cluster://…`` for Redis/Valkey cluster mode
(any node: the client discovers the rest). Valkey speaks the same protocol. The password
never appears in logs or errors (:func:`redacted`).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from array import array
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from tokcache.breaker import CircuitBreaker
from tokcache.ids import le_bytes, unpack_ids

log = logging.getLogger(__name__)

__all__ = ["ArTier", "TierFeed", "TierFetch", "TierUrl", "TierUrlError", "decode_value", "encode_value",
           "redacted", "tier_key"]

SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster")
VALUE_MAGIC = b"TCA1"
_FP_BYTES = 16
DEFAULT_TIMEOUT_MS = 20.0
# Writes are off the request path: they get this many read deadlines.
WRITE_DEADLINES = 10
MIN_WRITE_TIMEOUT_S = 0.1
# Consecutive failed calls that open the breaker, and how long it stays open before a probe.
BREAKER_FAILURES = 3
BREAKER_RESET_S = 2.0
# Record writes in flight at most; more are dropped (counted).
MAX_PENDING_WRITES = 256
# A tier entry outlives no local one: --ttl-ar when set, else this (Redis must not fill up).
DEFAULT_TTL_S = 3600.0
# Keys asked in one read at most: the ones nearest the end of the text (the newest pieces).
# A moved conversation of ~800 KB has ~10k candidate keys; building and parsing them all
# would eat the deadline, and a deadline missed by size must not count against the tier.
MAX_FETCH_KEYS = 4096
# How long the first connection (cluster discovery included) may take at start.
START_TIMEOUT_S = 2.0
# How often the log of each segment is followed for new recorded outputs: the latest a record
# reaches the tier after it was stored. A conversation moves to another node at the earliest
# on its next turn, after the agent read the response and ran its tools; a look costs two
# header words when nothing was written.
FOLLOW_S = 0.05
# Records looked at per segment and look: bounds the event loop's time in one look (a copy
# and a check per record); a burst is caught up over the next looks.
FOLLOW_RECORDS = 512


class TierUrlError(ValueError):
    """``--ar-store`` is not a URL this module can use (the message never holds the password)."""


def redacted(url: str) -> str:
    """``url`` without its user info (``redis://:secret@h:1/0`` -> ``redis://h:1/0``)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    try:
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        port = ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


@dataclass(frozen=True)
class TierUrl:
    """A parsed ``--ar-store`` URL: what redis-py gets, whether it is a cluster, and what logs show."""

    url: str  # redis:// or rediss:// (the +cluster marker removed)
    cluster: bool
    display: str

    @classmethod
    def parse(cls, value: str) -> TierUrl:
        """Check ``value``; TierUrlError saying what is wrong (without the password)."""
        parts = urlsplit(value.strip())
        shown = redacted(value) if "://" in value else "(not a URL)"
        if parts.scheme not in SCHEMES:
            raise TierUrlError(f"{shown}: the scheme must be one of {', '.join(s + '://' for s in SCHEMES)}")
        if not parts.hostname:
            raise TierUrlError(f"{shown}: no host")
        try:
            parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
        except ValueError as exc:
            raise TierUrlError(f"{shown}: bad port ({exc})") from None
        cluster = parts.scheme.endswith("+cluster")
        path = parts.path.strip("/")
        if path and not path.isdigit():
            raise TierUrlError(f"{shown}: the path must be a database number, got {path!r}")
        if cluster and path not in ("", "0"):
            raise TierUrlError(f"{shown}: cluster mode has only database 0")
        url = value.strip()
        if cluster:
            url = url.replace("+cluster", "", 1)
        return cls(url, cluster, redacted(value))


def tier_key(fingerprint: str, key: bytes) -> bytes:
    """The Redis key of a segment-AR key (16 bytes) of tokenizer ``fingerprint`` (32 hex)."""
    return b"tokcache:ar:%s:%s" % (fingerprint.encode("ascii"), key.hex().encode("ascii"))


def encode_value(fingerprint: str, ids: Sequence[int] | bytes) -> bytes:
    """A tier value: magic, the tokenizer's fingerprint, the ids (packed LE uint32 or ints)."""
    packed = ids if isinstance(ids, bytes) else le_bytes(array("I", ids))
    return VALUE_MAGIC + bytes.fromhex(fingerprint) + packed


def decode_value(value: bytes, fingerprint: str) -> list[int] | None:
    """The ids of a tier value written for ``fingerprint``; None for anything else (another
    format, another tokenizer, a length that is not whole ids, no ids)."""
    head = len(VALUE_MAGIC) + _FP_BYTES
    if len(value) <= head or (len(value) - head) % 4 or not value.startswith(VALUE_MAGIC):
        return None
    if value[len(VALUE_MAGIC):head] != bytes.fromhex(fingerprint):
        return None
    return unpack_ids(value[head:])


@dataclass
class TierFetch:
    """One :meth:`ArTier.fetch`: the values found (by segment key) and how the call went.

    ``result``: ``hit`` (some values), ``miss`` (none), ``error`` (failed or timed out:
    the breaker counted it), ``refused`` (breaker open: not asked).
    """

    result: str
    values: dict[bytes, bytes]
    seconds: float = 0.0
    asked: int = 0


def _import_redis() -> Any:  # redis-py's modules, imported only when a tier is configured
    try:
        import redis.asyncio as aioredis
        from redis.asyncio.cluster import RedisCluster
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff
    except ImportError as exc:
        raise ImportError("the cluster tier (--ar-store) needs redis-py: pip install 'tokcache[tier]'") from exc
    return aioredis, RedisCluster, Retry, NoBackoff


class ArTier:
    """The cluster tier of one sidecar process. Use from its event loop only.

    Create with a parsed URL (no I/O; redis-py is imported here, ImportError without it),
    then :meth:`start` on the loop. ``observe`` (optional) is called on the loop as
    ``observe(op, result, seconds)`` for every fetch and write, and as
    ``observe("breaker", new_state, 0.0)`` when the breaker changes state (metrics);
    ``ttl_s`` is the entries' lifetime in the tier.
    """

    def __init__(self, url: TierUrl, *, timeout_s: float = DEFAULT_TIMEOUT_MS / 1000, ttl_s: float = DEFAULT_TTL_S,
                 observe: Callable[[str, str, float], None] | None = None, breaker_failures: int = BREAKER_FAILURES,
                 breaker_reset_s: float = BREAKER_RESET_S, max_pending_writes: int = MAX_PENDING_WRITES) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.write_timeout_s = max(timeout_s * WRITE_DEADLINES, MIN_WRITE_TIMEOUT_S)
        self.ttl_s = max(1, round(ttl_s))
        self._observe = observe
        self._modules = _import_redis()
        self.breaker = CircuitBreaker(breaker_failures, breaker_reset_s, on_change=self._changed)
        self.max_pending_writes = max_pending_writes
        self._client: Any = None
        # Write tasks in flight (a set keeps them referenced until done); loop thread only.
        self._writes: set[asyncio.Task[None]] = set()
        self._logged_failure = 0.0

    # -- lifecycle ------------------------------------------------------------------------

    def _make_client(self) -> Any:  # redis.asyncio.Redis or RedisCluster
        aioredis, cluster_cls, retry_cls, no_backoff = self._modules
        # No retries inside redis-py: one attempt per deadline, the breaker decides the rest.
        common: dict[str, Any] = {"socket_timeout": self.write_timeout_s,
                                  "socket_connect_timeout": self.write_timeout_s}
        if self.url.cluster:
            return cluster_cls.from_url(self.url.url, retry=retry_cls(no_backoff(), 0), **common)
        return aioredis.Redis.from_url(self.url.url, retry=retry_cls(no_backoff(), 0), retry_on_timeout=False,
                                       **common)

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = self._make_client()
        return self._client

    async def start(self) -> bool:
        """Connect once (cluster: discover the nodes) within START_TIMEOUT_S; True when the
        tier answered. A tier that is not up is logged, not fatal: reads and writes fail
        open until it is."""
        try:
            await asyncio.wait_for(self.client.ping(), START_TIMEOUT_S)
        except Exception as exc:  # any failure of the tier is fail-open
            log.warning("cluster tier %s is not answering (%s); Tokenize serves without it until it does",
                        self.url.display, _one_line(exc))
            await self._reset_client()
            return False
        log.info("cluster tier %s (%s): reads within %.0f ms, entries kept %d s", self.url.display,
                 "cluster" if self.url.cluster else "single node", self.timeout_s * 1000, self.ttl_s)
        return True

    async def close(self, timeout: float = 1.0) -> None:
        """Let pending writes finish (at most ``timeout`` s), then close the connections."""
        if self._writes:
            await asyncio.wait(list(self._writes), timeout=timeout)
        for task in list(self._writes):
            task.cancel()
        await self._reset_client()

    async def _reset_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                await client.aclose()
            except Exception:  # closing a broken client must not raise
                pass

    # -- reads ----------------------------------------------------------------------------

    async def fetch(self, fingerprint: str, keys: Sequence[bytes]) -> TierFetch:
        """The tier's values for segment ``keys`` of tokenizer ``fingerprint``, in one round
        trip, within the read deadline. Never raises; see :class:`TierFetch`."""
        if not keys:
            return TierFetch("miss", {})
        keys = keys[-MAX_FETCH_KEYS:]
        if not self.breaker.allow():
            self._count("fetch", "refused", 0.0)
            return TierFetch("refused", {}, asked=len(keys))
        names = [tier_key(fingerprint, k) for k in keys]
        t0 = time.perf_counter()
        try:
            client = self.client
            values = await _within(client.mget_nonatomic(names) if self.url.cluster else client.mget(names),
                                   self.timeout_s)
        except Exception as exc:  # timeouts, connection and cluster errors: fail open
            seconds = time.perf_counter() - t0
            self._failed("read", exc)
            self._count("fetch", "error", seconds)
            return TierFetch("error", {}, seconds, len(keys))
        seconds = time.perf_counter() - t0
        self.breaker.success()
        found = {k: v for k, v in zip(keys, values, strict=True) if isinstance(v, bytes)}
        result = "hit" if found else "miss"
        self._count("fetch", result, seconds)
        return TierFetch(result, found, seconds, len(keys))

    # -- writes ---------------------------------------------------------------------------

    def write(self, fingerprint: str, items: Sequence[tuple[bytes, bytes]]) -> str:
        """Queue the write of verified segment entries ((key, packed ids) each); returns
        ``queued``, ``dropped`` (too many writes in flight) or ``refused`` (breaker open).
        Must be called on the event loop; never raises, never waits."""
        if not items:
            return "none"
        if len(self._writes) >= self.max_pending_writes:
            self._count("write", "dropped", 0.0)
            return "dropped"
        if not self.breaker.allow():
            self._count("write", "refused", 0.0)
            return "refused"
        task = asyncio.get_running_loop().create_task(self._write(fingerprint, list(items)))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)
        return "queued"

    async def _write(self, fingerprint: str, items: list[tuple[bytes, bytes]]) -> None:
        t0 = time.perf_counter()
        try:
            pipe = self.client.pipeline(transaction=False)
            for key, packed in items:
                pipe.set(tier_key(fingerprint, key), encode_value(fingerprint, packed), ex=self.ttl_s)
            await _within(pipe.execute(), self.write_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # fail open
            self._failed("write", exc)
            self._count("write", "error", time.perf_counter() - t0)
            return
        self.breaker.success()
        self._count("write", "ok", time.perf_counter() - t0)

    async def flush(self, timeout: float = 5.0) -> bool:
        """Wait for the writes in flight (tests, shutdown); False if some are still running."""
        if not self._writes:
            return True
        _, pending = await asyncio.wait(list(self._writes), timeout=timeout)
        return not pending

    # -- bookkeeping ----------------------------------------------------------------------

    def _count(self, op: str, result: str, seconds: float) -> None:
        if self._observe is not None:
            try:
                self._observe(op, result, seconds)
            except Exception:  # metrics must not fail a request
                log.exception("tier metrics failed")

    def _failed(self, op: str, exc: BaseException) -> None:
        """Count a failure for the breaker; log the first, then one line a minute."""
        self.breaker.failure()
        now = time.monotonic()
        if now - self._logged_failure >= 60.0:
            self._logged_failure = now
            log.warning("cluster tier %s: %s failed (%s); served without it (breaker %s)", self.url.display, op,
                        _one_line(exc) or type(exc).__name__, self.breaker.state)

    def _changed(self, old: str, new: str) -> None:
        level = logging.INFO if new == "closed" else logging.WARNING
        log.log(level, "cluster tier %s: breaker %s -> %s", self.url.display, old, new)
        self._count("breaker", new, 0.0)

    @property
    def state(self) -> str:
        """The breaker's state: closed (in use), open (not asked), half_open (one probe allowed)."""
        return self.breaker.state


async def _within(call: Awaitable[Any], seconds: float) -> Any:  # redis-py's replies are untyped
    """``await call``, cancelled after ``seconds`` (TimeoutError). On 3.11+ without wait_for's
    extra task (tens of µs on a ~150 µs round trip)."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(seconds):
            return await call
    return await asyncio.wait_for(call, seconds)


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    return " ".join(str(exc).split()) or type(exc).__name__


class TierFeed:
    """Follows each segment's log (``Store.follow``) and writes the segment entries of the
    outputs recorded into it to the tier (:meth:`ArTier.write`). One per node: only one
    sidecar process of a ``--workers`` group runs it. Event loop only; never raises."""

    def __init__(self, tier: ArTier, stores: Callable[[], Sequence[tuple[str, Any]]]) -> None:
        """``stores()``: (tokenizer fingerprint, Store) of each segment, looked up every pass."""
        self.tier = tier
        self._stores = stores
        self._cursors: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start following: from each segment's current head (what is in it already was fed
        by whoever ran before, or is older than a restart)."""
        for _fp, store in self._stores():
            self._cursors.setdefault(store.name, store.head())
        self._task = asyncio.get_running_loop().create_task(self._run(), name="tokcache-tier-feed")

    def feed(self) -> int:
        """One pass over every segment: entries queued for the tier. (Tests call it directly.)

        Each segment is followed from where the last pass stopped; one first seen now, from
        its head, as at :meth:`start`. A pass that fails on a segment (a store closed under it)
        keeps its cursor, so the next pass resumes there: restarting at the oldest live record
        would send the whole log to the tier again, and restarting at the head would skip what
        was recorded meanwhile. A cursor past the head belongs to a log that is gone (a segment
        created again under the name): every record of the new one is newer, so it is followed
        from its oldest live record."""
        queued = 0
        for fp, store in self._stores():
            name = getattr(store, "name", "?")
            try:
                head = store.head()
                cursor = self._cursors.get(name)
                if cursor is None:  # first seen now
                    cursor = head
                elif cursor > head:  # a log created again under the name
                    cursor = 0
                cursor, items = store.follow(cursor, limit=FOLLOW_RECORDS)
            except Exception as exc:  # the cursor stays: the next pass resumes there
                log.debug("cluster tier: following %s failed: %r", name, exc)
                continue
            self._cursors[name] = cursor
            if items and self.tier.write(fp, items) == "queued":
                queued += len(items)
        return queued

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(FOLLOW_S)
            self.feed()

    async def stop(self) -> None:
        """Feed what was recorded up to now, then stop following. Idempotent."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            self.feed()

