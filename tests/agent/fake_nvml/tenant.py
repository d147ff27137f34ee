"""What a tenant with root does to a MIG layout, through pynvml as its own tools would (nvidia-smi mig): destroy a
GPU instance, create one at a placement, flip MIG mode. Used in-process by the agent's tests and as a command by
the end-to-end tests (`python -m tests.agent.fake_nvml.tenant LIBRARY ACTION ...`, the topology in
$BERTH_FAKE_NVML_TOPOLOGY), against the stand-in NVML. Raw pynvml, not agent.nvml's layout code: the tenant must
not share the agent's mistakes."""
from __future__ import annotations

import argparse
import ctypes
import sys

import pynvml

from agent import nvml


def _gpu(index: int):
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def _gpu_instance(handle, gi_id: int):
    for profile in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, profile)
        except pynvml.NVMLError:
            continue
        array = (pynvml.c_nvmlGpuInstance_t * info.instanceCount)()
        count = ctypes.c_uint(0)
        pynvml.nvmlDeviceGetGpuInstances(handle, info.id, array, ctypes.byref(count))
        for gi in array[:count.value]:
            if pynvml.nvmlGpuInstanceGetInfo(gi).id == gi_id:
                return gi
    raise LookupError(f"no GPU instance {gi_id}")


def destroy_gi(gpu: int, gi_id: int) -> None:
    """Destroy a GPU instance and, first, its compute instances."""
    gi = _gpu_instance(_gpu(gpu), gi_id)
    for profile in range(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
        try:
            info = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, profile, 0)
        except pynvml.NVMLError:
            continue
        array = (pynvml.c_nvmlComputeInstance_t * info.instanceCount)()
        count = ctypes.c_uint(0)
        pynvml.nvmlGpuInstanceGetComputeInstances(gi, info.id, array, ctypes.byref(count))
        for ci in array[:count.value]:
            pynvml.nvmlComputeInstanceDestroy(ci)
    pynvml.nvmlGpuInstanceDestroy(gi)


def create_ci(gpu: int, gi_id: int, slices: int) -> int:
    """A compute instance of `slices` slices in a GPU instance; its id."""
    gi = _gpu_instance(_gpu(gpu), gi_id)
    for profile in range(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
        try:
            info = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, profile, 0)
        except pynvml.NVMLError:
            continue
        if info.sliceCount == slices:
            return pynvml.nvmlComputeInstanceGetInfo(pynvml.nvmlGpuInstanceCreateComputeInstance(gi, info.id)).id
    raise LookupError(f"no compute instance profile of {slices} slices")


def create_gi(gpu: int, profile_name: str, start: int) -> int:
    """A GPU instance of the named profile at a placement start, with one compute instance spanning it; its id."""
    handle = _gpu(gpu)
    for profile in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, profile)
        except pynvml.NVMLError:
            continue
        name = info.name.decode() if isinstance(info.name, bytes) else info.name
        if name == f"MIG {profile_name}":
            break
    else:
        raise LookupError(f"no GPU instance profile {profile_name}")
    placement = pynvml.c_nvmlGpuInstancePlacement_t(start, info.sliceCount)
    gi = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(handle, info.id, ctypes.byref(placement))
    for profile in range(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
        try:
            ci_info = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, profile, 0)
        except pynvml.NVMLError:
            continue
        if ci_info.sliceCount == info.sliceCount:
            pynvml.nvmlGpuInstanceCreateComputeInstance(gi, ci_info.id)
            break
    return pynvml.nvmlGpuInstanceGetInfo(gi).id


def set_mig_mode(gpu: int, on: bool) -> None:
    pynvml.nvmlDeviceSetMigMode(_gpu(gpu), pynvml.NVML_DEVICE_MIG_ENABLE if on else pynvml.NVML_DEVICE_MIG_DISABLE)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tenant", description=__doc__.split("\n")[0])
    p.add_argument("library")
    sub = p.add_subparsers(dest="action", required=True)
    d = sub.add_parser("destroy-gi")
    d.add_argument("gpu", type=int)
    d.add_argument("gi", type=int)
    c = sub.add_parser("create-gi")
    c.add_argument("gpu", type=int)
    c.add_argument("profile")
    c.add_argument("start", type=int)
    m = sub.add_parser("mig-mode")
    m.add_argument("gpu", type=int)
    m.add_argument("mode", choices=("on", "off"))
    args = p.parse_args(argv)
    with nvml.session(args.library):
        if args.action == "destroy-gi":
            destroy_gi(args.gpu, args.gi)
        elif args.action == "create-gi":
            print(create_gi(args.gpu, args.profile, args.start))
        else:
            set_mig_mode(args.gpu, args.mode == "on")
    return 0


if __name__ == "__main__":
    sys.exit(main())
