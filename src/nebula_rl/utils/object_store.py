"""Folders in S3-compatible object storage (AWS, MinIO, SeaweedFS, ...), through boto3.

A folder is uploaded file by file, then committed by a marker object (`<name>/COMMITTED`)
written last: a folder without its marker is half there (an upload that failed or is still
running) and is never listed, downloaded or resumed from. Removal deletes the marker first.

Credentials come from the environment, never from a config file: the seeds' and cosmos-rl's
`PROD_S3_CHECKPOINT_ACCESS_KEY_ID`, `..._SECRET_ACCESS_KEY`, `..._ENDPOINT_URL` and
`..._REGION_NAME`, else boto3's own chain (`AWS_ACCESS_KEY_ID`, `AWS_ENDPOINT_URL`, a profile...).

:class:`Uploader` uploads in a background thread (training does not wait) and retries a failed
upload until it succeeds, so a storage server that goes away and comes back loses nothing, and
copies a folder's changed files on a clock of its own (logs and metrics that grow).
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["COMMITTED", "CREDENTIAL_ENV", "ObjectStore", "StorageError", "Uploader"]

log = logging.getLogger(__name__)

COMMITTED = "COMMITTED"
"""The marker object that makes an uploaded folder complete."""
CREDENTIAL_ENV = "PROD_S3_CHECKPOINT_"
"""Prefix of the environment variables of the storage's credentials (cosmos-rl's)."""


class StorageError(RuntimeError):
    """The object storage refused or could not be reached (names the bucket and the key)."""


@dataclass(frozen=True, slots=True)
class _Credentials:
    access_key_id: str | None
    secret_access_key: str | None
    endpoint_url: str | None
    region_name: str | None

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> _Credentials:
        """`PROD_S3_CHECKPOINT_*`, each falling back to its AWS variable (None: boto3's
        default chain decides)."""

        def read(name: str, *aws: str) -> str | None:
            for key in (CREDENTIAL_ENV + name, *aws):
                if env.get(key):
                    return env[key]
            return None

        return cls(
            read("ACCESS_KEY_ID", "AWS_ACCESS_KEY_ID"),
            read("SECRET_ACCESS_KEY", "AWS_SECRET_ACCESS_KEY"),
            read("ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"),
            read("REGION_NAME", "AWS_REGION", "AWS_DEFAULT_REGION"),
        )


class ObjectStore:
    """The folders under `s3://<bucket>/<prefix>/`; `key` names the config key of the bucket
    in errors."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        key: str = "s3_bucket",
        env: Mapping[str, str] | None = None,
    ) -> None:
        try:
            import boto3
            from botocore.config import Config as BotoConfig
        except ImportError as err:
            raise StorageError(
                f"{key} = {bucket!r}: S3 storage needs boto3 (pip install 'nebula-rl[s3]')"
            ) from err

        self.bucket, self.prefix, self.key = bucket, prefix.strip("/"), key
        creds = _Credentials.from_env(os.environ if env is None else env)
        self.endpoint = creds.endpoint_url
        self._client: Any = boto3.session.Session().client(
            "s3",
            aws_access_key_id=creds.access_key_id,
            aws_secret_access_key=creds.secret_access_key,
            endpoint_url=creds.endpoint_url,
            region_name=creds.region_name or "us-east-1",
            # (a stopped server fails a call in seconds; the Uploader retries the folder)
            config=BotoConfig(
                connect_timeout=5, read_timeout=60, retries={"max_attempts": 2, "mode": "standard"}
            ),
        )

    def __repr__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    def _object(self, name: str) -> str:
        return "/".join(part for part in (self.prefix, name.strip("/")) if part)

    def check(self) -> None:
        """Raise a StorageError unless the bucket is reachable with these credentials."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self._client.head_bucket(Bucket=self.bucket)
        except ClientError as err:
            code = err.response.get("Error", {}).get("Code", "")
            why = {
                "403": "access denied: check the credentials",
                "404": "no such bucket",
            }.get(code, str(err))
            raise StorageError(self._message(why)) from err
        except BotoCoreError as err:
            raise StorageError(self._message(f"unreachable: {err}")) from err

    def _message(self, why: str) -> str:
        where = f" at {self.endpoint}" if self.endpoint else ""
        return (
            f"{self.key} = {self.bucket!r}{where}: {why} (credentials come from "
            f"{CREDENTIAL_ENV}ACCESS_KEY_ID / SECRET_ACCESS_KEY / ENDPOINT_URL / REGION_NAME, "
            "else the AWS_* variables)"
        )

    def list_objects(self, under: str) -> list[str]:
        """The keys of the bucket's objects below `under` (a key prefix; the store's prefix is
        not applied), sorted."""
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=under
        )
        return sorted(item["Key"] for page in pages for item in page.get("Contents", []))

    def open_object(self, key: str) -> Any:
        """The object `key` of the bucket (the store's prefix is not applied) as a stream of
        bytes (`read`, `close`), read as it arrives."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return self._client.get_object(Bucket=self.bucket, Key=key)["Body"]
        except ClientError as err:
            code = err.response.get("Error", {}).get("Code", "")
            why = {"403": "access denied: check the credentials", "NoSuchKey": "no such object"}
            raise StorageError(self._message(f"{key}: {why.get(code, str(err))}")) from err
        except BotoCoreError as err:
            raise StorageError(self._message(f"unreachable: {err}")) from err

    def upload_folder(self, local: Path | Mapping[str, Path], name: str) -> None:
        """Upload every file under `local` to `<name>/...`, then commit it. `local` may also
        map names within the folder to files (a folder made of files that live apart)."""
        for relative, path in sorted(folder_files(local).items()):
            self._client.upload_file(str(path), self.bucket, self._object(f"{name}/{relative}"))
        self._client.put_object(Bucket=self.bucket, Key=self._object(f"{name}/{COMMITTED}"))

    def _keys(self, name: str) -> list[str]:
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self._object(name) + "/"
        )
        return [item["Key"] for page in pages for item in page.get("Contents", [])]

    def committed(self, under: str = "") -> list[str]:
        """The committed folders below `under` (names relative to the prefix), sorted."""
        start = self._object(under)
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=f"{start}/" if start else ""
        )
        base = f"{self.prefix}/" if self.prefix else ""
        names = [
            item["Key"].removeprefix(base).removesuffix(f"/{COMMITTED}")
            for page in pages
            for item in page.get("Contents", [])
            if item["Key"].endswith(f"/{COMMITTED}")
        ]
        return sorted(names)

    def download_folder(self, name: str, local: Path) -> Path:
        """Download the committed folder `name` as the folder `local` (which must not exist);
        `local`."""
        keys = self._keys(name)
        marker = self._object(f"{name}/{COMMITTED}")
        if marker not in keys:
            raise StorageError(self._message(f"{name} is not a committed folder"))
        base = self._object(name) + "/"
        # (into a folder beside it, renamed when whole: `local` is complete or absent)
        partial = local.with_name(local.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        for key in keys:
            if key == marker:
                continue
            target = partial / key.removeprefix(base)
            target.parent.mkdir(parents=True, exist_ok=True)
            self._client.download_file(self.bucket, key, str(target))
        partial.mkdir(parents=True, exist_ok=True)
        os.replace(partial, local)
        return local

    def download_file(self, name: str, local: Path) -> bool:
        """Download the plain object `name` (a synced file, `sync_files`) to `local`, written
        beside it and renamed when whole; False when there is no such object."""
        from botocore.exceptions import ClientError

        partial = local.with_name(local.name + ".partial")
        local.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._client.download_file(self.bucket, self._object(name), str(partial))
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") in ("404", "NoSuchKey"):
                return False
            raise
        os.replace(partial, local)
        return True

    def sync_files(
        self,
        local: Path,
        name: str,
        *,
        skip: tuple[str, ...] = (),
        seen: dict[str, tuple[int, int]] | None = None,
    ) -> int:
        """Copy the files under `local` (but its top-level folders `skip`) to `<name>/...` as
        plain objects, not committed (logs and metrics that grow); with `seen`, only the files
        whose size or modification time changed since it recorded them. How many were copied."""
        seen = {} if seen is None else seen
        copied = 0
        for path in sorted(p for p in local.rglob("*") if p.is_file()):
            relative = path.relative_to(local)
            if relative.parts[0] in skip:
                continue
            stat = path.stat()
            stamp = (stat.st_size, stat.st_mtime_ns)
            key = relative.as_posix()
            if seen.get(key) == stamp:
                continue
            self._client.upload_file(str(path), self.bucket, self._object(f"{name}/{key}"))
            seen[key] = stamp
            copied += 1
        return copied

    def delete_folder(self, name: str) -> None:
        """Remove the folder `name`: its marker first, so that it is never half there and
        listed."""
        marker = self._object(f"{name}/{COMMITTED}")
        self._client.delete_object(Bucket=self.bucket, Key=marker)
        for key in self._keys(name):
            self._client.delete_object(Bucket=self.bucket, Key=key)


def folder_files(local: Path | Mapping[str, Path]) -> dict[str, Path]:
    """The files of an upload: those under the folder `local` by their relative names, or
    `local` itself when it maps names to files (a folder under a name beside each: every file
    below it)."""
    if isinstance(local, Path):
        local = {".": local}
    files = {}
    for name, path in local.items():
        if path.is_dir():
            for file in path.rglob("*"):
                if file.is_file():
                    relative = file.relative_to(path).as_posix()
                    files[relative if name == "." else f"{name}/{relative}"] = file
        else:
            files[name] = path
    return files


class Uploader:
    """Uploads folders to `store` in a background thread, in order, each retried after
    `retry_s` seconds (doubling up to `max_retry_s`) until it is committed."""

    def __init__(
        self, store: ObjectStore, *, retry_s: float = 1.0, max_retry_s: float = 60.0
    ) -> None:
        self.store, self.retry_s, self.max_retry_s = store, retry_s, max_retry_s
        self.uploaded: list[str] = []
        """Names committed so far, in order."""
        self.synced = 0
        """Files copied by `sync` so far."""
        self._seen: dict[str, tuple[int, int]] = {}  # (the synced files' size and mtime)
        self._every: tuple[float, tuple[Path, str, tuple[str, ...]]] | None = None
        self._due = 0.0
        self._jobs: queue.Queue[tuple[str, Any] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="s3-uploader", daemon=True)
        self._thread.start()

    def upload(self, local: Path | Mapping[str, Path], name: str) -> None:
        """Queue the folder `local` (or the files it maps, `ObjectStore.upload_folder`) for
        `<name>/`; it must not change until it is committed."""
        self._jobs.put(("upload", (local, name)))

    def delete(self, name: str) -> None:
        """Queue the removal of `name` (after the uploads queued before it)."""
        self._jobs.put(("delete", name))

    def sync(self, local: Path, name: str, *, skip: tuple[str, ...] = ()) -> None:
        """Queue a copy of `local`'s changed files (`ObjectStore.sync_files`) to `<name>/`."""
        self._jobs.put(("sync", (local, name, skip)))

    def sync_every(
        self, interval_s: float, local: Path, name: str, *, skip: tuple[str, ...] = ()
    ) -> None:
        """`sync` `local` now, and again every `interval_s` seconds (when no other job is
        queued) until `close`."""
        self._every = (interval_s, (local, name, skip))
        self._due = time.monotonic() + interval_s
        self.sync(local, name, skip=skip)  # (which also wakes the thread to the clock)

    def _next(self) -> tuple[str, Any] | None:
        """The next queued job, or a periodic sync when it falls due first."""
        while True:
            if self._every is None:
                return self._jobs.get()
            try:
                return self._jobs.get(timeout=max(0.0, self._due - time.monotonic()))
            except queue.Empty:
                every = self._every  # (close may clear it meanwhile)
                if every is not None:
                    self._due = time.monotonic() + every[0]
                    self._jobs.put(("sync", every[1]))

    def _run(self) -> None:
        while (job := self._next()) is not None:
            kind, arg = job
            wait = self.retry_s
            while True:
                if kind == "upload" and not _exists(arg[0]):  # (rotated away before its turn)
                    log.info("not uploading %s: it was removed", arg[1])
                    break
                try:
                    if kind == "upload":
                        self.store.upload_folder(*arg)
                        self.uploaded.append(arg[1])
                        log.info("uploaded %s to %s", arg[1], self.store)
                    elif kind == "sync":
                        local, name, skip = arg
                        self.synced += self.store.sync_files(
                            local, name, skip=skip, seen=self._seen
                        )
                    else:
                        self.store.delete_folder(arg)
                    break
                except Exception as err:  # (the server is away: retry, losing nothing)
                    log.warning("%s %s to %s failed (%s); retrying in %.0f s", kind, arg,
                                self.store, err, wait)  # fmt: skip
                    time.sleep(wait)
                    wait = min(2 * wait, self.max_retry_s)
            self._jobs.task_done()
        self._jobs.task_done()

    def close(self) -> None:
        """Wait until everything queued is uploaded (or removed), then stop the thread."""
        self._every = None
        self._jobs.put(None)
        self._thread.join()


def _exists(local: Path | Mapping[str, Path]) -> bool:
    return local.exists() if isinstance(local, Path) else all(p.exists() for p in local.values())
