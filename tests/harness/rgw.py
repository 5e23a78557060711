"""A real S3 store for tests and benchmarks: single-host Ceph RGW on loopback.

One monitor, one bluestore OSD on a sparse file and one RGW (beast frontend, HTTP and HTTPS
with a certificate signed by a CA made here), all under one temporary directory, no systemd,
no root-owned paths. The daemons run in the foreground as children of this process (killed by
PID by `stop`, and by the kernel if this process dies first), with free loopback ports.

Facts it relies on (Ceph 16.2 from Debian):
- `auth none` has no "secure" messenger mode, but daemons (radosgw) default
  `ms_mon_client_mode` to "secure" only and then loop on "get_initial_auth_request returned
  -13": every mode setting allows "crc" too.
- `ceph-mon --mkfs` needs a keyring even with auth none.
- One OSD: pool size 1, failure domain "osd" (chooseleaf type 0), small PG counts.

Nothing waits a fixed time: every step polls its condition until a deadline, and a daemon that
exits early fails the start at once with the tail of its log.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime
import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Optional

from harness.procs import free_ports

PACKAGES = ("ceph-mon", "ceph-osd", "radosgw", "ceph-common")
"""Debian packages that provide every binary below."""
BINARIES = (
    "ceph-mon",
    "ceph-osd",
    "radosgw",
    "ceph",
    "ceph-authtool",
    "monmaptool",
    "radosgw-admin",
)
INSTALL_HINT = f"apt-get install {' '.join(PACKAGES)}"
GiB = 1024**3


def missing_binaries() -> list[str]:
    """The Ceph binaries this machine lacks (empty: a store can be started)."""
    return [b for b in BINARIES if shutil.which(b) is None]


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the parent (the test session) dies, so a killed
    pytest never leaves a cluster behind."""
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def make_tls_files(root: Path) -> tuple[Path, Path, Path]:
    """A CA (ca.crt) and a server certificate it signed for 127.0.0.1 / localhost (rgw.crt,
    rgw.key). Clients trust ca.crt only, as they would a company's internal CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "jitckpt test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=7))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=7))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    paths = root / "ca.crt", root / "rgw.crt", root / "rgw.key"
    paths[0].write_bytes(ca.public_bytes(pem))
    paths[1].write_bytes(cert.public_bytes(pem))
    paths[2].write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    paths[2].chmod(0o600)
    return paths


@dataclasses.dataclass
class CephRGW:
    """A single-host Ceph cluster serving S3 on 127.0.0.1 (see the module docstring)."""

    root: Path
    access_key: str
    secret_key: str
    block_size: int = 20 * GiB
    """Size of the OSD's block file (sparse: only written bytes take disk space)."""
    osd_memory_target: int = 1 * GiB

    http_port: int = 0
    https_port: int = 0
    start_seconds: float = 0.0
    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    """Seconds per start-up phase (mon, osd, rgw, user), for reports."""
    _procs: dict[str, subprocess.Popen[bytes]] = dataclasses.field(default_factory=dict)

    @property
    def http_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def https_endpoint(self) -> str:
        return f"https://127.0.0.1:{self.https_port}"

    @property
    def ca_bundle(self) -> Path:
        """The CA that signed the HTTPS endpoint's certificate (AWS_CA_BUNDLE)."""
        return self.root / "ca.crt"

    @property
    def cert(self) -> tuple[Path, Path]:
        """The HTTPS endpoint's certificate and key (a TLS proxy in front of it reuses them)."""
        return self.root / "rgw.crt", self.root / "rgw.key"

    @property
    def conf(self) -> Path:
        return self.root / "ceph.conf"

    # -- start ---------------------------------------------------------------------------------

    def start(self, timeout: float = 240.0, attempts: int = 2) -> CephRGW:
        """Start mon, OSD and RGW and create the S3 user; retried once from scratch (a port
        chosen free can be taken by someone else before the daemon binds it)."""
        absent = missing_binaries()
        if absent:
            raise RuntimeError(f"Ceph is not installed ({', '.join(absent)}); {INSTALL_HINT}")
        for attempt in range(attempts):
            try:
                self._start(timeout)
            except Exception:
                self.stop()
                if attempt + 1 == attempts:
                    raise
                shutil.rmtree(self.root, ignore_errors=True)
            else:
                return self
        raise AssertionError("unreachable")

    def _start(self, timeout: float) -> None:
        started = time.monotonic()
        deadline = started + timeout
        self.root.mkdir(parents=True, exist_ok=True)
        for sub in ("mon.a", "osd.0", "run", "log"):
            (self.root / sub).mkdir(exist_ok=True)
        mon_port, mon_port1, self.http_port, self.https_port = free_ports(4)
        make_tls_files(self.root)
        fsid = str(uuid.uuid4())
        self.conf.write_text(self._config(fsid, mon_port, mon_port1))

        mark = time.monotonic()
        keyring = str(self.root / "keyring")
        self._tool(["ceph-authtool", "--create-keyring", keyring, "--gen-key", "-n", "mon."])
        caps = ["--cap", "mon", "allow *", "--cap", "osd", "allow *", "--cap", "mgr", "allow *"]
        self._tool(["ceph-authtool", keyring, "--gen-key", "-n", "client.admin", *caps])
        monmap = str(self.root / "monmap")
        addrs = f"[v2:127.0.0.1:{mon_port},v1:127.0.0.1:{mon_port1}]"
        self._tool(
            ["monmaptool", "--create", "--clobber", "--fsid", fsid, "--addv", "a", addrs, monmap]
        )
        self._tool(
            ["ceph-mon", *self._c(), "-i", "a", "--mkfs", "--monmap", monmap, "--keyring", keyring]
        )
        self._daemon("mon", ["ceph-mon", *self._c(), "-f", "-i", "a"])
        self._wait(lambda: _listening(mon_port), deadline, "the monitor to listen")
        osd_uuid = str(uuid.uuid4())
        osd_id = self._tool(
            [
                "ceph",
                *self._c(),
                "--connect-timeout",
                str(int(max(5, deadline - time.monotonic()))),
                "osd",
                "new",
                osd_uuid,
            ],
            deadline,
        ).strip()
        if osd_id != "0":
            raise RuntimeError(f"expected OSD id 0, got {osd_id!r}")
        self.phases["mon"] = time.monotonic() - mark

        mark = time.monotonic()
        self._tool(["ceph-osd", *self._c(), "-i", "0", "--mkfs", "--osd-uuid", osd_uuid], deadline)
        self._daemon("osd", ["ceph-osd", *self._c(), "-f", "-i", "0"])
        self.phases["osd mkfs"] = time.monotonic() - mark

        # RGW waits for the OSD itself (its pools are created on first start).
        mark = time.monotonic()
        self._daemon("rgw", ["radosgw", *self._c(), "-f", "-n", "client.rgw.a"])
        self._wait(self._rgw_answers, deadline, "RGW to answer HTTP")
        self.phases["osd up + rgw"] = time.monotonic() - mark

        mark = time.monotonic()
        self.admin(
            "user",
            "create",
            "--uid=jitckpt",
            "--display-name=jitckpt tests",
            f"--access-key={self.access_key}",
            f"--secret-key={self.secret_key}",
        )
        self.phases["user"] = time.monotonic() - mark
        self.start_seconds = time.monotonic() - started

    def _c(self) -> list[str]:
        return ["-c", str(self.conf)]

    def _config(self, fsid: str, mon_port: int, mon_port1: int) -> str:
        root = self.root
        crt, key = self.cert
        frontend = (
            f"beast endpoint=127.0.0.1:{self.http_port} ssl_endpoint=127.0.0.1:{self.https_port}"
            f" ssl_certificate={crt} ssl_private_key={key}"
        )
        return f"""\
[global]
fsid = {fsid}
mon host = [v2:127.0.0.1:{mon_port},v1:127.0.0.1:{mon_port1}]
mon initial members = a
public network = 127.0.0.0/8
auth cluster required = none
auth service required = none
auth client required = none
keyring = {root}/keyring
run dir = {root}/run
admin socket = {root}/run/$name.asok
log file = {root}/log/$name.log
pid file = {root}/run/$name.pid
log to stderr = false
err to stderr = true
# one OSD: size 1, no host-level failure domain, small PG counts
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon allow pool delete = true
mon max pg per osd = 1000
mon warn on pool no redundancy = false
# every map change (OSD boot, each RGW pool) is a Paxos round: propose at once, not after 1 s
paxos propose interval = 0.01
paxos min wait = 0.001
# RGW's first requests go out before the OSD is up; they are resent on the objecter's tick
objecter tick interval = 0.2
ms bind ipv4 = true
ms bind ipv6 = false
# auth none has no "secure" mode; daemons default to "secure" only (see the module docstring)
ms mon client mode = crc secure
ms client mode = crc secure

[mon]
mon data = {root}/mon.$id
mon cluster log file = {root}/log/cluster.log

[osd]
osd data = {root}/osd.$id
osd objectstore = bluestore
osd crush update on start = true
osd memory target = {self.osd_memory_target}
bluestore cache autotune = true
bluestore block create = true
bluestore block size = {self.block_size}
bluestore block db create = false
bluestore block wal create = false
bluestore fsck on mkfs = false
bluestore fsck on mount = false
osd op num threads per shard = 1
osd op num shards = 2

[client.rgw.a]
rgw frontends = {frontend}
rgw dns name = localhost
rgw thread pool size = 64
rgw enable usage log = false
# deleted objects are garbage-collected after seconds, not hours: suites and benchmarks
# write and delete many GB, and the OSD's block file is finite
rgw gc obj min wait = 1
rgw gc processor period = 5
"""

    def _tool(self, argv: Sequence[str], deadline: Optional[float] = None) -> str:
        timeout = 120.0 if deadline is None else max(5.0, deadline - time.monotonic())
        # `ceph` is a script of the system's python3: nothing of ours on its path.
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        env["CEPH_CONF"] = str(self.conf)
        try:
            done = subprocess.run(
                list(argv), env=env, capture_output=True, text=True, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{argv[0]} did not finish in {timeout:.0f} s: {argv}") from None
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()[-1500:]}"
                f"{self._logs()}"
            )
        return done.stdout

    def _daemon(self, name: str, argv: Sequence[str]) -> None:
        out = open(self.root / "log" / f"{name}.out", "wb")  # noqa: SIM115 - the child keeps it
        try:
            self._procs[name] = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,  # noqa: PLW1509 - no threads of ours fork meanwhile
                start_new_session=True,
            )
        finally:
            out.close()

    def _rgw_answers(self) -> bool:
        try:
            with urllib.request.urlopen(self.http_endpoint + "/", timeout=2) as r:  # noqa: S310 - loopback
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def _wait(self, predicate: Any, deadline: float, what: str) -> None:
        delay = 0.05
        while not predicate():
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited ({proc.returncode}) while waiting for {what}{self._logs()}"
                    )
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}{self._logs()}")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)

    def _logs(self) -> str:
        out = []
        for path in sorted((self.root / "log").glob("*")):
            with contextlib.suppress(OSError):
                tail = path.read_text(errors="replace").splitlines()[-15:]
                out.append(f"\n--- {path.name}\n" + "\n".join(tail))
        return "".join(out)

    # -- use -----------------------------------------------------------------------------------

    def admin(self, *args: str) -> str:
        """radosgw-admin against this cluster (JSON on stdout for most commands)."""
        return self._tool(["radosgw-admin", *self._c(), *args])

    def gc(self) -> None:
        """Garbage-collect deleted objects now (frees the OSD's space at once)."""
        self.admin("gc", "process", "--include-all")

    def rss(self) -> dict[str, int]:
        """Resident memory of each daemon, bytes."""
        out = {}
        for name, proc in self._procs.items():
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        out[name] = int(line.split()[1]) * 1024
        return out

    def pids(self) -> dict[str, int]:
        return {name: proc.pid for name, proc in self._procs.items()}

    def client(self, endpoint: Optional[str] = None, **config: Any) -> Any:
        """A boto3 client for the store (HTTPS through the CA unless `endpoint` says http)."""
        import boto3
        from botocore.config import Config

        endpoint = endpoint or self.https_endpoint
        settings: dict[str, Any] = {
            "request_checksum_calculation": "when_required",
            "response_checksum_validation": "when_required",
            "retries": {"mode": "standard", "max_attempts": 3},
            "s3": {"addressing_style": "path"},
        }
        settings.update(config)
        return boto3.session.Session(
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name="us-east-1",
        ).client(
            "s3",
            endpoint_url=endpoint,
            verify=str(self.ca_bundle) if endpoint.startswith("https") else None,
            config=Config(**settings),
        )

    # -- stop ----------------------------------------------------------------------------------

    def stop(self) -> None:
        """SIGKILL the daemons by PID (their data is thrown away, so no clean shutdown)."""
        for proc in reversed(list(self._procs.values())):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
        for proc in self._procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
        self._procs.clear()


@contextlib.contextmanager
def running(root: Path, access_key: str, secret_key: str, **kwargs: Any) -> Iterator[CephRGW]:
    """A started CephRGW under `root`, stopped (and `root` removed) on exit."""
    store = CephRGW(root, access_key, secret_key, **kwargs)
    try:
        yield store.start()
    finally:
        store.stop()
        shutil.rmtree(root, ignore_errors=True)
