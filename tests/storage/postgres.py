"""A real PostgreSQL server for the fleet tests, started by the tests themselves: Debian's server binaries
(`.ci/setup` installs the package when they are missing), a fresh cluster in a temporary folder, listening on
127.0.0.1 on a free port, trust authentication, stopped at the end. PostgreSQL refuses to run as root, so as root
the cluster belongs to the package's `postgres` user and every server command runs as it (subprocess's own user
switch: no runuser, which a PATH without /usr/sbin does not find)."""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path


def server_binaries() -> Path | None:
    """The newest installed PostgreSQL's bin/ with initdb and pg_ctl, or None."""
    for d in sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: int(p.parent.name), reverse=True):
        if (d / "initdb").exists() and (d / "pg_ctl").exists():
            return d
    found = shutil.which("pg_ctl")
    return Path(found).parent if found and (Path(found).parent / "initdb").exists() else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class PostgresServer:
    folder: Path
    port: int
    bin: Path
    user: str | None  # the OS user the server runs as (None: this one)

    def _run(self, *argv: str) -> subprocess.CompletedProcess[str]:
        as_user: dict[str, object] = {}
        if self.user:
            entry = pwd.getpwnam(self.user)
            as_user = {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": [],
                       "env": {**os.environ, "HOME": entry.pw_dir, "USER": self.user, "LOGNAME": self.user}}
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=120, check=False,
                              cwd=self.folder, **as_user)  # type: ignore[call-overload]

    @property
    def admin_url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def create_database(self, name: str) -> str:
        """A fresh database for one test; its SQLAlchemy URL."""
        import sqlalchemy as sa

        engine = sa.create_engine(self.admin_url, isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as con:
                con.execute(sa.text(f'CREATE DATABASE "{name}"'))
        finally:
            engine.dispose()
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.folder / "data"), "-m", "immediate", "stop")
        shutil.rmtree(self.folder, ignore_errors=True)


def start_postgres() -> PostgresServer:
    """initdb a cluster and start its server on 127.0.0.1; raises RuntimeError with the server's log on failure."""
    bin_dir = server_binaries()
    if bin_dir is None:
        raise RuntimeError("no PostgreSQL server binaries (initdb, pg_ctl): .ci/setup installs Debian's postgresql")
    folder = Path(tempfile.mkdtemp(prefix="fitter-pg-"))
    user = None
    if os.geteuid() == 0:
        user = "postgres"
        entry = pwd.getpwnam(user)
        os.chown(folder, entry.pw_uid, entry.pw_gid)
    server = PostgresServer(folder, _free_port(), bin_dir, user)
    data, log = folder / "data", folder / "server.log"
    init = server._run(str(bin_dir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync")
    if init.returncode != 0:
        raise RuntimeError(f"initdb failed: {init.stderr.strip() or init.stdout.strip()}")
    options = f"-p {server.port} -k {folder} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
    start = server._run(str(bin_dir / "pg_ctl"), "-D", str(data), "-o", options, "-l", str(log), "-w", "start")
    if start.returncode != 0:
        text = log.read_text() if log.exists() else start.stderr
        shutil.rmtree(folder, ignore_errors=True)
        raise RuntimeError(f"PostgreSQL did not start: {text.strip()[-2000:]}")
    return server
