"""A throwaway PostgreSQL server for the tests: initdb into a temporary directory, started with
pg_ctl on a free loopback port (as the `postgres` user when the tests run as root: initdb refuses
root), trust authentication for the local user `fa4tune`, stopped and deleted at the end.

Without the PostgreSQL binaries (or the psycopg driver) the tests that need it are skipped with the
reason, unless FA4TUNE_REQUIRE_POSTGRES=1 (set by .ci/run), which makes them fail instead."""

from __future__ import annotations

import glob
import importlib.util
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

REQUIRED = os.environ.get("FA4TUNE_REQUIRE_POSTGRES") == "1"
USER = "fa4tune"


def unavailable(reason: str):
    """Skip, or fail where PostgreSQL is required."""
    if REQUIRED:
        pytest.fail(f"FA4TUNE_REQUIRE_POSTGRES=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def find_bindir() -> Path | None:
    """The directory of initdb and pg_ctl: on PATH, else Debian's
    /usr/lib/postgresql/VERSION/bin."""
    initdb = shutil.which("initdb")
    if initdb:
        return Path(initdb).resolve().parent
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: (
            int(Path(p).parent.parent.name) if Path(p).parent.parent.name.isdigit() else 0
        ),
    )
    return Path(found[-1]).parent if found else None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    def __init__(self) -> None:
        if importlib.util.find_spec("psycopg") is None:
            unavailable(
                "the PostgreSQL driver psycopg is not installed (pip install 'fa4tune[postgres]')"
            )
        bindir = find_bindir()
        if bindir is None:
            unavailable("PostgreSQL server binaries (initdb, pg_ctl) are not installed")
        self.user = None
        if os.geteuid() == 0:  # initdb refuses root: the server runs as the postgres user
            try:
                self.user = pwd.getpwnam("postgres")
            except KeyError:
                unavailable(
                    "the tests run as root and there is no 'postgres' user to run the server as"
                )
        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix="fa4tune-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        if self.user is not None:
            os.chown(self.root, self.user.pw_uid, self.user.pw_gid)
        self._run(
            "initdb", "-D", str(self.data), "-U", USER, "--auth=trust", "-E", "UTF8", "--no-sync"
        )
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.root} -c max_connections=300 "
            "-c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        )
        self._run(
            "pg_ctl",
            "-D",
            str(self.data),
            "-l",
            str(self.root / "server.log"),
            "-w",
            "-t",
            "60",
            "-o",
            options,
            "start",
        )

    def _run(self, program: str, *args: str) -> None:
        result = subprocess.run(
            [str(self.bindir / program), *args],
            cwd=self.root,
            capture_output=True,
            text=True,
            user=self.user.pw_uid if self.user else None,
            group=self.user.pw_gid if self.user else None,
        )
        if result.returncode != 0:
            log = self.root / "server.log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise RuntimeError(
                f"{program} failed ({result.returncode}): {result.stdout}{result.stderr}{tail}"
            )

    def url(self, database: str) -> str:
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        import psycopg

        with psycopg.connect(self.url("postgres"), autocommit=True) as connection:
            connection.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
