"""NVML through nvidia-ml-py: the only module that imports pynvml.

`NvmlGpus` is the GpuSource for a real host: it loads libnvidia-ml.so.1 (by
name, or from an explicit path: `--nvml-library` / BERTH_NVML_LIBRARY),
reads every GPU and, on a MIG GPU, every MIG device slot up to the maximum
(slots are sparse), and says plainly when there is no driver.
`NvmlEvents` is the EventSource the XID watcher waits on (critical XID and
double-bit ECC events, a bounded wait). Every pynvml.NVMLError becomes one
of `agent.errors`' NVML errors in `_nvml()`, by return code.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import re
import threading
from typing import Callable, Iterator, TypeVar

import msgspec
import pynvml
import structlog

from agent import mig_minors, numa
from agent.errors import (
    NVML_ERRORS_BY_CODE, DriverNotLoaded, LibraryNotFound, NotFound, NotSupported, NvmlError, Timeout,
)
from agent.health import XidEvent
from common.inventory import CapMinors, Driver, Gpu, GpuInventory, LostGpu, MigDevice, MigMode

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
                status="not-found", message=f"no GPU driver found: the NVML library could not be loaded ({exc})"))
        except DriverNotLoaded:
            return GpuInventory(source=self.name, driver=Driver(
                status="not-loaded",
                message="no GPU driver found: NVML is installed but the NVIDIA kernel driver is not loaded"))
        except NvmlError as exc:
            return GpuInventory(source=self.name, driver=Driver(status="error", message=f"NVML failed: {exc}"))

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


# ---- settings a tenant with root may have changed (node bindings' in-band clean) ----------------------------

_RESETS = (("application clocks", "nvmlDeviceResetApplicationsClocks"),
           ("locked GPU clocks", "nvmlDeviceResetGpuLockedClocks"),
           ("locked memory clocks", "nvmlDeviceResetMemoryLockedClocks"))
_UNSUPPORTED = (3, 13)  # NOT_SUPPORTED, FUNCTION_NOT_FOUND (an older driver): nothing to put back


def reset_settings(library: str | None = None) -> list[str]:
    """Put every GPU's application and locked clocks and its power limit back to their defaults, after a tenant
    had root on the node; each setting that could not be put back, said plainly (an empty list: all done).
    MIG layouts are not rebuilt here: the clean check compares them with the hand-over's and a changed layout
    sends the node to maintenance."""
    problems: list[str] = []
    with session(library):
        for index in range(_nvml(pynvml.nvmlDeviceGetCount)):
            try:
                handle = _nvml(pynvml.nvmlDeviceGetHandleByIndex, index)
            except NvmlError as exc:
                problems.append(f"GPU {index}: not reachable to reset: {exc}")
                continue
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
