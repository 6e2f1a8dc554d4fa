"""One job's prefix in an S3-compatible bucket, reached through obstore, with clear errors and a bandwidth cap.

May import: obstore, ``tenplex.errors`` and the standard library.

Why obstore (measured against moto's server on loopback, 64 MiB, README "A durable tier"): its
``get_ranges`` fetches many ranges of one object concurrently from Rust (and merges adjacent ones),
7x the rate of boto3's ``get_object`` from 8 threads and 5x s3fs's ``cat_ranges``; its multipart
``put`` takes an iterator of chunks, which is where the upload cap sits; and it depends on nothing
else: boto3, aiobotocore and s3fs pin ``python-dateutil<3`` and each other's botocore, which clashes
with the Kubernetes client the operator uses.

Credentials and endpoint come from the standard environment (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``/``AWS_DEFAULT_REGION``,
``AWS_ENDPOINT_URL``, ``AWS_ALLOW_HTTP``; obstore also takes web identity and instance metadata), or,
without an access key in the environment, from the shared files (``AWS_SHARED_CREDENTIALS_FILE``,
default ``~/.aws/credentials``, and ``AWS_CONFIG_FILE``, default ``~/.aws/config``; profile
``AWS_PROFILE``, default ``default``).
"""

from __future__ import annotations

import configparser
import os
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Iterator

from ..errors import ConfigError, PermanentError, StoreError, TemporaryError

UPLOAD_PART_BYTES = 8 << 20  # multipart part size; S3 wants at least 5 MiB per part but the last


class DurableError(StoreError):
    """The bucket answered, but not as it should (a missing or damaged object, a version that is not durable)."""


class BucketUnreachable(DurableError, TemporaryError):
    """The bucket's endpoint did not answer: training goes on, uploads retry with back-off."""


class BucketDenied(DurableError, PermanentError):
    """The bucket refused the credentials, or does not exist: only a change of configuration helps."""


def parse_url(url: str) -> tuple[str, str]:
    """``s3://BUCKET/PREFIX`` -> (bucket, prefix without slashes at its ends)."""
    if not isinstance(url, str) or not url.startswith("s3://") or not url[5:].split("/", 1)[0]:
        raise ConfigError(f"durable location {url!r} is not s3://BUCKET/PREFIX (the prefix names the job)")
    bucket, _, prefix = url[5:].partition("/")
    return bucket, prefix.strip("/")


def _shared_files() -> dict[str, str]:
    """Credentials (and region, endpoint) of the profile in the shared AWS files; {} when there are none."""
    profile = os.environ.get("AWS_PROFILE", "default")
    found: dict[str, str] = {}
    config_file = Path(os.environ.get("AWS_CONFIG_FILE", "~/.aws/config")).expanduser()
    cred_file = Path(os.environ.get("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials")).expanduser()
    for path, section, keys in (
            (config_file, profile if profile == "default" else f"profile {profile}",
             {"region": "region", "endpoint_url": "endpoint"}),
            (cred_file, profile, {"aws_access_key_id": "access_key_id", "aws_secret_access_key": "secret_access_key",
                                  "aws_session_token": "token"})):
        parser = configparser.ConfigParser()
        if path.is_file() and parser.read(path) and parser.has_section(section):
            found.update({ours: parser[section][theirs] for theirs, ours in keys.items() if theirs in parser[section]})
    return found


class RateLimit:
    """A token bucket shared by every upload of a process: at most ``bytes_per_s`` on average (None: no cap),
    with bursts of one second's worth, so that training and transfers between hosts keep their links."""

    def __init__(self, bytes_per_s: float | None):
        if bytes_per_s is not None and bytes_per_s <= 0:
            raise ConfigError(f"the upload cap must be positive bytes per second (or none), got {bytes_per_s}")
        self.rate = bytes_per_s
        self._tokens = bytes_per_s or 0.0
        self._at = time.monotonic()
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> None:
        if self.rate is None:
            return
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.rate, self._tokens + (now - self._at) * self.rate) - nbytes
            self._at = now
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait:
            time.sleep(wait)


class Bucket:
    """A job's prefix ``s3://BUCKET/PREFIX``: put, get (whole or byte ranges), list and delete objects by key
    relative to the prefix. Every failure is a :class:`DurableError` of one line that names the location."""

    def __init__(self, url: str, *, endpoint: str | None = None, limit: RateLimit | None = None,
                 timeout_s: float = 30.0, retries: int = 2):
        try:
            from obstore.store import S3Store  # the durable extra: imported only where a bucket is used
        except ImportError:
            raise ConfigError(f"durable location {url}: the S3 client is not installed: "
                              f"pip install 'tenplex[durable]' (obstore)") from None

        self.url = url
        self.name, self.prefix = parse_url(url)
        self.limit = limit or RateLimit(None)
        config: dict[str, str] = {} if os.environ.get("AWS_ACCESS_KEY_ID") else _shared_files()
        endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or \
            config.get("endpoint")
        if endpoint:
            config["endpoint"] = endpoint
            if endpoint.startswith("http://"):
                config["allow_http"] = "true"
        config.setdefault("region", os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
                          or "us-east-1")
        self.endpoint = endpoint or "AWS"
        self._store = S3Store(self.name, prefix=self.prefix or None, config=config,  # type: ignore[arg-type]
                              client_options={"connect_timeout": f"{max(1, int(timeout_s / 3))}s",
                                              "timeout": f"{int(timeout_s)}s"},
                              retry_config={"max_retries": retries, "retry_timeout": timedelta(seconds=timeout_s),
                                            "backoff": {"init_backoff": timedelta(milliseconds=100),
                                                        "max_backoff": timedelta(seconds=2), "base": 2}})

    def __repr__(self) -> str:
        return f"Bucket({self.url!r}, endpoint={self.endpoint!r})"

    def _error(self, what: str, key: str, e: Exception) -> DurableError:
        text = str(e)
        first = text.splitlines()[0] if text else type(e).__name__
        where = f"{self.url} (endpoint {self.endpoint})"
        if any(code in text for code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied",
                                         "403 Forbidden", "ExpiredToken")):
            return BucketDenied(f"bucket {self.name}: access denied to {where} while trying to {what} {key!r}: "
                                f"check the credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or the profile "
                                f"in ~/.aws/credentials)")
        if "NoSuchBucket" in text:
            return BucketDenied(f"bucket {self.name} does not exist at {self.endpoint}: create it or fix the "
                                f"durable location {self.url}")
        if isinstance(e, FileNotFoundError):
            return DurableError(f"{where}: no object {key!r}")
        if any(word in text for word in ("error sending request", "connect", "HTTP error", "timed out",
                                          "Connection", "builder error")):
            return BucketUnreachable(f"bucket {self.name} unreachable at {self.endpoint} while trying to {what} "
                                     f"{key!r}: {first[:200]}")
        return DurableError(f"{where}: cannot {what} {key!r}: {first[:300]}")

    def put(self, key: str, data: bytes | memoryview) -> None:
        """Write one small object in one PUT (atomic: readers see the old object or the new, never a part)."""
        import obstore

        self.limit.take(len(data))
        try:
            obstore.put(self._store, key, data, use_multipart=False)
        except Exception as e:  # noqa: BLE001 - translated into one line naming the bucket
            raise self._error("write", key, e) from None

    def put_chunks(self, key: str, chunks: Iterator[memoryview | bytes], concurrency: int = 4) -> None:
        """Write a large object by multipart upload from ``chunks``, each paced by the upload cap. The object
        appears only when the last part is in: an interrupted upload leaves none (the server drops its parts)."""
        import obstore

        def paced() -> Iterator[memoryview | bytes]:
            for chunk in chunks:
                self.limit.take(len(chunk))
                yield chunk
        try:
            obstore.put(self._store, key, paced(), chunk_size=UPLOAD_PART_BYTES, max_concurrency=concurrency)
        except Exception as e:  # noqa: BLE001
            raise self._error("upload", key, e) from None

    def get(self, key: str) -> bytes:
        import obstore

        try:
            return bytes(obstore.get(self._store, key).bytes())
        except Exception as e:  # noqa: BLE001
            raise self._error("read", key, e) from None

    def get_ranges(self, key: str, ranges: list[tuple[int, int]]) -> list[memoryview]:
        """Bytes [start, end) of ``key`` for each range, fetched concurrently."""
        import obstore

        if not ranges:
            return []
        try:
            got = obstore.get_ranges(self._store, key, starts=[a for a, _ in ranges], ends=[b for _, b in ranges])
        except Exception as e:  # noqa: BLE001
            raise self._error("read ranges of", key, e) from None
        return [memoryview(g) for g in got]

    def exists(self, key: str) -> bool:
        import obstore

        try:
            obstore.head(self._store, key)
            return True
        except FileNotFoundError as e:
            if "NoSuchBucket" in str(e):
                raise self._error("look up", key, e) from None
            return False
        except Exception as e:  # noqa: BLE001
            raise self._error("look up", key, e) from None

    def keys(self, prefix: str) -> list[str]:
        """Keys under ``prefix`` (relative to the job's prefix), sorted."""
        import obstore

        try:
            return sorted(meta["path"] for batch in obstore.list(self._store, prefix) for meta in batch)
        except Exception as e:  # noqa: BLE001
            raise self._error("list", prefix, e) from None

    def delete(self, keys: list[str]) -> None:
        import obstore

        if not keys:
            return
        try:
            obstore.delete(self._store, keys)
        except Exception as e:  # noqa: BLE001
            raise self._error("delete", keys[0], e) from None
