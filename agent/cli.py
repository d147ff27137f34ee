"""`berth agent ...`: for now the `discover` subcommand, which prints this host's inventory.

`main(argv)` is called by controlplane/cli.py with the arguments after
`berth agent`. The runtime (register, watch, bind) is a later issue.
"""
from __future__ import annotations

import argparse
import os
import sys

from agent.errors import AgentError, TopologyError

NOT_BUILT = ("berth agent: the runtime (register/watch/bind) is not built yet; "
             "`berth agent discover` prints this host's inventory")


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
    p.add_argument("--nvml-library", metavar="PATH", default=os.environ.get("BERTH_NVML_LIBRARY"),
                   help="load NVML from this file instead of libnvidia-ml.so.1 (env BERTH_NVML_LIBRARY)")
    p.add_argument("--reserve-vcpu", type=float, default=1.0, metavar="N",
                   help="CPUs kept for the system, not allocatable (default 1)")
    p.add_argument("--reserve-memory-gib", type=float, default=4.0, metavar="GIB",
                   help="memory kept for the system, not allocatable (default 4)")
    p.add_argument("--proc-root", default="/proc", help=argparse.SUPPRESS)
    p.add_argument("--sys-root", default="/sys", help=argparse.SUPPRESS)
    p.add_argument("--device-classes", metavar="FILE",
                   help="operator device class rules (JSON list of {match, class}), tried before the built-in ones")
    p.add_argument("--log-level", default="warning", help=argparse.SUPPRESS)
    return p


def discover_main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    from controlplane import logs
    from controlplane.domain.device_classes import DEFAULT, DeviceClasses

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
    except AgentError as exc:
        print(f"berth agent discover: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, TopologyError) else 1
    if args.json:
        sys.stdout.write(inventory.to_json().decode() + "\n")
    else:
        sys.stdout.write(render(inventory))
    if args.json and inventory.driver.status != "ok":
        print(f"berth agent discover: {inventory.driver.message}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "discover":
        try:
            return discover_main(argv[1:])
        except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
            return int(exc.code or 0)
    print(NOT_BUILT, file=sys.stderr)
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
