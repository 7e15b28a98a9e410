"""Authentication, encryption and authorization of the links between roles (ZeroMQ CURVE).

``mooncake keys DIR`` writes one keypair per role kind: ``conductor``, ``worker``
(prefill and decode), ``store`` and ``frontend`` (``KIND.key`` public, ``KIND.key_secret``
secret). Frontends, the internet-facing processes, have keys of their own, one per frontend:
``mooncake keys DIR --frontend NAME`` (repeatable) writes ``frontend-NAME.key`` /
``frontend-NAME.key_secret`` instead of the one ``frontend.key`` pair. A frontend whose node
id is NAME loads ``frontend-NAME.key_secret`` where there is one, else ``frontend.key_secret``;
it never needs the conductor's secret (a conductor that serves the API itself loads a frontend
key for it too). A role loads the secret of its own kind and the public keys of all kinds (every
``frontend*.key``); a machine only needs the secrets of the kinds it runs (docs/operations.md, Security).

Every socket that binds (conductor, store, worker orders, decode KV ingress, frontend tokens) is
a CURVE server whose ZAP authenticator admits only the public keys in the directory and tags each
connection with its kind: every received frame carries ``User-Id`` =
``"KIND:<z85 public key>"`` (``peer_of``). Servers authorize by kind: the conductor registers
prefill/decode only from worker keys, stores only from store keys and frontends only from
frontend keys, and a node id held by a live node under another key or another process start
(``NodeInfo.instance``) is refused (``conductor/membership.py``); a store takes Put from workers
(and stores replicating) and Keep/Replicate/Remove only from the conductor; a worker takes orders
(``roles/orders.py``) only from frontend keys; a decode takes KV only from workers. Every socket
that connects presents its kind's key and checks the server's (``client(sock, server_kind)``);
a decode streams tokens to a frontend under the key that frontend ordered with (``vouch``).

Off loopback, roles refuse to start without keys unless ``[security]
allow_insecure_network`` is set (``check_network``).
"""

from __future__ import annotations

import ipaddress
import logging
import re
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils import z85

log = logging.getLogger(__name__)

KINDS = ("conductor", "worker", "store", "frontend")
ROLE_KIND = {"conductor": "conductor", "frontend": "frontend", "prefill": "worker", "decode": "worker", "colocated": "worker", "store": "store"}
_NAME = re.compile(r"^[-._a-zA-Z0-9]+$")
MAX_VOUCHED = 4096  # frontend endpoints whose key a worker remembers


class CurveError(RuntimeError):
    """Keys missing, unreadable, or CURVE unsupported by this libzmq."""


class InsecureNetworkError(RuntimeError):
    """A role would talk to a non-loopback address without CURVE."""


def frontend_key_name(name: str = "") -> str:
    """The file stem of a frontend's key: ``frontend`` (the one shared pair), or ``frontend-NAME``."""
    if name and not _NAME.match(name):
        raise CurveError(f"frontend name {name!r} is not usable in a key file name (letters, digits, '-._')")
    return f"frontend-{name}" if name else "frontend"


def generate_keys(directory: str | Path, frontends: list[str] | tuple[str, ...] = (),
                  frontends_only: bool = False) -> list[Path]:
    """Write a new keypair per role kind into ``directory``, a frontend's per name in ``frontends``
    (none: the one ``frontend`` pair); ``frontends_only``: only the frontends' (added to a directory
    whose other keys stay); returns the secret key files."""
    d = Path(directory).expanduser()
    d.mkdir(parents=True, exist_ok=True)
    stems = [] if frontends_only else [k for k in KINDS if k != "frontend"]
    stems += [frontend_key_name(n) for n in frontends or [""]]
    secrets = []
    for stem in stems:
        _, secret = zmq.auth.create_certificates(str(d), stem)
        Path(secret).chmod(0o600)
        secrets.append(Path(secret))
    return secrets


class _KindAuthenticator(AsyncioAuthenticator):
    """ZAP handler: admits the known public keys; the User-Id it gives a connection names the
    key's kind (``KIND:z85key``)."""

    def __init__(self, ctx: zmq.asyncio.Context, kinds: dict[bytes, str]) -> None:
        super().__init__(ctx)
        self.kinds = kinds  # z85 public key -> kind

    def curve_user_id(self, client_public_key: bytes) -> str:
        z = z85.encode(client_public_key)
        return f"{self.kinds.get(z, 'unknown')}:{z.decode('ascii')}"


class Curve:
    """The CURVE keys of one role process (``role``: conductor, frontend, prefill, decode or store)."""

    def __init__(self, keys_dir: str | Path, role: str, name: str = "") -> None:
        """``name``: a frontend's node id (it loads ``frontend-NAME.key_secret`` where there is one)."""
        if not zmq.has("curve"):
            raise CurveError("this libzmq was built without CURVE support")
        if role not in ROLE_KIND:
            raise CurveError(f"no key kind for role {role!r}")
        self.kind = ROLE_KIND[role]
        self.keys_dir = Path(keys_dir).expanduser()
        hint = f"(create them with: mooncake keys {self.keys_dir})"
        secret_file = self.keys_dir / f"{self.kind}.key_secret"
        if self.kind == "frontend" and name and _NAME.match(name) and \
                (own := self.keys_dir / f"{frontend_key_name(name)}.key_secret").is_file():
            secret_file = own
        try:
            self.public, self.secret = zmq.auth.load_certificate(str(secret_file))
        except (OSError, ValueError) as e:
            raise CurveError(f"cannot read the {self.kind} key {secret_file}: {e} {hint}") from None
        if self.secret is None:
            raise CurveError(f"{secret_file} holds no secret key {hint}")
        self.publics: dict[str, bytes] = {}  # kind -> public key (frontend: ``frontend.key``, else the first)
        self.kinds: dict[bytes, str] = {}  # z85 public key -> kind
        for kind in KINDS:
            files = [self.keys_dir / f"{kind}.key"]
            if kind == "frontend":
                files = sorted(self.keys_dir.glob("frontend*.key"), key=lambda p: p.name != "frontend.key")
            for file in files or [self.keys_dir / "frontend.key"]:
                try:
                    public, _ = zmq.auth.load_certificate(str(file))
                except (OSError, ValueError) as e:
                    fix = f"(add frontend keys with: mooncake keys {self.keys_dir} --frontends-only)" \
                        if kind == "frontend" else hint
                    raise CurveError(f"cannot read the {kind} public key in {self.keys_dir}: {e} {fix}") from None
                self.publics.setdefault(kind, public)
                self.kinds[public] = kind
        self.vouched: dict[str, bytes] = {}  # endpoint -> the public key of the frontend that serves it
        self._auths: dict[int, AsyncioAuthenticator] = {}

    @classmethod
    def from_dir(cls, keys_dir: str, role: str, name: str = "") -> "Curve | None":
        return cls(keys_dir, role, name) if keys_dir else None

    def server(self, sock: zmq.Socket, ctx: zmq.Context) -> None:
        """Make ``sock`` (before bind) a CURVE server; starts ``ctx``'s authenticator once."""
        if id(ctx) not in self._auths:
            auth = _KindAuthenticator(ctx, self.kinds)
            auth.start()
            auth.configure_curve(domain="*", location=str(self.keys_dir))  # every *.key: all kinds
            self._auths[id(ctx)] = auth
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True

    def client(self, sock: zmq.Socket, server_kind: str, server_key: bytes | None = None) -> None:
        """Make ``sock`` (before connect) present this role's key to a CURVE server of ``server_kind``
        (``server_key``: that server's own public key, z85, where the kind has several)."""
        sock.curve_serverkey = server_key or self.publics[server_kind]
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret

    def vouch(self, endpoint: str, peer: str) -> None:
        """The frontend that sent an order under CURVE key ``peer`` (``KIND:key``) serves ``endpoint``
        (its token socket, bound under that key): what connects there expects that key."""
        if not endpoint or ":" not in peer:
            return
        if endpoint not in self.vouched and len(self.vouched) >= MAX_VOUCHED:
            self.vouched.pop(next(iter(self.vouched)))
        self.vouched[endpoint] = peer.split(":", 1)[1].encode("ascii")

    def stop(self) -> None:
        for auth in self._auths.values():
            auth.stop()
        self._auths.clear()


def peer_of(frame: Any) -> str:
    """The User-Id (``KIND:key``) of the CURVE peer a received frame came from; "" without CURVE."""
    try:
        return frame.get("User-Id") or ""
    except (zmq.ZMQError, AttributeError, TypeError):
        return ""


def kind_of(peer: str) -> str:
    return peer.split(":", 1)[0]


def allowed(curve: Curve | None, frame: Any, kinds: tuple[str, ...]) -> bool:
    """Whether the sender of ``frame`` is of one of ``kinds`` (always, on a link without CURVE)."""
    return curve is None or kind_of(peer_of(frame)) in kinds


# Which key kinds may send which store request (stores put to each other when they replicate).
STORE_ACCESS: dict[str, tuple[str, ...]] = {
    "Put": ("worker", "store"), "ShmPut": ("worker", "store"),
    "Get": ("worker", "store"), "GetLayers": ("worker", "store"), "ShmGet": ("worker", "store"), "Release": ("worker", "store"),
    "Exists": ("worker", "store", "conductor"), "PrefixQuery": ("worker", "store", "conductor"),
    "StatsQuery": ("worker", "store", "conductor"),
    "Remove": ("conductor",), "Replicate": ("conductor",), "Keep": ("conductor",),
}


def store_access_problem(curve: Curve | None, frame: Any, msg: Any) -> str | None:
    """Why the sender of ``frame`` may not make this store request, or None."""
    if curve is None:
        return None
    kinds = STORE_ACCESS.get(type(msg).__name__, ())
    kind = kind_of(peer_of(frame)) or "keyless"
    return None if kind in kinds else f"a {kind} key may not send {type(msg).__name__} to a store"


# ---------------------------------------------------------------- secure by default


def _host_of(endpoint: str) -> str | None:
    """The host of a ``tcp://HOST:PORT`` endpoint, or of a bare host; None for ipc:// and inproc://."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return None
    rest = endpoint.removeprefix("tcp://")
    if "://" in rest:
        return rest.split("://", 1)[1].rsplit(":", 1)[0]
    host = rest.rsplit(":", 1)[0] if rest.count(":") == 1 or rest.startswith("[") else rest
    return host.strip("[]").split(";")[-1]


def is_loopback(host: str) -> bool:
    if host in ("localhost", "") or host.startswith("localhost."):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name or an interface: may leave the machine


def check_network(role: str, endpoints: list[str], keys_dir: str, allow_insecure: bool) -> None:
    """Refuse a role whose endpoints leave the machine without CURVE keys (InsecureNetworkError)."""
    if keys_dir or allow_insecure:
        return
    exposed = [e for e in endpoints if (h := _host_of(e)) is not None and not is_loopback(h)]
    if exposed:
        raise InsecureNetworkError(
            f"the {role} would bind or connect to {', '.join(exposed)} (not loopback) without CURVE keys: "
            f"anyone on that network could join the cluster or read its KV. Create keys with "
            f"`mooncake keys DIR`, copy them to the machines (see README) and set [security] curve_keys_dir "
            f"(MOONCAKE_SECURITY_CURVE_KEYS_DIR), or, on a network you trust, set [security] "
            f"allow_insecure_network = true")


def role_endpoints(cfg: Any, role: str) -> list[str]:
    """What a role binds or connects to, as far as its config says (peers' endpoints come later)."""
    out = [cfg.conductor.endpoint]
    if role != "conductor":
        out.append(cfg.node.host)
    return out
