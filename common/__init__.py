"""What both halves share: device classes, the per-GPU share, logs, the node wire contract, error codes, TLS.

The bottom of the import graph: `common` imports only the standard library
and the wire library (msgspec, structlog for logs); `agent`, `cgroups` and
`controlplane` import it, and it imports none of them.
"""
