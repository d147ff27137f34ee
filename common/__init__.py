"""Definitions both halves share: device classes, the per-GPU share, log set-up, the node wire contract, error codes.

The bottom of the import graph: `common` imports only the standard library
and the wire library (msgspec, structlog for logs); `agent`, `cgroups` and
`controlplane` import it, and it imports none of them.
"""
