"""NVML through nvidia-ml-py: the only module that imports pynvml.

`NvmlGpus` is the GpuSource for a real host: it loads libnvidia-ml.so.1 (by
name, or from an explicit path: `--nvml-library` / BERTH_NVML_LIBRARY),
reads every GPU and, on a MIG GPU, every MIG device slot up to the maximum
(slots are sparse), and says plainly when there is no driver.
`NvmlEvents` is the EventSource the XID watcher waits on (critical XID and
double-bit ECC events, a bounded wait). `clean_gpus` puts every GPU back as a
node binding's hand-over found it (its MIG mode and layout through the GPU
and compute instance calls, its clocks and power limit) and names what it
could not. Every pynvml.NVMLError becomes one of `agent.errors`' NVML errors
in `_nvml()`, by return code.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator, TypeVar

import msgspec
import pynvml
import structlog

from agent import mig_minors, numa
from agent.errors import (
    NVML_ERRORS_BY_CODE, DriverNotLoaded, InvalidArgument, LibraryNotFound, NotFound, NotSupported, NvmlError,
    Timeout,
)
from agent.health import XidEvent
from common.inventory import (
    CapMinors, Driver, Gpu, GpuInventory, Inventory, LostGpu, MigDevice, MigMode, MigPlacement,
)

log = structlog.get_logger(__name__)

T = TypeVar("T")
LIBRARY_ENV = "BERTH_NVML_LIBRARY"
MIB = 1024 * 1024
# The events that say a device is unwell; single-bit ECC is corrected and is not one.
HEALTH_EVENTS = pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError
_NO_ID = 0xFFFFFFFF
_MIG_PROFILE = re.compile(r"\bMIG\s+(\S+)\s*$")
_load_lock = threading.Lock()
_loaded_path: str | None = None


def _nvml(fn: Callable[..., T], *args) -> T:
    """Call one pynvml wrapper; its NVMLError becomes the agent's error for that return code."""
    try:
        return fn(*args)
    except pynvml.NVMLError as exc:
        code = getattr(exc, "value", 999)
        cls = NVML_ERRORS_BY_CODE.get(code, NvmlError)
        raise cls(str(exc), code=code, call=fn.__name__) from None


def load_library(path: str | None = None) -> None:
    """Make pynvml use the NVML library at `path` (default: $BERTH_NVML_LIBRARY, else libnvidia-ml.so.1 by name).

    pynvml loads `libnvidia-ml.so.1` by name on its first nvmlInit; an
    explicit path is loaded here first and handed to pynvml, once per
    process. LibraryNotFound when the file cannot be loaded.
    """
    global _loaded_path
    path = path or os.environ.get(LIBRARY_ENV) or None
    if path is None:
        return
    path = os.path.abspath(path)
    with _load_lock:
        if _loaded_path == path:
            return
        if _loaded_path is not None or pynvml.nvmlLib is not None:
            raise NvmlError(f"another NVML library ({_loaded_path or 'libnvidia-ml.so.1'}) is already loaded in this "
                            f"process; {path} cannot replace it", call="load_library")
        try:
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            raise LibraryNotFound(f"cannot load {path}: {exc}", call="load_library") from None
        with pynvml.libLoadLock:
            pynvml.nvmlLib = lib
        _loaded_path = path


@contextlib.contextmanager
def session(library: str | None = None) -> Iterator[None]:
    """nvmlInit ... nvmlShutdown (NVML counts the references, so sessions nest)."""
    load_library(library)
    _nvml(pynvml.nvmlInit)
    try:
        yield
    finally:
        try:
            _nvml(pynvml.nvmlShutdown)
        except NvmlError as exc:
            log.warning("nvmlShutdown failed", error=str(exc))


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def mig_profile_of(mig_name: str) -> str | None:
    """The profile in a MIG device's NVML name ("NVIDIA A100-SXM4-80GB MIG 1g.10gb" -> "1g.10gb")."""
    m = _MIG_PROFILE.search(mig_name)
    return m.group(1) if m else None


def _sentence(text: str, most: int = 256) -> str:
    """A driver message that fits the inventory's (a loader's error can name a long path and say much more)."""
    return text if len(text) <= most else text[:most - 3] + "..."


def _cuda_text(version: int) -> str:
    return f"{version // 1000}.{version % 1000 // 10}"


class NvmlGpus:
    """The GpuSource of a real host (or of the stand-in library the tests build)."""

    name = "nvml"

    def __init__(self, library: str | None = None, sys_root: str = "/sys", proc_root: str = "/proc") -> None:
        self.library = library
        self.sys_root = sys_root
        self.proc_root = proc_root

    def discover(self) -> GpuInventory:
        try:
            with session(self.library):
                return self._read()
        except LibraryNotFound as exc:
            return GpuInventory(source=self.name, driver=Driver(
                status="not-found", message=_sentence(f"no GPU driver found: the NVML library could not be loaded "
                                                      f"({exc})")))
        except DriverNotLoaded:
            return GpuInventory(source=self.name, driver=Driver(
                status="not-loaded",
                message="no GPU driver found: NVML is installed but the NVIDIA kernel driver is not loaded"))
        except NvmlError as exc:
            return GpuInventory(source=self.name,
                                driver=Driver(status="error", message=_sentence(f"NVML failed: {exc}")))

    def _read(self) -> GpuInventory:
        version = _text(_nvml(pynvml.nvmlSystemGetDriverVersion))
        try:
            cuda: str | None = _cuda_text(_nvml(pynvml.nvmlSystemGetCudaDriverVersion))
        except NvmlError as exc:
            log.debug("no CUDA driver version", error=str(exc))
            cuda = None
        count = _nvml(pynvml.nvmlDeviceGetCount)
        caps: mig_minors.MigMinors | None = None
        gpus, lost = [], []
        for index in range(count):
            try:
                handle = _nvml(pynvml.nvmlDeviceGetHandleByIndex, index)
                gpu, has_mig = self._gpu(index, handle)
                if has_mig:
                    if caps is None:  # read afresh once per discovery, only when a GPU is in MIG mode
                        caps = mig_minors.read_mig_minors(self.proc_root)
                    gpu = msgspec.structs.replace(gpu, migDevices=self._mig_devices(handle, gpu.minor, caps))
            except NvmlError as exc:
                log.warning("GPU unreadable", index=index, error=str(exc), code=exc.code)
                lost.append(LostGpu(index=index, error=str(exc), code=exc.code))
                continue
            gpus.append(gpu)
        return GpuInventory(source=self.name, driver=Driver(status="ok", version=version, cudaVersion=cuda),
                            gpus=tuple(gpus), lostGpus=tuple(lost))

    def _gpu(self, index: int, handle) -> tuple[Gpu, bool]:
        pci = _text(_nvml(pynvml.nvmlDeviceGetPciInfo, handle).busId)
        try:
            current, pending = _nvml(pynvml.nvmlDeviceGetMigMode, handle)
            mig: MigMode | None = MigMode(current=current == pynvml.NVML_DEVICE_MIG_ENABLE,
                                          pending=pending == pynvml.NVML_DEVICE_MIG_ENABLE)
        except NotSupported:
            mig = None
        gpu = Gpu(
            index=index,
            uuid=_text(_nvml(pynvml.nvmlDeviceGetUUID, handle)),
            name=_text(_nvml(pynvml.nvmlDeviceGetName, handle)),
            deviceClass="",
            minor=_nvml(pynvml.nvmlDeviceGetMinorNumber, handle),
            pciBusId=pci,
            memoryMiB=_nvml(pynvml.nvmlDeviceGetMemoryInfo, handle).total // MIB,
            numaNode=numa.numa_node_of(pci, self.sys_root),
            migMode=mig,
        )
        return gpu, bool(mig and mig.current)

    def _mig_devices(self, handle, gpu_minor: int, caps: mig_minors.MigMinors) -> tuple[MigDevice, ...]:
        devices = []
        placements = _placements(handle)
        for slot in range(_nvml(pynvml.nvmlDeviceGetMaxMigDeviceCount, handle)):
            try:
                mh = _nvml(pynvml.nvmlDeviceGetMigDeviceHandleByIndex, handle, slot)
            except NotFound:  # an empty slot: MIG device slots are sparse
                continue
            gi = _nvml(pynvml.nvmlDeviceGetGpuInstanceId, mh)
            ci = _nvml(pynvml.nvmlDeviceGetComputeInstanceId, mh)
            name = _text(_nvml(pynvml.nvmlDeviceGetName, mh))
            devices.append(MigDevice(
                index=slot, gpuInstanceId=gi, computeInstanceId=ci, profile=mig_profile_of(name),
                uuid=_text(_nvml(pynvml.nvmlDeviceGetUUID, mh)), name=name,
                memoryMiB=_nvml(pynvml.nvmlDeviceGetMemoryInfo, mh).total // MIB,
                capMinors=CapMinors(gi=caps.gi(gpu_minor, gi), ci=caps.ci(gpu_minor, gi, ci)),
                placement=placements.get(gi),
            ))
        return tuple(devices)


class NvmlEvents:
    """The XID watcher's EventSource: one NVML event set with every readable GPU registered for HEALTH_EVENTS.

    Holds an NVML session from open() to close(). `wait` is bounded by its
    timeout and returns None when nothing happened.
    """

    def __init__(self, library: str | None = None) -> None:
        self.library = library
        self._session: contextlib.ExitStack | None = None
        self._set = None
        self._uuids: dict[int, str] = {}
        self.unwatched: dict[int, str] = {}  # GPU index -> why it could not be registered

    def open(self) -> "NvmlEvents":
        stack = contextlib.ExitStack()
        stack.enter_context(session(self.library))
        try:
            self._set = _nvml(pynvml.nvmlEventSetCreate)
            for index in range(_nvml(pynvml.nvmlDeviceGetCount)):
                try:
                    handle = _nvml(pynvml.nvmlDeviceGetHandleByIndex, index)
                    uuid = _text(_nvml(pynvml.nvmlDeviceGetUUID, handle))
                    mask = _nvml(pynvml.nvmlDeviceGetSupportedEventTypes, handle) & HEALTH_EVENTS
                    if not mask:
                        raise NotSupported("no XID or ECC events on this GPU", call="nvmlDeviceGetSupportedEventTypes")
                    _nvml(pynvml.nvmlDeviceRegisterEvents, handle, mask, self._set)
                except NvmlError as exc:
                    log.warning("GPU not watched for XID events", index=index, error=str(exc))
                    self.unwatched[index] = str(exc)
                    continue
                self._uuids[ctypes.cast(handle, ctypes.c_void_p).value] = uuid
        except BaseException:
            self._free()
            stack.close()
            raise
        self._session = stack
        return self

    def wait(self, timeout_ms: int) -> XidEvent | None:
        try:
            data = _nvml(pynvml.nvmlEventSetWait_v2, self._set, timeout_ms)
        except Timeout:
            return None
        uuid = self._uuids.get(ctypes.cast(data.device, ctypes.c_void_p).value)
        gi = data.gpuInstanceId if data.gpuInstanceId != _NO_ID else None
        ci = data.computeInstanceId if data.computeInstanceId != _NO_ID else None
        if data.eventType & pynvml.nvmlEventTypeXidCriticalError:
            return XidEvent(gpu_uuid=uuid, kind="xid", xid=data.eventData, gpu_instance_id=gi, compute_instance_id=ci)
        if data.eventType & pynvml.nvmlEventTypeDoubleBitEccError:
            return XidEvent(gpu_uuid=uuid, kind="ecc-dbe", xid=None, gpu_instance_id=gi, compute_instance_id=ci)
        return XidEvent(gpu_uuid=uuid, kind=f"event-0x{data.eventType:x}", xid=None,
                        gpu_instance_id=gi, compute_instance_id=ci)

    def _free(self) -> None:
        if self._set is not None:
            try:
                _nvml(pynvml.nvmlEventSetFree, self._set)
            except NvmlError as exc:
                log.warning("nvmlEventSetFree failed", error=str(exc))
            self._set = None

    def close(self) -> None:
        self._free()
        if self._session is not None:
            self._session.close()
            self._session = None

    def __enter__(self) -> "NvmlEvents":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()


# ---- the MIG layout through NVML's GPU and compute instance calls -----------------------------------------


@dataclass
class _ComputeInstance:
    handle: object
    id: int
    slices: int


@dataclass
class _GpuInstance:
    handle: object
    id: int
    profile_id: int  # what nvmlDeviceCreateGpuInstanceWithPlacement takes
    name: str  # the profile, e.g. "3g.40gb"
    slices: int
    start: int
    size: int
    cis: list[_ComputeInstance] = field(default_factory=list)

    def profile_of(self, ci: _ComputeInstance) -> str:
        """The MIG device's profile as NVML names it: the GPU instance's, or "1c.3g.40gb" for a smaller CI."""
        return self.name if ci.slices == self.slices else f"{ci.slices}c.{self.name}"


def _gi_profiles(handle) -> dict[int, object]:
    """The GPU instance profiles this GPU offers: NVML_GPU_INSTANCE_PROFILE_* index -> its info (v2, named)."""
    out = {}
    for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            out[index] = _nvml(pynvml.nvmlDeviceGetGpuInstanceProfileInfo, handle, index)
        except (NotSupported, InvalidArgument):  # a profile this GPU does not have
            continue
    return out


def _profile_name(info) -> str:
    return _text(info.name).removeprefix("MIG ").strip()


def _ci_profiles(gi_handle) -> dict[int, object]:
    """The compute instance profiles a GPU instance offers: NVML_COMPUTE_INSTANCE_PROFILE_* index -> its info."""
    out = {}
    for index in range(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
        try:
            out[index] = _nvml(pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo, gi_handle, index,
                               pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
        except (NotSupported, InvalidArgument):
            continue
    return out


def _instances(handle, ref_type, count: int, lister, *args) -> list:
    """The handles an NVML list call writes into an array it is given (nvmlDeviceGetGpuInstances and kin)."""
    array = (ref_type * max(count, 1))()
    found = ctypes.c_uint(0)
    _nvml(lister, handle, *args, array, ctypes.byref(found))
    return [array[i] for i in range(found.value)]


def mig_layout(handle) -> list[_GpuInstance]:
    """The GPU instances of a GPU in MIG mode, each with its compute instances, as NVML lists them."""
    layout = []
    for profile_index, info in _gi_profiles(handle).items():
        for gi in _instances(handle, pynvml.c_nvmlGpuInstance_t, info.instanceCount,
                             pynvml.nvmlDeviceGetGpuInstances, info.id):
            gi_info = _nvml(pynvml.nvmlGpuInstanceGetInfo, gi)
            inst = _GpuInstance(gi, gi_info.id, info.id, _profile_name(info), info.sliceCount,
                                gi_info.placement.start, gi_info.placement.size)
            for ci_info in _ci_profiles(gi).values():
                for ci in _instances(gi, pynvml.c_nvmlComputeInstance_t, ci_info.instanceCount,
                                     pynvml.nvmlGpuInstanceGetComputeInstances, ci_info.id):
                    inst.cis.append(_ComputeInstance(ci, _nvml(pynvml.nvmlComputeInstanceGetInfo, ci).id,
                                                     ci_info.sliceCount))
            layout.append(inst)
    return layout


def _placements(handle) -> dict[int, MigPlacement]:
    """GPU instance id -> its placement, for the inventory; empty where NVML will not say (an older driver, no
    permission to list instances): the clean check then falls back to the MIG device's slot."""
    try:
        return {gi.id: MigPlacement(start=gi.start, size=gi.size) for gi in mig_layout(handle)}
    except NvmlError as exc:
        log.debug("MIG placements not read", error=str(exc), code=exc.code)
        return {}


def _gi_profile_of(profile: str) -> tuple[str, int | None]:
    """A MIG device profile's GPU instance profile and compute instance slices ("1c.3g.40gb" -> ("3g.40gb", 1);
    "3g.40gb" -> ("3g.40gb", None): the whole GPU instance)."""
    if "c." in profile:
        head, rest = profile.split("c.", 1)
        if head.isdigit():
            return rest, int(head)
    return profile, None


def _restore_mig(index: int, handle, want: Gpu) -> list[str]:
    """Give one GPU the MIG mode and layout it had at the hand-over: destroy the compute and GPU instances that
    were not there, set the MIG mode back if it differs, recreate the instances that are missing at their
    recorded placement. What could not be done, said plainly."""
    if want.migMode is None:
        return []
    where = f"GPU {index}"
    wanted = {(m.gpuInstanceId, m.computeInstanceId): m for m in want.migDevices} if want.migMode.current else {}
    wanted_gis: dict[int, MigDevice] = {}
    for m in wanted.values():
        wanted_gis.setdefault(m.gpuInstanceId, m)

    def gi_wanted(gi: _GpuInstance) -> bool:
        m = wanted_gis.get(gi.id)
        return m is not None and _gi_profile_of(m.profile or "")[0] == gi.name and (
            m.placement is None or m.placement.start == gi.start)

    current, pending = _nvml(pynvml.nvmlDeviceGetMigMode, handle)
    if current == pynvml.NVML_DEVICE_MIG_ENABLE:
        for gi in mig_layout(handle):
            keep = gi_wanted(gi)
            for ci in gi.cis:
                m = wanted.get((gi.id, ci.id))
                if not keep or m is None or m.profile != gi.profile_of(ci):
                    _nvml(pynvml.nvmlComputeInstanceDestroy, ci.handle)
                    log.info("MIG compute instance destroyed", gpu=index, gi=gi.id, ci=ci.id, profile=gi.profile_of(ci))
            if not keep:
                _nvml(pynvml.nvmlGpuInstanceDestroy, gi.handle)
                log.info("MIG GPU instance destroyed", gpu=index, gi=gi.id, profile=gi.name, start=gi.start)
    mode = (want.migMode.current, want.migMode.pending)
    if (current == pynvml.NVML_DEVICE_MIG_ENABLE, pending == pynvml.NVML_DEVICE_MIG_ENABLE) != mode:
        target = pynvml.NVML_DEVICE_MIG_ENABLE if want.migMode.pending else pynvml.NVML_DEVICE_MIG_DISABLE
        _nvml(pynvml.nvmlDeviceSetMigMode, handle, target)
        log.info("MIG mode set back", gpu=index, mode=target)
        current, _ = _nvml(pynvml.nvmlDeviceGetMigMode, handle)
        if (current == pynvml.NVML_DEVICE_MIG_ENABLE) != want.migMode.current:
            return [f"{where}: MIG mode set back to {'on' if want.migMode.pending else 'off'}, pending a GPU reset "
                    "(the agent does not reset GPUs)"]
    if not wanted:
        return []
    problems: list[str] = []
    profiles = {_profile_name(info): info for info in _gi_profiles(handle).values()}
    live = {gi.id: gi for gi in mig_layout(handle)}
    for gi_id, m in sorted(wanted_gis.items()):
        gi_name = _gi_profile_of(m.profile or "")[0]
        gi = live.get(gi_id)
        if gi is None:
            info = profiles.get(gi_name)
            if info is None or m.placement is None:
                why = "no placement was recorded" if info is not None else f"the GPU offers no profile {gi_name}"
                problems.append(f"{where}: MIG GPU instance {gi_id} ({m.profile}) not recreated: {why}")
                continue
            placement = pynvml.c_nvmlGpuInstancePlacement_t(m.placement.start, m.placement.size)
            handle_gi = _nvml(pynvml.nvmlDeviceCreateGpuInstanceWithPlacement, handle, info.id,
                              ctypes.byref(placement))
            gi_info = _nvml(pynvml.nvmlGpuInstanceGetInfo, handle_gi)
            gi = _GpuInstance(handle_gi, gi_info.id, info.id, gi_name, info.sliceCount, gi_info.placement.start,
                              gi_info.placement.size)
            log.info("MIG GPU instance recreated", gpu=index, gi=gi.id, profile=gi_name, start=gi.start)
            if gi.id != gi_id:  # the driver chose the id: the clean check reports the difference
                problems.append(f"{where}: MIG GPU instance {gi_id} ({gi_name}) recreated as GPU instance {gi.id}")
        have = {ci.id for ci in gi.cis}
        ci_profiles = None
        for (w_gi, w_ci), dev in sorted(wanted.items()):
            if w_gi != gi_id or w_ci in have:
                continue
            slices = _gi_profile_of(dev.profile or "")[1] or gi.slices
            ci_profiles = ci_profiles or _ci_profiles(gi.handle)
            ci_info = next((i for i in ci_profiles.values() if i.sliceCount == slices), None)
            if ci_info is None:
                problems.append(f"{where}: MIG compute instance {w_gi}/{w_ci} ({dev.profile}) not recreated: GPU "
                                f"instance {gi.id} offers no compute instance of {slices} slices")
                continue
            ci = _nvml(pynvml.nvmlGpuInstanceCreateComputeInstance, gi.handle, ci_info.id)
            log.info("MIG compute instance recreated", gpu=index, gi=gi.id,
                     ci=_nvml(pynvml.nvmlComputeInstanceGetInfo, ci).id, profile=dev.profile)
    return problems


def _holders(handle) -> list[int]:
    """The pids of the compute processes holding a GPU (none where the driver cannot say)."""
    try:
        return sorted(p.pid for p in _nvml(pynvml.nvmlDeviceGetComputeRunningProcesses, handle))
    except NotSupported:
        return []


# ---- settings a tenant with root may have changed (node bindings' in-band clean) ----------------------------

_RESETS = (("application clocks", "nvmlDeviceResetApplicationsClocks"),
           ("locked GPU clocks", "nvmlDeviceResetGpuLockedClocks"),
           ("locked memory clocks", "nvmlDeviceResetMemoryLockedClocks"))
_UNSUPPORTED = (3, 13)  # NOT_SUPPORTED, FUNCTION_NOT_FOUND (an older driver): nothing to put back


def clean_gpus(library: str | None = None, recorded: Inventory | None = None) -> list[str]:
    """Put every GPU back the way a node binding's hand-over found it, after a tenant had root on the node; each
    thing that could not be put back, said plainly (an empty list: all done). Per GPU, in order:

    1. a GPU that compute processes still hold is not touched: the driver resets only a GPU that no process
       holds (`nvidia-smi -r`), and the agent resets none itself, so the holders are the refusal reported;
    2. its MIG mode and layout, as `recorded` (the hand-over's inventory) has them, by its UUID (`_restore_mig`);
    3. its application and locked clocks and its power limit, to their defaults.
    """
    want = {g.uuid: g for g in recorded.gpus} if recorded is not None else {}
    problems: list[str] = []
    with session(library):
        for index in range(_nvml(pynvml.nvmlDeviceGetCount)):
            try:
                handle = _nvml(pynvml.nvmlDeviceGetHandleByIndex, index)
                holders = _holders(handle)
            except NvmlError as exc:
                problems.append(f"GPU {index}: not reachable to reset: {exc}")
                continue
            if holders:
                problems.append(f"GPU {index}: not reset: held by compute process(es) "
                                f"{', '.join(map(str, holders[:16]))}; the driver resets only a GPU no process holds")
                continue
            try:
                gpu = want.get(_text(_nvml(pynvml.nvmlDeviceGetUUID, handle)))
                if gpu is not None:
                    problems += _restore_mig(index, handle, gpu)
            except NvmlError as exc:
                problems.append(f"GPU {index}: MIG layout not restored: {exc}")
            problems += _reset_settings(index, handle)
    return problems


def _reset_settings(index: int, handle) -> list[str]:
    """One GPU's application and locked clocks and its power limit back to their defaults."""
    problems = []
    for what, name in _RESETS:
        try:
            _nvml(getattr(pynvml, name), handle)
        except NvmlError as exc:
            if exc.code not in _UNSUPPORTED:
                problems.append(f"GPU {index}: {what} not reset: {exc}")
    try:
        default = _nvml(pynvml.nvmlDeviceGetPowerManagementDefaultLimit, handle)
        if _nvml(pynvml.nvmlDeviceGetPowerManagementLimit, handle) != default:
            _nvml(pynvml.nvmlDeviceSetPowerManagementLimit, handle, default)
            log.info("GPU power limit reset", gpu=index, limit_mw=default)
    except NvmlError as exc:
        if exc.code not in _UNSUPPORTED:
            problems.append(f"GPU {index}: power limit not reset: {exc}")
    return problems
