"""The catalog: tenants, principals, pools (with offers) and nodes, as one immutable snapshot.

An operator changes it through the bootstrap file or the admin API; each
change is stored and replaces the snapshot whole, so readers on any thread
see either the old or the new catalog, never a mix.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping

from controlplane.domain.admission import PoolProfile, profile_of
from controlplane.domain.model import Node, Pool, Principal, Tenant
from controlplane.store import codec


@dataclass(frozen=True)
class Catalog:
    tenants: Mapping[str, Tenant] = field(default_factory=dict)
    principals: Mapping[str, Principal] = field(default_factory=dict)
    pools: Mapping[str, Pool] = field(default_factory=dict)
    nodes: Mapping[str, Node] = field(default_factory=dict)
    policies: str = ""

    @property
    def nodes_by_pool(self) -> Mapping[str, tuple[Node, ...]]:
        cached = self.__dict__.get("_nodes_by_pool")
        if cached is None:
            grouped: dict[str, list[Node]] = {}
            for node in self.nodes.values():
                grouped.setdefault(node.pool_id, []).append(node)
            cached = {k: tuple(v) for k, v in grouped.items()}
            object.__setattr__(self, "_nodes_by_pool", cached)
        return cached

    def pool_nodes(self, pool_id: str) -> tuple[Node, ...]:
        return self.nodes_by_pool.get(pool_id, ())

    def profile(self, pool_id: str) -> PoolProfile:
        """The pool's admission profile, computed once per catalog snapshot."""
        profiles = self.__dict__.setdefault("_profiles", {})
        found = profiles.get(pool_id)
        if found is None:
            pool = self.pools.get(pool_id)
            found = profiles[pool_id] = profile_of(pool, self.pool_nodes(pool_id)) if pool else profile_of(
                Pool(pool_id, "", "", ""), ())
        return found

    def with_changes(self, **changes) -> "Catalog":
        return replace(self, **changes)


KINDS = {"tenant": Tenant, "principal": Principal, "pool": Pool, "node": Node}


def encode_item(item) -> bytes:
    return codec.encode(item)


def with_rows(catalog: Catalog, rows: Iterable[tuple[str, str, bytes]]) -> Catalog:
    """The catalog with stored rows (kind, id, document) written over it: what another replica changed. The
    policies are one row (`policies`, `default`)."""
    changes: dict = {}
    for kind, ident, doc in rows:
        if kind == "policies":
            changes["policies"] = bytes(doc).decode()
        elif kind in KINDS:  # (as load: a kind this release does not know is not its to read)
            items = changes.setdefault(kind + "s", dict(getattr(catalog, kind + "s")))
            items[ident] = codec.decode_as(doc, KINDS[kind])
    return catalog.with_changes(**changes) if changes else catalog


def load(docs_by_kind: Mapping[str, list[bytes]], policies: str) -> Catalog:
    parts = {}
    for kind, type_ in KINDS.items():
        items = [codec.decode_as(doc, type_) for doc in docs_by_kind.get(kind, [])]
        parts[kind] = {item.id: item for item in items}
    return Catalog(parts["tenant"], parts["principal"], parts["pool"], parts["node"], policies)
