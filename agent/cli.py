"""`berth agent ...`: the node agent's runtime, and `berth agent discover`, which prints this host's inventory.

`main(argv)` is called by berth/main.py with the arguments after
`berth agent`. `berth agent discover ...` prints the inventory and exits;
anything else runs the runtime (agent/runtime.py) until SIGTERM or SIGINT:
`berth agent --control-plane URL --bootstrap-token-file FILE [--simulate
TOPOLOGY.json] [--cgroup-root PATH] [--state-dir DIR] ...` (docs/agent.md).
"""
from __future__ import annotations

import argparse
import os
import stat
import sys

from agent.errors import AgentError, TopologyError
from common import argtypes
from common.hostfacts import HostReadError

RUNTIME_USAGE = ("berth agent --control-plane URL --bootstrap-token-file FILE [--simulate TOPOLOGY.json] "
                 "[--cgroup-root PATH] [--state-dir DIR] [options]; `berth agent discover` prints this host's inventory")


def _minutes(text: str) -> float:
    value = argtypes.amount(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give minutes above 0, e.g. 60")
    return value


def _library(text: str) -> str:
    """--nvml-library: a file that is a shared library (ELF), so that a typo is refused here, not taken for a host
    without a driver. Empty (an unset BERTH_NVML_LIBRARY): the system's libnvidia-ml.so.1."""
    if not text:
        return text
    try:
        with open(text, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{text}: {exc.strerror}: give the path of libnvidia-ml.so.1") from None
    if magic != b"\x7fELF":
        raise argparse.ArgumentTypeError(f"{text}: not a shared library: give the path of libnvidia-ml.so.1")
    return text


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


class _Stderr:
    """Whatever sys.stderr is at the time of writing (a test may swap it between runs)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="berth agent discover",
                                description="Print what this host has: GPUs and MIG devices, CPUs, NUMA, memory "
                                            "and hugepages, as the control plane books against them.")
    p.add_argument("--simulate", metavar="TOPOLOGY.json",
                   help="replace NVML (and, where the file says so, the host's CPUs, memory and hugepages) "
                        "with a described topology")
    p.add_argument("--json", action="store_true", help="print the inventory document as JSON")
    p.add_argument("--nvml-library", metavar="PATH", default=os.environ.get("BERTH_NVML_LIBRARY"), type=_library,
                   help="load NVML from this file instead of libnvidia-ml.so.1 (env BERTH_NVML_LIBRARY)")
    p.add_argument("--reserve-vcpu", type=argtypes.amount, default=1.0, metavar="N",
                   help="CPUs kept for the system, not allocatable (default 1)")
    p.add_argument("--reserve-memory-gib", type=argtypes.amount, default=4.0, metavar="GIB",
                   help="memory kept for the system, not allocatable (default 4)")
    p.add_argument("--proc-root", default="/proc", help=argparse.SUPPRESS)
    p.add_argument("--sys-root", default="/sys", help=argparse.SUPPRESS)
    p.add_argument("--device-classes", metavar="FILE",
                   help="operator device class rules (JSON list of {match, class}), tried before the built-in ones")
    p.add_argument("--log-level", default="warning", type=str.lower, choices=LOG_LEVELS, help=argparse.SUPPRESS)
    return p


def discover_main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    from common import logs
    from common.device_classes import DEFAULT, DeviceClasses

    from agent.discovery import Discovery, Reserve
    from agent.host import KernelHost
    from agent.render import render

    logs.configure(fmt="console", level=args.log_level, stream=_Stderr())
    try:
        reserve = Reserve.of(args.reserve_vcpu, args.reserve_memory_gib)
    except ValueError as exc:
        print(f"berth agent discover: {exc}", file=sys.stderr)
        return 2
    try:
        classes = DeviceClasses.from_file(args.device_classes) if args.device_classes else DEFAULT
    except ValueError as exc:
        print(f"berth agent discover: --device-classes {exc}", file=sys.stderr)
        return 2
    kernel = KernelHost(sys_root=args.sys_root, proc_root=args.proc_root)
    if args.simulate:
        from agent.simulate import SimulatedGpus, SimulatedHost

        gpus = SimulatedGpus(args.simulate)
        host = SimulatedHost(gpus, fallback=kernel)
    else:
        from agent.nvml import NvmlGpus

        gpus = NvmlGpus(library=args.nvml_library, sys_root=args.sys_root, proc_root=args.proc_root)
        host = kernel
    try:
        inventory = Discovery(gpus=gpus, host=host, reserve=reserve, device_classes=classes).discover()
    except (AgentError, HostReadError) as exc:
        print(f"berth agent discover: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, TopologyError) else 1
    if args.json:
        sys.stdout.write(inventory.to_json().decode() + "\n")
    else:
        sys.stdout.write(render(inventory))
    if args.json and inventory.driver.status != "ok":
        print(f"berth agent discover: {inventory.driver.message}", file=sys.stderr)
    return 0


def _runtime_parser() -> argparse.ArgumentParser:
    from agent.checkpoint import DEFAULT_STATE_DIR
    from agent.tenantroot.hostkeys import DEFAULT_HOST_KEYS

    env = os.environ.get
    p = argparse.ArgumentParser(
        prog="berth agent", usage=RUNTIME_USAGE.split(";")[0],
        description="Run the node agent: discover this host, register with the control plane, heartbeat, watch the "
                    "bindings wanted here and make each real as a cgroup v2 with its share and device allow-list. "
                    "`berth agent discover` prints the inventory instead.")
    p.add_argument("--control-plane", metavar="URL", default=env("BERTH_CONTROL_PLANE"),
                   type=argtypes.http_url,
                   help="the control plane's base URL, e.g. https://cp.example.net:8080 (env BERTH_CONTROL_PLANE)")
    p.add_argument("--ca-file", metavar="FILE", default=env("BERTH_CA_FILE") or None,
                   help="verify an https:// control plane with the CA certificates in this PEM file instead of the "
                        "system trust store (env BERTH_CA_FILE)")
    p.add_argument("--client-cert", metavar="FILE", default=env("BERTH_CLIENT_CERT") or None,
                   help="this node's PEM certificate, shown to a control plane that requires client certificates "
                        "(--tls-client-ca; env BERTH_CLIENT_CERT; needs --client-key)")
    p.add_argument("--client-key", metavar="FILE", default=env("BERTH_CLIENT_KEY") or None,
                   help="the unencrypted PEM key of --client-cert (env BERTH_CLIENT_KEY; keep it mode 0600)")
    token = p.add_mutually_exclusive_group()
    token.add_argument("--bootstrap-token-file", metavar="FILE", default=env("BERTH_BOOTSTRAP_TOKEN_FILE"),
                       help="a file holding the pool's node bootstrap token, for register (env "
                            "BERTH_BOOTSTRAP_TOKEN_FILE; keep it mode 0600)")
    token.add_argument("--bootstrap-token", metavar="TOKEN", default=env("BERTH_BOOTSTRAP_TOKEN"),
                       help="the token itself (env BERTH_BOOTSTRAP_TOKEN); on the command line every user of the host "
                            "sees it in ps, so prefer --bootstrap-token-file")
    p.add_argument("--simulate", metavar="TOPOLOGY.json",
                   help="replace NVML (and, where the file says so, CPUs, memory, hugepages) by a described topology")
    p.add_argument("--cgroup-root", metavar="PATH",
                   help="the cgroup v2 directory holding the reservations' cgroups (rsv-*). Default: under systemd "
                        "the delegated scope berth.slice/berth-workloads.scope/workloads; otherwise <own cgroup>/"
                        "workloads")
    p.add_argument("--cgroup-enable-from", metavar="PATH",
                   help="the highest cgroup whose cgroup.subtree_control the agent may write to switch controllers on "
                        "down to the root (for hugetlb, which systemd does not delegate), e.g. the cgroup2 mount")
    p.add_argument("--state-dir", metavar="DIR", default=env("BERTH_AGENT_STATE_DIR", DEFAULT_STATE_DIR),
                   help=f"node identity, checkpoint, lock and exec socket (default {DEFAULT_STATE_DIR})")
    p.add_argument("--metrics-listen", metavar="HOST:PORT", type=argtypes.listen, help="serve /metrics and /status here")
    p.add_argument("--kubelet-root", metavar="DIR", default=env("BERTH_KUBELET_ROOT", "/var/lib/kubelet"),
                   help="the kubelet's root: kubernetes bindings are served by device plugins in its device-plugins/ "
                        "and read back from its pod-resources/ (default /var/lib/kubelet)")
    p.add_argument("--kubeconfig", metavar="FILE", default=env("KUBECONFIG"),
                   help="credentials for the Kubernetes API server, to taint this node while a kubernetes release is "
                        "stuck and to evict pods from devices a new booking takes (default: $KUBECONFIG, else the "
                        "pod's service account)")
    p.add_argument("--kubernetes-node-name", metavar="NAME", default=env("BERTH_KUBERNETES_NODE_NAME"),
                   help="this host's Node name in its cluster (default: the hostname)")
    root = p.add_argument_group("node bindings (tenant root over SSH; docs/node-binding.md)")
    root.add_argument("--ssh-keys-dir", metavar="DIR", default=env("BERTH_SSH_KEYS_DIR") or None,
                      help="make node bindings: the tenants' keys go into DIR/<user>, the file sshd's "
                           "AuthorizedKeysFile names (the package's sshd drop-in: /var/lib/berth/ssh-keys); without "
                           "it, node bindings are refused")
    root.add_argument("--ssh-host-keys", metavar="GLOB", default=env("BERTH_SSH_HOST_KEYS", DEFAULT_HOST_KEYS),
                      help=f"the host's public host keys, reported so tenants can check them (default {DEFAULT_HOST_KEYS})")
    root.add_argument("--ssh-endpoint", metavar="HOST:PORT", default=env("BERTH_SSH_ENDPOINT") or None,
                      help="where tenants reach this host's sshd (default: the hostname, port 22)")
    root.add_argument("--scratch-path", action="append", metavar="DIR", default=[],
                      help="a directory emptied when a node binding is taken back (repeat for more)")
    p.add_argument("--machine-id-file", metavar="FILE", default=env("BERTH_MACHINE_ID_FILE", "/etc/machine-id"),
                   help="this host's machine id, sent at register: a node lost past the grace may be taken over "
                        "only by the host with the id it first registered with (default /etc/machine-id)")
    p.add_argument("--exec-allow-uid", action="append", metavar="UID", default=[],
                   help="a uid (or user name) that may `berth exec` into any reservation bound here (repeatable)")
    p.add_argument("--exec-allow-group", action="append", metavar="GROUP", default=[],
                   help="members of this group (name or gid) may `berth exec` into any reservation (repeatable)")
    p.add_argument("--exec-tenant-user", action="append", metavar="TENANT=USER[:GROUP]", default=[],
                   help="the unprivileged user (name or uid) this tenant's `berth exec` workloads run as here; that "
                        "user may also `berth exec` into the tenant's reservations (repeatable; a tenant without "
                        "one cannot run work on this node)")
    p.add_argument("--exec-tenant-uid", action="append", metavar="TENANT=UID", default=[],
                   help="this uid may `berth exec` into the reservations of this tenant only (repeatable)")
    p.add_argument("--exec-allow-root", action="store_true",
                   help="let root run `berth exec --as-root` (root inside a reservation is NOT confined)")
    p.add_argument("--nvml-library", metavar="PATH", default=env("BERTH_NVML_LIBRARY"), type=_library,
                   help="load NVML from this file instead of libnvidia-ml.so.1 (env BERTH_NVML_LIBRARY)")
    p.add_argument("--reserve-vcpu", type=argtypes.amount, default=1.0, metavar="N",
                   help="CPUs kept for the system (default 1)")
    p.add_argument("--reserve-memory-gib", type=argtypes.amount, default=4.0, metavar="GIB",
                   help="memory kept for the system (default 4)")
    p.add_argument("--device-classes", metavar="FILE", help="operator device class rules (JSON)")
    p.add_argument("--gpu-health-quiet-minutes", type=_minutes, default=None, metavar="M",
                   help="a GPU an XID or an ECC error marked unhealthy is healthy again after M minutes without "
                        "another (default: until the operator's word, SIGUSR1 to the agent, or a restart)")
    p.add_argument("--log-format", choices=("auto", "json", "console"), default="auto")
    p.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS)
    p.add_argument("--watch-timeout-ms", type=argtypes.whole(1), default=25_000, help=argparse.SUPPRESS)
    p.add_argument("--heartbeat-seconds", type=argtypes.seconds, default=None, help=argparse.SUPPRESS)
    p.add_argument("--reconcile-seconds", type=argtypes.seconds, default=30.0, help=argparse.SUPPRESS)
    p.add_argument("--rediscover-seconds", type=argtypes.seconds, default=60.0, help=argparse.SUPPRESS)
    p.add_argument("--backoff-max-seconds", type=argtypes.seconds, default=10.0, help=argparse.SUPPRESS)
    p.add_argument("--request-timeout-seconds", type=argtypes.seconds, default=10.0, help=argparse.SUPPRESS)
    p.add_argument("--proc-root", default="/proc", help=argparse.SUPPRESS)
    p.add_argument("--sys-root", default="/sys", help=argparse.SUPPRESS)
    return p


def read_token_file(path: str) -> str:
    """The token in a file (one line, surrounding whitespace dropped); ValueError says what is wrong with it. The
    file must be the agent's alone (root's, mode 0600 or 0400): a token others can read registers their host too."""
    try:
        mode = os.stat(path).st_mode
        if mode & 0o077:
            raise ValueError(f"--bootstrap-token-file {path}: mode {stat.filemode(mode)} lets others read the token: "
                             f"`chmod 600 {path}`")
        text = open(path, encoding="utf-8").read().strip()
    except OSError as exc:
        raise ValueError(f"--bootstrap-token-file {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"--bootstrap-token-file {path}: not UTF-8 text") from None
    if not text or "\n" in text:
        raise ValueError(f"--bootstrap-token-file {path}: must hold exactly one token on one line")
    return text


def runtime_main(argv: list[str]) -> int:
    import asyncio
    import signal
    from pathlib import Path

    import structlog

    from common import logs, tls
    from common.device_classes import DeviceClasses

    from agent.checkpoint import StateDirError
    from agent.discovery import Reserve
    from agent.execgate import ExecPolicy
    from agent.nodebinding import TenantRootConfig
    from agent.runtime import Agent, AgentConfig, describe_error
    from agent.tenantroot.hostkeys import HostKeysError, parse_endpoint

    parser = _runtime_parser()
    args = parser.parse_args(argv)
    if args.bootstrap_token_file and not args.bootstrap_token:
        try:
            args.bootstrap_token = read_token_file(args.bootstrap_token_file)
        except ValueError as exc:
            parser.error(str(exc))
    missing = [f for f, v in (("--control-plane", args.control_plane),
                              ("--bootstrap-token-file (or --bootstrap-token)", args.bootstrap_token)) if not v]
    if missing:
        parser.error(f"{' and '.join(missing)} required (or env BERTH_CONTROL_PLANE / BERTH_BOOTSTRAP_TOKEN_FILE); "
                     "`berth agent discover` prints this host's inventory")
    try:
        reserve = Reserve.of(args.reserve_vcpu, args.reserve_memory_gib)
        policy = ExecPolicy.from_options(args.exec_allow_uid, args.exec_allow_group, args.exec_tenant_uid,
                                          args.exec_tenant_user, args.exec_allow_root)
        try:
            classes = DeviceClasses.from_file(args.device_classes) if args.device_classes else None
        except ValueError as exc:
            raise ValueError(f"--device-classes {exc}") from None
        ssl_context = (tls.client_context(args.ca_file, args.client_cert, args.client_key)
                       if args.ca_file or args.client_cert or args.client_key else None)
        tenant_root = None
        if args.ssh_keys_dir:
            if args.ssh_endpoint:
                parse_endpoint(args.ssh_endpoint)
            tenant_root = TenantRootConfig(keys_dir=args.ssh_keys_dir, host_keys=args.ssh_host_keys,
                                           endpoint=args.ssh_endpoint, scratch=tuple(args.scratch_path))
        elif args.scratch_path:
            raise ValueError("--scratch-path is for node bindings: give --ssh-keys-dir too")
        for path in (Path(args.kubelet_root), Path(args.kubelet_root) / "device-plugins"):
            if path.exists() and not path.is_dir():  # found at the first kubernetes booking, it stopped the agent
                raise ValueError(f"--kubelet-root {args.kubelet_root}: {path} is not a directory; give the kubelet's "
                                 "root directory (its --root-dir, default /var/lib/kubelet)")
    except (ValueError, HostKeysError) as exc:  # tls.TlsError is a ValueError
        parser.error(str(exc))
    if args.simulate:
        from agent.simulate import load

        try:
            load(args.simulate)
        except TopologyError as exc:
            parser.error(f"--simulate {exc}")
    logs.configure(fmt=args.log_format, level=args.log_level, stream=_Stderr())
    logs.add_secrets([args.bootstrap_token])  # never in a log line, whatever a library prints
    if args.client_cert:
        tls.log_validity(structlog.get_logger("berth.agent"), args.client_cert, "--client-cert", "the agent's")
    config = AgentConfig(
        control_plane=args.control_plane, bootstrap_token=args.bootstrap_token, state_dir=Path(args.state_dir),
        cgroup_root=args.cgroup_root, cgroup_enable_from=args.cgroup_enable_from, simulate=args.simulate,
        metrics_listen=args.metrics_listen, nvml_library=args.nvml_library, reserve=reserve, device_classes=classes,
        exec_policy=policy, watch_timeout_ms=args.watch_timeout_ms, heartbeat_s=args.heartbeat_seconds,
        reconcile_s=args.reconcile_seconds, rediscover_s=args.rediscover_seconds,
        health_quiet_s=args.gpu_health_quiet_minutes * 60 if args.gpu_health_quiet_minutes is not None else None,
        backoff_max_s=args.backoff_max_seconds, request_timeout_s=args.request_timeout_seconds, proc=Path(args.proc_root), sys=Path(args.sys_root),
        machine_id_file=Path(args.machine_id_file), kubelet_root=Path(args.kubelet_root), kubeconfig=args.kubeconfig,
        kubernetes_node_name=args.kubernetes_node_name, ssl_context=ssl_context, tenant_root=tenant_root)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        agent = Agent(config)
        loop.add_signal_handler(signal.SIGUSR1, agent.reset_health)  # the operator's word on GPU health
        await agent.run(stop)

    try:
        asyncio.run(run())
    except StateDirError as exc:  # --state-dir as given cannot be used: a bad option, found at start
        print(f"berth agent: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # one line for the operator, not a traceback
        print(f"berth agent: {describe_error(exc, args.state_dir)}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "discover":
        try:
            return discover_main(argv[1:])
        except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
            return int(exc.code or 0)
    try:
        return runtime_main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
