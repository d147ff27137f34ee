"""The agent's own errors: NVML's error codes and the kernel files' OSErrors become these at one boundary each.

`agent.nvml` translates `pynvml.NVMLError` (by code) and `common.hostfacts`
translates `OSError` into HostReadError (with the path); nothing else catches
either, so parsers stay plain and every error names what failed.
"""
from __future__ import annotations


class AgentError(Exception):
    """Anything the agent reports instead of a traceback."""


class TopologyError(AgentError):
    """A --simulate topology file is not valid; the message names the field."""


# -- NVML, by return code (nvml.h nvmlReturn_t) --------------------------------


class NvmlError(AgentError):
    """An NVML call failed; `code` is NVML's nvmlReturn_t, `call` the NVML function."""

    code: int = 999

    def __init__(self, message: str, *, code: int | None = None, call: str = "") -> None:
        super().__init__(f"{call}: {message}" if call else message)
        if code is not None:
            self.code = code
        self.call = call


class InvalidArgument(NvmlError):
    code = 2


class NotSupported(NvmlError):
    code = 3


class NotFound(NvmlError):
    code = 6


class DriverNotLoaded(NvmlError):
    code = 9


class Timeout(NvmlError):
    code = 10


class LibraryNotFound(NvmlError):
    code = 12


class GpuLost(NvmlError):
    code = 15


NVML_ERRORS_BY_CODE: dict[int, type[NvmlError]] = {
    cls.code: cls for cls in (InvalidArgument, NotSupported, NotFound, DriverNotLoaded, Timeout, LibraryNotFound, GpuLost)
}
