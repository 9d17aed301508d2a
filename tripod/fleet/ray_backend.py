"""Replicas as Ray actors: the same ``ReplicaLauncher`` / ``ReplicaProcess`` contract as
``LocalLauncher``, but each replica runs on whichever node of a Ray cluster has room for it.

One actor per replica. The actor owns nothing but a child process, ``tripod serve``, started with
``spawn_serve`` on a free port of its node, so the replica dies with the actor (PDEATHSIG) and the
actor's resources (``num_cpus``, ``num_gpus``, custom ``resources``) are what the replica holds.
The supervisor talks to the replica over HTTP like to any other; through the actor it only asks
whether the process has exited and sends it signals.

Ray is an optional dependency: this module imports it lazily, and ``RayLauncher`` says how to
install it when it is missing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

from tripod.fleet.process import SERVE, free_port, spawn_serve
from tripod.protocol.fleet import ReplicaStarted

# The exit code reported for a replica whose actor is gone (killed, crashed, or its node lost):
# the process is then gone too or about to be (PDEATHSIG), and nothing can tell us how it ended.
DEAD_ACTOR_EXIT_CODE = -9
POLL_TIMEOUT = 5.0  # seconds an exit-code query or a signal may wait for the actor to answer
LOG_TAIL_BYTES = 64 * 1024

_INSTALL_HINT = 'the Ray backend needs Ray: pip install "tripod[ray]"'


def import_ray() -> ModuleType:
    try:
        import ray
    except ImportError as e:
        raise ValueError(_INSTALL_HINT) from e
    return ray


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class ReplicaActor:
    """The Ray actor behind one replica. It owns the ``tripod serve`` child process on its node
    and that process's log file; the child dies with the actor's worker process (PDEATHSIG).

    NOTE: Ray runs the methods of an actor with ``max_concurrency=1`` on the worker's main thread,
    and PDEATHSIG fires when the *thread* that forked the child exits, so the child lives exactly
    as long as the worker process. Every method but ``kill_process`` returns at once, so an
    exit-code query is never stuck behind another call.
    """

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_path: Path | None = None

    def start(self, name: str, serve_args: list[str], bind_host: str | None, log_dir: str | None,
              command: tuple[str, ...] = SERVE) -> ReplicaStarted:
        """Start ``tripod serve`` on a free port of this node; what the driver needs to know of it."""
        import ray

        assert self._proc is None, "a replica actor starts one process"
        node_ip = ray.util.get_node_ip_address()
        host = bind_host or node_ip
        # A wildcard bind is reachable at the node's address, not at the wildcard.
        url_host = node_ip if host in ("0.0.0.0", "::") else host
        port = free_port("" if host == "::" else host)
        folder = Path(log_dir) if log_dir else Path(tempfile.gettempdir()) / "tripod-replicas"
        folder.mkdir(parents=True, exist_ok=True)
        self._log_path = folder / f"{name}.log"
        # NOTE: the child holds its own copy of the descriptor; ours can close right away.
        with open(self._log_path, "ab") as log:
            self._proc = spawn_serve(host, port, serve_args, log, command)
        return ReplicaStarted(url=_url(url_host, port), pid=self._proc.pid,
                              node_id=ray.get_runtime_context().get_node_id(), node_ip=node_ip,
                              log_path=str(self._log_path))

    def poll(self) -> int | None:
        """The process's exit code, or None while it runs."""
        assert self._proc is not None
        return self._proc.poll()

    def send_signal(self, sig: int) -> None:
        """Signal the process if it still runs (a reaped pid may already be someone else's)."""
        assert self._proc is not None
        if self._proc.poll() is None:
            self._proc.send_signal(sig)

    def kill_process(self, timeout: float) -> int | None:
        """SIGKILL the process and reap it; its exit code, or None if it outlived ``timeout``.

        The one method that waits: a SIGKILLed process is gone within milliseconds, and the
        driver must not see an exit code while the port still accepts connections.
        """
        assert self._proc is not None
        if self._proc.poll() is None:
            self._proc.kill()
        try:
            return self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def log_tail(self, max_bytes: int) -> str:
        """The last ``max_bytes`` of the replica's log."""
        if self._log_path is None or not self._log_path.exists():
            return ""
        with open(self._log_path, "rb") as f:
            f.seek(max(0, self._log_path.stat().st_size - max_bytes))
            return f.read().decode("utf-8", errors="replace")


def node_labels(ray: Any, node_id: str) -> dict[str, str]:
    """The labels of Ray node ``node_id`` (``ray start --labels``; ``region`` steers the router), or
    none where this Ray does not report them. Read on the driver, once per launch."""
    try:
        node = next((n for n in ray.nodes() if n.get("NodeID") == node_id), None)
    except Exception:  # a cluster that cannot list its nodes: no labels, not a failed launch
        return {}
    labels = (node or {}).get("Labels") or {}
    # Ray's own labels (ray.io/node-id, ...) are not routing labels.
    return {str(k): str(v) for k, v in labels.items() if not str(k).startswith("ray.io/")}


class RayReplica:
    """One replica launched by ``RayLauncher``: the handle of its actor and what the actor reported
    at start (URL, pid and log path of ``tripod serve`` on its node).

    Once the process is seen to have exited, its exit code is kept, the end of its log is fetched,
    and the actor is killed so that its CPUs/GPUs go back to the cluster for the replacement. An
    actor that is gone counts as an exit with ``DEAD_ACTOR_EXIT_CODE``.
    """

    def __init__(self, name: str, actor_name: str, actor: Any, info: ReplicaStarted) -> None:
        self.name = name  # ``replica-<index>``, as ``LocalProcess`` names it
        self.actor_name = actor_name  # unique in the Ray namespace
        self.url = info.url
        self.pid: int | None = info.pid
        self.node_id = info.node_id
        self.node_ip = info.node_ip
        self.log_path = info.log_path  # on the replica's node
        self.labels: dict[str, str] = {}  # its node's labels (node_labels)
        self._actor = actor
        self._code: int | None = None
        self._final_log: str | None = None
        self._lock = threading.Lock()  # the supervisor may poll from several threads

    @property
    def exited(self) -> bool:
        """Whether the replica has been seen to exit (asks no one)."""
        return self._code is not None

    def exit_code(self) -> int | None:
        return self._poll(POLL_TIMEOUT)

    def _poll(self, timeout: float) -> int | None:
        if self._code is not None:
            return self._code
        ray = import_ray()
        try:
            code = ray.get(self._actor.poll.remote(), timeout=timeout)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnavailableError):
            return None  # slow or briefly unreachable is not dead: ask again later
        except ray.exceptions.RayActorError:
            code = DEAD_ACTOR_EXIT_CODE
            self._final_log = self._final_log or (
                f"(the actor {self.actor_name} is gone; its log was {self.log_path} on node {self.node_id})"
            )
        if code is None:
            return None
        return self._record_exit(ray, code)

    def _record_exit(self, ray: ModuleType, code: int) -> int:
        with self._lock:
            if self._code is None:
                if self._final_log is None:
                    self._final_log = self.log_tail()
                self._code = code
                # The process has exited: the actor only holds resources now.
                ray.kill(self._actor, no_restart=True)
            return self._code

    def terminate(self) -> None:
        if self._code is not None:
            return
        ray = import_ray()
        try:
            ray.get(self._actor.send_signal.remote(int(signal.SIGTERM)), timeout=POLL_TIMEOUT)
        except ray.exceptions.RayError:
            pass  # a dead or unreachable actor: exit_code() will tell

    def kill(self) -> None:
        ray = import_ray()
        if self._code is None:
            # NOTE: killing the actor alone would give the process PDEATHSIG, which is SIGTERM
            # (a drain that may take the drain timeout); kill() means SIGKILL, so the actor sends
            # it and reaps the process first. Only if the actor cannot is it killed regardless.
            try:
                code = ray.get(self._actor.kill_process.remote(POLL_TIMEOUT), timeout=2 * POLL_TIMEOUT)
            except ray.exceptions.RayError:
                code = None
            if code is not None:
                self._record_exit(ray, code)
                return
        ray.kill(self._actor, no_restart=True)

    def wait(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            code = self._poll(max(0.1, min(POLL_TIMEOUT, remaining)))
            if code is not None or remaining <= 0:
                return code
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    def log_tail(self, max_bytes: int = LOG_TAIL_BYTES) -> str:
        """The end of the replica's log, read on its node (kept once the replica has exited)."""
        if self._final_log is not None:
            return self._final_log
        ray = import_ray()
        try:
            return str(ray.get(self._actor.log_tail.remote(max_bytes), timeout=POLL_TIMEOUT))
        except ray.exceptions.RayError as e:
            return f"(could not read {self.log_path} on node {self.node_id}: {type(e).__name__})"

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "url": self.url, "node_id": self.node_id, "pid": self.pid,
                "actor_name": self.actor_name, "log_path": self.log_path}


class RayLauncher:
    """Launches replicas as Ray actors. It owns the connection to Ray (and the local Ray instance
    when it started one, which ``close`` shuts down) and the handles of the replicas it launched
    until they are seen to have exited.

    ``address``: None starts a local Ray instance with all this machine's CPUs; ``"auto"`` joins the
    cluster this machine belongs to (``ray start``); ``"ray://host:10001"`` connects as a client.
    If Ray is already initialised in this process, that connection is used and left open.
    ``num_cpus``/``num_gpus``/``resources`` are what each replica's actor reserves; Ray sets
    ``OMP_NUM_THREADS`` and ``CUDA_VISIBLE_DEVICES`` from them, and the replica inherits both.
    ``bind_host``: the address replicas listen on (None: the node's IP, reachable from the other
    nodes). ``log_dir``: where each node writes replica logs (None: ``$TMPDIR/tripod-replicas``).
    ``launch_timeout``: seconds ``launch`` waits for a node with room for the actor.
    ``command``: the tripod subcommand each replica runs (default ``serve``; a chain's chainlets
    run ``chains worker``).
    Every node must have tripod installed in the same Python environment as this one.
    """

    blocking = True  # launch waits for the actor to be placed and the process started

    def __init__(
        self,
        serve_args: list[str],
        address: str | None = None,
        num_cpus: float = 1,
        num_gpus: float = 0,
        resources: dict[str, float] | None = None,
        namespace: str = "tripod",
        *,
        bind_host: str | None = None,
        log_dir: str | None = None,
        launch_timeout: float = 300.0,
        log_to_driver: bool = False,
        command: tuple[str, ...] = SERVE,
    ) -> None:
        ray = import_ray()
        if num_cpus < 0 or num_gpus < 0:
            raise ValueError(f"num_cpus and num_gpus must be >= 0 (got {num_cpus}, {num_gpus})")
        if launch_timeout <= 0:
            raise ValueError(f"launch_timeout must be > 0 (got {launch_timeout})")
        self.serve_args = list(serve_args)
        self.num_cpus = num_cpus
        self.num_gpus = num_gpus
        self.resources = dict(resources or {})
        self.bind_host = bind_host
        self.log_dir = log_dir
        self.launch_timeout = launch_timeout
        self.command = tuple(command)
        self.replicas: dict[str, RayReplica] = {}  # by actor name, until seen exited
        self._lock = threading.Lock()
        self._owns_ray = False
        self._actor_class: Any = None  # ray.remote(ReplicaActor), made on first launch
        if ray.is_initialized():
            return
        kwargs: dict[str, Any] = dict(
            address=address, namespace=namespace, ignore_reinit_error=True,
            include_dashboard=False, log_to_driver=log_to_driver,
        )
        if address is None:
            kwargs["num_cpus"] = os.cpu_count()
        try:
            ray.init(**kwargs)
        except ConnectionError as e:
            raise ValueError(
                f"no Ray cluster at address={address!r} ({e}); start one with `ray start --head`, "
                "or pass address=None for a local Ray instance"
            ) from e
        self._owns_ray = address is None

    def launch(self, index: int) -> RayReplica:
        ray = import_ray()
        name = f"tripod-replica-{index}-{uuid.uuid4().hex[:8]}"  # the actor's, and its log's
        if self._actor_class is None:
            self._actor_class = ray.remote(ReplicaActor)
        options: dict[str, Any] = dict(
            name=name, num_cpus=self.num_cpus, num_gpus=self.num_gpus, max_restarts=0,
        )
        if self.resources:
            options["resources"] = self.resources
        actor = self._actor_class.options(**options).remote()
        try:
            info = ray.get(actor.start.remote(name, self.serve_args, self.bind_host, self.log_dir, self.command),
                           timeout=self.launch_timeout)
        except ray.exceptions.GetTimeoutError:
            ray.kill(actor, no_restart=True)
            raise RuntimeError(
                f"{name} was not placed in {self.launch_timeout:.0f} s: no node has num_cpus="
                f"{self.num_cpus}, num_gpus={self.num_gpus}, resources={self.resources} free "
                "(`ray status` shows what the cluster has)"
            ) from None
        except ray.exceptions.RayError as e:
            ray.kill(actor, no_restart=True)
            raise RuntimeError(f"{name} failed to start: {e}") from e
        replica = RayReplica(f"replica-{index}", name, actor, info)
        replica.labels = node_labels(ray, info.node_id)
        with self._lock:
            self.replicas = {k: r for k, r in self.replicas.items() if not r.exited}
            self.replicas[name] = replica
        return replica

    def describe(self) -> list[dict[str, Any]]:
        """``{name, url, node_id, pid, actor_name, log_path}`` of each live replica. It asks each
        actor, so it blocks briefly: call it from a thread. Replicas seen exited are forgotten."""
        with self._lock:
            replicas = list(self.replicas.values())
        live = [r for r in replicas if r.exit_code() is None]
        with self._lock:
            for r in replicas:
                if r not in live:
                    self.replicas.pop(r.actor_name, None)
        return [r.describe() for r in live]

    def close(self) -> None:
        ray = import_ray()
        with self._lock:
            leftovers, self.replicas = list(self.replicas.values()), {}
        for r in leftovers:
            # NOTE: the supervisor stops replicas first; anything still here would otherwise keep
            # its actor (and resources) on a cluster we do not shut down.
            r.kill()
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
        self._owns_ray = False
