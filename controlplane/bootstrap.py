"""The bootstrap file: what an operator declares first (tenants, principals, pools, nodes, tokens, policies).

Parsed strictly (a bad field names itself), turned into catalog objects,
and applied idempotently at every start: applying the same file twice
changes nothing, and a changed file replaces what it names.
"""
from __future__ import annotations

import json
import math
from dataclasses import replace
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from controlplane.catalog import Catalog
from controlplane.iam import cedar
from controlplane.schemas import field_of, syntax_error
from controlplane.domain.calendar import Calendar
from controlplane.domain.model import (SHARING_MODES, BmcRef, Node, Offer, Pool, PoolPolicy, Principal, Tenant,
                                       Unit)
from common import money
from common.inventory import HOSTNAME_RULE, is_hostname
from common.share import Share

Id = Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:@-]*$")]
# A token as an Authorization header carries it (api/auth.py's bearer): printable ASCII, a space only inside. One
# with a control or a non-ASCII character, or a space at either end, could never be sent (every call 401).
TOKEN_PATTERN = r"^[!-~](?:[ -~]*[!-~])?(?![\s\S])"  # to the text's end: $ would take a final newline
Token = Annotated[str, Meta(min_length=16, max_length=4096, pattern=TOKEN_PATTERN)]
# A price or budget: the API's money (a JSON number is also taken, read by its shortest text: _money).
MoneyText = Annotated[str, Meta(pattern=money.PATTERN, description=money.RULE)]
TOKEN_RULE = ("must be printable ASCII, with no space at either end (a token a header can carry as it is); "
              "`openssl rand -base64 32` makes one")
NonNegative = Annotated[float, Meta(ge=0)]


class BootstrapError(ValueError):
    """The bootstrap file is wrong; the message names the field."""


class TenantDoc(Struct, forbid_unknown_fields=True):
    id: Id
    # Each value is checked by _quota, which names its key (msgspec's message cannot): a number >= 0.
    quota: dict[str, Annotated[Any, Meta(description="a number >= 0")]] = {}
    budgetUsd: MoneyText | float | None = None


class PrincipalDoc(Struct, forbid_unknown_fields=True):
    id: Id
    token: Token
    tenant: Id | None = None  # required for users and agents; an operator's is optional (see docs/admin-api.md)
    kind: Literal["user", "agent", "operator"] = "user"
    delegatedBy: Id | None = None
    scope: Literal["read", "manage"] = "manage"  # a read token gets, lists and quotes; it changes nothing


class PerGpuDoc(Struct, forbid_unknown_fields=True):
    vcpu: NonNegative
    memoryGiB: NonNegative


# An extended resource name as the kubelet accepts it: a DNS domain, '/', a name of at most 63 characters.
ResourceName = Annotated[str, Meta(max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")]
DEFAULT_RESOURCE_NAME = "berth.dev/gpu"


class KubernetesDoc(Struct, forbid_unknown_fields=True):
    """policy.kubernetes as an object: which cluster the pool's nodes belong to, and the extended resource their
    GPUs are advertised as to its kubelets."""

    cluster: Annotated[str, Meta(max_length=128)] = ""
    resourceName: ResourceName = DEFAULT_RESOURCE_NAME


# A POSIX portable user name (what the agent accepts as the login account of a node binding).
UserName = Annotated[str, Meta(min_length=1, max_length=32, pattern=r"^[a-z_][a-z0-9_-]*$")]


class TenantRootDoc(Struct, forbid_unknown_fields=True):
    """policy.tenantRoot as an object: the account node bindings log in to, how a node is cleaned after the
    hand-back, and how long the calendar keeps it for that (unbilled; also the cleaning's time limit)."""

    user: UserName = "root"
    cleaning: Literal["inband", "redfish"] = "inband"
    turnaroundMinutes: Annotated[int, Meta(ge=1, le=1440)] = 30
    bootOverride: Annotated[str, Meta(min_length=1, max_length=32)] | None = None  # redfish: e.g. "Pxe"


class PolicyDoc(Struct, forbid_unknown_fields=True):
    tenantRoot: bool | TenantRootDoc = False
    kubernetes: bool | KubernetesDoc = False
    perGpu: PerGpuDoc | None = None
    placer: Literal["calendar", "pool-lease"] = "calendar"
    budgetCheck: bool = False
    slotsPerGpu: Annotated[int, Meta(ge=1, le=64)] = 4
    endingWarningMinutes: Annotated[int, Meta(ge=0, le=1440)] = 30  # reservation.ending before each end; 0: none


class OfferQuotaDoc(Struct, forbid_unknown_fields=True):
    vcpu: NonNegative | None = None
    memoryGiB: NonNegative | None = None


class OfferDoc(Struct, forbid_unknown_fields=True):
    tenant: Id
    budgetCheck: bool = False
    quota: OfferQuotaDoc | None = None


class PoolDoc(Struct, forbid_unknown_fields=True):
    id: Id
    owner: Id
    region: Id
    gpuModel: Id
    sharing: Literal["exclusive", "mig", "slots"] = "exclusive"
    pricePerGpuHourUsd: MoneyText | float = "0"  # per device-hour: a GPU, a MIG instance or a slot
    pricePerVcpuHourUsd: MoneyText | float = "0"  # host resources above the per-GPU share
    pricePerGibHourUsd: MoneyText | float = "0"
    archived: bool = False
    policy: PolicyDoc = msgspec.field(default_factory=PolicyDoc)
    offers: list[OfferDoc] = []


class GpuDoc(Struct, forbid_unknown_fields=True):
    index: Annotated[int, Meta(ge=0)] | None = None
    uuid: str | None = None
    numaNode: Annotated[int, Meta(ge=0)] | None = None
    mig: list[str] | None = None  # MIG profiles of its instances, e.g. ["1g.10gb"] * 7
    slots: Annotated[int, Meta(ge=1, le=64)] | None = None


class BmcDoc(Struct, forbid_unknown_fields=True):
    """A node's BMC for cleaning redfish; credentialsFile is JSON {username, password}, mode 0600 (controlplane/bmc.py)."""

    redfishUrl: Annotated[str, Meta(min_length=1, max_length=2048)]
    systemId: Annotated[str, Meta(min_length=1, max_length=256)]
    credentialsFile: Annotated[str, Meta(min_length=1, max_length=4096)]
    caFile: Annotated[str, Meta(min_length=1, max_length=4096)] | None = None  # a private CA's PEM bundle (https)


class NodeDoc(Struct, forbid_unknown_fields=True):
    id: Id
    pool: Id
    hostname: Annotated[str, Meta(min_length=1, max_length=253)]
    gpus: Annotated[int, Meta(ge=0, le=64)] | list[GpuDoc] = 0
    vcpu: NonNegative = 0
    memoryGiB: NonNegative = 0
    hugepages1Gi: Annotated[int, Meta(ge=0)] = 0
    bmc: BmcDoc | None = None


class NodeTokenDoc(Struct, forbid_unknown_fields=True):
    pool: Id
    token: Token


class BootstrapDoc(Struct, forbid_unknown_fields=True):
    tenants: list[TenantDoc] = []
    principals: list[PrincipalDoc] = []
    pools: list[PoolDoc] = []
    nodes: list[NodeDoc] = []
    nodeTokens: list[NodeTokenDoc] = []
    policies: str | None = None
    policiesFile: str | None = None
    adminToken: Token | None = None


def _money(value, field: str) -> Decimal:
    """A price or budget in the API's grammar (common/money.py). A JSON number is read by its shortest text, so
    2.49 is 2.49, and 1e400 or 0.0000001 are refused as their strings are."""
    amount = money.parse_money(value if isinstance(value, str) else repr(value))
    if amount is None:
        raise BootstrapError(f"{field}: {value!r} is not an amount: {money.RULE}")
    return amount


def _json_kind(value: object) -> str:
    """What a decoded JSON value is, in JSON's words (as msgspec's messages say it)."""
    for kind, name in ((bool, "a boolean"), (str, "a string"), (list, "an array"), (dict, "an object")):
        if isinstance(value, kind):
            return name
    return "null" if value is None else "a number"


def _quota(raw: dict[str, object], field: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for key, value in raw.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise BootstrapError(f"{field}.{key}: must be a number (got {_json_kind(value)})")
        if not math.isfinite(value) or value < 0:
            raise BootstrapError(f"{field}.{key}: must be a number >= 0")
        if key == "vcpu":
            out["vcpu_milli"] = round(value * 1000)
        elif key == "memoryGiB":
            out["memory_mib"] = round(value * 1024)
        elif key.startswith("gpu:") and len(key) > 4:
            if value != int(value):
                raise BootstrapError(f"{field}.{key}: GPU quota must be a whole number")
            out[key] = int(value)
        else:
            raise BootstrapError(f"{field}.{key}: quota rows are gpu:<MODEL>[:<profile>|:slot], vcpu or memoryGiB")
    return out


def _units(doc: NodeDoc, pool: Pool, field: str) -> tuple[tuple[Unit, ...], int]:
    gpus = [GpuDoc(index=i) for i in range(doc.gpus)] if isinstance(doc.gpus, int) else doc.gpus
    units: list[Unit] = []
    seen: set[int] = set()
    for pos, gpu in enumerate(gpus):
        index = gpu.index if gpu.index is not None else pos
        if index in seen:
            raise BootstrapError(f"{field}.gpus[{pos}].index: GPU {index} is listed twice")
        seen.add(index)
        if pool.sharing == "mig":
            if not gpu.mig:
                raise BootstrapError(f"{field}.gpus[{pos}].mig: pool {pool.id} shares GPUs as MIG; list each GPU's instances")
            units.extend(Unit(f"gpu{index}/mig{j}", index, gpu.numaNode, profile, None) for j, profile in enumerate(gpu.mig))
        elif pool.sharing == "slots":
            for j in range(gpu.slots or pool.policy.slots_per_gpu):
                units.append(Unit(f"gpu{index}/slot{j}", index, gpu.numaNode, None, gpu.uuid))
        else:
            if gpu.mig or gpu.slots:
                raise BootstrapError(f"{field}.gpus[{pos}]: pool {pool.id} books whole GPUs; mig and slots do not apply")
            units.append(Unit(f"gpu{index}", index, gpu.numaNode, None, gpu.uuid))
    return tuple(units), len(gpus)


def _file(name: str, field: str, base_dir: Path | None) -> Path:
    """A file the document names: a relative path is the bootstrap file's neighbour. A document posted to
    /api/admin/bootstrap has no directory (base_dir None): there a relative path is refused, since resolving it
    against the server's working directory would read whatever file happens to be there."""
    path = Path(name)
    if path.is_absolute():
        return path
    if base_dir is None:
        raise BootstrapError(f"{field}: {name!r} is a relative path, and a document posted to the admin API has no "
                             "directory it could be relative to: give the absolute path")
    return base_dir / path


def _bmc(doc: NodeDoc, pool: Pool, field: str, base_dir: Path | None) -> BmcRef | None:
    """The node's BMC, checked as the first cleaning would use it (URL, system id, the credentials file's mode and
    form); required on a node of a pool that cleans by redfish."""
    if doc.bmc is None:
        if pool.policy.tenant_root and pool.policy.cleaning == "redfish":
            raise BootstrapError(f"{field}.bmc: required: pool {pool.id} cleans node bindings by redfish; declare "
                                 "{redfishUrl, systemId, credentialsFile}")
        return None
    from controlplane.bmc import Bmc, BmcError  # sushy is imported only where a BMC is declared

    path = _file(doc.bmc.credentialsFile, f"{field}.bmc.credentialsFile", base_dir)
    ca_file = _file(doc.bmc.caFile, f"{field}.bmc.caFile", base_dir) if doc.bmc.caFile else None
    try:
        bmc = Bmc(doc.bmc.redfishUrl, doc.bmc.systemId, path, ca_file=ca_file)
    except BmcError as exc:
        raise BootstrapError(f"{field}.bmc: {exc}") from None
    return BmcRef(bmc.redfish_url, bmc.system_id, str(path), str(ca_file) if ca_file else None)


class _Pairs(list):
    """A JSON object as its (key, value) pairs in order, so that a key written twice can be found."""


def _keys_written_twice(node, path: str = "") -> None:
    """A key written twice in one JSON object: the decoder would keep the last one without a word."""
    if isinstance(node, _Pairs):
        seen: set[str] = set()
        for key, value in node:
            where = f"{path}.{key}" if path else key
            if key in seen:
                raise BootstrapError(f"{where}: written twice in the same object (the last would silently win); "
                                     "keep one")
            seen.add(key)
            _keys_written_twice(value, where)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _keys_written_twice(value, f"{path}[{i}]")


def _once(seen: dict[str, str], ident: str, where: str, kind: str) -> None:
    """Refuse the id at `where` when an earlier entry declared it (seen: id -> that entry's field path)."""
    if ident in seen:
        raise BootstrapError(f"{where}: {kind} {ident!r} is declared twice, the first at {seen[ident]} (the last "
                             "would silently replace the first); keep one entry, or give this one another id")
    seen[ident] = where


def _unique_tokens(doc: BootstrapDoc) -> None:
    """Every token says who calls, so one token declared twice would make one caller the other: refused, naming
    both places and never the token itself (it is a secret)."""
    places = ([(f"principals[{i}].token", p.token) for i, p in enumerate(doc.principals)]
              + [(f"nodeTokens[{i}].token", t.token) for i, t in enumerate(doc.nodeTokens)]
              + ([("adminToken", doc.adminToken)] if doc.adminToken is not None else []))
    first: dict[str, str] = {}
    for where, token in places:
        if token in first:
            raise BootstrapError(f"{where}: the same token as {first[token]}; every token must be unique (a token "
                                 "says who calls): give one of them a new token")
        first[token] = where


def parse(raw: bytes, base_dir: Path | None = None) -> tuple[Catalog, dict[str, list[tuple[str, str]]], str | None]:
    """The catalog the file declares, its tokens by kind ([(token, subject)]) and the admin token."""
    try:
        doc = msgspec.json.decode(raw, type=BootstrapDoc)
    except msgspec.ValidationError as exc:  # the field's path first, and the rule in words, as the API says them
        syntax = syntax_error(raw)
        if syntax is not None:
            raise BootstrapError(f"not valid JSON ({syntax})") from None
        field, rule = field_of(str(exc), BootstrapDoc)
        if field.endswith(("token", "Token")) and "matching regex" in rule:
            rule = TOKEN_RULE
        elif field.endswith("Usd") and "matching regex" in rule:
            rule = money.RULE
        raise BootstrapError(f"{'the document' if field == 'body' else field}: "
                             f"{rule.replace('of this request', 'of a bootstrap document')}") from None
    except msgspec.DecodeError as exc:
        raise BootstrapError(f"not valid JSON ({exc})") from None
    try:
        pairs = json.loads(raw, object_pairs_hook=_Pairs)
    except (ValueError, RecursionError):  # msgspec accepted it; nothing more to find
        pairs = None
    _keys_written_twice(pairs)
    _unique_tokens(doc)

    # An id declared twice is refused (the catalog is keyed by id: the last entry would silently win).
    tenants = {}
    tenant_ids: dict[str, str] = {}
    for i, t in enumerate(doc.tenants):
        _once(tenant_ids, t.id, f"tenants[{i}].id", "tenant")
        budget = _money(t.budgetUsd, f"tenants[{i}].budgetUsd") if t.budgetUsd is not None else None
        tenants[t.id] = Tenant(t.id, _quota(t.quota, f"tenants[{i}].quota"), budget, declared_budget_usd=budget)

    principals = {}
    tokens: dict[str, list[tuple[str, str]]] = {"principal": [], "node-bootstrap": []}
    principal_ids: dict[str, str] = {}
    for i, p in enumerate(doc.principals):
        _once(principal_ids, p.id, f"principals[{i}].id", "principal")
        if p.tenant is None and p.kind != "operator":
            raise BootstrapError(f"principals[{i}].tenant: required for a {p.kind}")
        if p.tenant is not None and p.tenant not in tenants:
            raise BootstrapError(f"principals[{i}].tenant: no tenant {p.tenant!r}")
        if p.kind == "agent" and p.delegatedBy is None:
            pass  # an agent acting in its own right
        if p.delegatedBy is not None and p.kind != "agent":
            raise BootstrapError(f"principals[{i}].delegatedBy: only an agent acts for a user")
        principals[p.id] = Principal(p.id, p.tenant or "", p.kind, p.delegatedBy, p.scope)
        tokens["principal"].append((p.token, p.id))
    for i, p in enumerate(doc.principals):
        if p.delegatedBy is not None:
            user = principals.get(p.delegatedBy)
            if user is None or user.kind != "user":
                raise BootstrapError(f"principals[{i}].delegatedBy: no user {p.delegatedBy!r}")
            if user.tenant_id != p.tenant:
                raise BootstrapError(f"principals[{i}].delegatedBy: user {p.delegatedBy!r} is in another tenant")

    pools = {}
    pool_ids: dict[str, str] = {}
    for i, p in enumerate(doc.pools):
        _once(pool_ids, p.id, f"pools[{i}].id", "pool")
        if p.owner not in tenants:
            raise BootstrapError(f"pools[{i}].owner: no tenant {p.owner!r}")
        offers = {}
        offered: dict[str, str] = {}
        for j, o in enumerate(p.offers):
            if o.tenant in offered:  # offers are keyed by tenant: the last would silently win
                raise BootstrapError(f"pools[{i}].offers[{j}].tenant: tenant {o.tenant!r} has two offers in pool "
                                     f"{p.id!r}, the first at {offered[o.tenant]}; a pool makes one offer per tenant: "
                                     "merge them into one")
            offered[o.tenant] = f"pools[{i}].offers[{j}].tenant"
            if o.tenant not in tenants:
                raise BootstrapError(f"pools[{i}].offers[{j}].tenant: no tenant {o.tenant!r}")
            quota = {}
            if o.quota is not None:
                if o.quota.vcpu is not None:
                    quota["vcpu_milli"] = round(o.quota.vcpu * 1000)
                if o.quota.memoryGiB is not None:
                    quota["memory_mib"] = round(o.quota.memoryGiB * 1024)
            offers[o.tenant] = Offer(o.tenant, o.budgetCheck, quota)
        per_gpu = None
        if p.policy.perGpu is not None:
            per_gpu = Share(round(p.policy.perGpu.vcpu * 1000), round(p.policy.perGpu.memoryGiB * 1024))
        root = p.policy.tenantRoot if isinstance(p.policy.tenantRoot, TenantRootDoc) else TenantRootDoc()
        if root.bootOverride is not None and root.cleaning != "redfish":
            raise BootstrapError(f"pools[{i}].policy.tenantRoot.bootOverride: a boot override is for cleaning "
                                 "redfish (the reset through the BMC); this pool cleans inband")
        policy = PoolPolicy(
            tenant_root=bool(p.policy.tenantRoot),
            root_user=root.user,
            cleaning=root.cleaning,
            turnaround_ms=root.turnaroundMinutes * 60_000,
            boot_override=root.bootOverride or "",
            kubernetes=bool(p.policy.kubernetes),
            kubernetes_cluster=p.policy.kubernetes.cluster if isinstance(p.policy.kubernetes, KubernetesDoc) else "",
            kubernetes_resource=(p.policy.kubernetes.resourceName if isinstance(p.policy.kubernetes, KubernetesDoc)
                                 else DEFAULT_RESOURCE_NAME if p.policy.kubernetes else ""),
            per_gpu=per_gpu,
            placer=p.policy.placer,
            budget_check=p.policy.budgetCheck,
            slots_per_gpu=p.policy.slotsPerGpu,
            ending_warning_ms=p.policy.endingWarningMinutes * 60_000,
        )
        assert p.sharing in SHARING_MODES
        pools[p.id] = Pool(
            p.id, p.owner, p.region, p.gpuModel, p.sharing,
            _money(p.pricePerGpuHourUsd, f"pools[{i}].pricePerGpuHourUsd"), p.archived, policy, offers,
            _money(p.pricePerVcpuHourUsd, f"pools[{i}].pricePerVcpuHourUsd"),
            _money(p.pricePerGibHourUsd, f"pools[{i}].pricePerGibHourUsd"),
        )

    nodes = {}
    node_ids: dict[str, str] = {}
    hostnames: dict[str, str] = {}
    for i, n in enumerate(doc.nodes):
        _once(node_ids, n.id, f"nodes[{i}].id", "node")
        pool = pools.get(n.pool)
        if pool is None:
            raise BootstrapError(f"nodes[{i}].pool: no pool {n.pool!r}")
        if not is_hostname(n.hostname):  # an agent registers with it, and the node API refuses any other
            raise BootstrapError(f"nodes[{i}].hostname: {n.hostname!r} is not {HOSTNAME_RULE}")
        if n.hostname in hostnames:
            raise BootstrapError(f"nodes[{i}].hostname: {n.hostname!r} is also node {hostnames[n.hostname]!r}")
        hostnames[n.hostname] = n.id
        units, gpu_count = _units(n, pool, f"nodes[{i}]")
        capacity = Share(round(n.vcpu * 1000), round(n.memoryGiB * 1024), n.hugepages1Gi)
        nodes[n.id] = Node(n.id, n.pool, n.hostname, units, gpu_count, capacity, declared=True,
                           bmc=_bmc(n, pool, f"nodes[{i}]", base_dir))

    for i, t in enumerate(doc.nodeTokens):  # a pool may have several tokens (each registers for it)
        if t.pool not in pools:
            raise BootstrapError(f"nodeTokens[{i}].pool: no pool {t.pool!r}")
        tokens["node-bootstrap"].append((t.token, t.pool))

    sources = [("policies", doc.policies or "")]
    if doc.policiesFile:
        path = _file(doc.policiesFile, "policiesFile", base_dir)
        try:
            sources.append((f"policiesFile {path}", path.read_text()))
        except OSError as exc:
            raise BootstrapError(f"policiesFile: cannot read {path} ({exc.strerror}): give the file of the Cedar "
                                 "policies, or write them in policies") from None
    for where, text in sources:  # each checked alone, so that a line number is the line of its own text
        if text.strip():
            try:
                cedar.validate(text)
            except cedar.PolicyError as exc:
                raise BootstrapError(f"{where}: {exc}") from None
    policies = "\n".join(text for _, text in sources if text)
    return Catalog(tenants, principals, pools, nodes, policies), tokens, doc.adminToken


def read(path: str | Path) -> tuple[Catalog, dict[str, list[tuple[str, str]]], str | None]:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise BootstrapError(f"{path}: {exc.strerror}") from None
    try:
        return parse(raw, path.parent)
    except BootstrapError as exc:
        raise BootstrapError(f"{path}: {exc}") from None


def broken_delegation(merged: Catalog, declared: Catalog) -> tuple[str, str] | None:
    """(field, rule) where the merged catalog would have an agent acting for someone who is no user of the agent's
    tenant, or None. A document is checked whole when it is read, but a partial one (the admin API's) may move a
    user to another tenant, or make it an operator, while an agent it does not name still acts for it."""
    where = {pid: i for i, pid in enumerate(declared.principals)}  # the document's order: its index
    for agent in merged.principals.values():
        user = merged.principals.get(agent.delegated_by or "")
        if user is None or user.id not in where or (user.kind == "user" and user.tenant_id == agent.tenant_id):
            continue  # (one the document does not name was checked when its own document was applied)
        field = f"principals[{where[user.id]}].{'tenant' if user.kind == 'user' else 'kind'}"
        return field, (f"agent {agent.id!r} of tenant {agent.tenant_id!r}, which this document does not name, acts "
                       f"for user {user.id!r}: name the agent too, in {user.id!r}'s new tenant or acting for another "
                       "user")
    return None


def stranded(current: Catalog, merged: Catalog, calendar: Calendar) -> str | None:
    """Why the merged catalog would strand live bookings, or None. A declared node re-declared into another pool,
    without devices that bookings hold, or with less host capacity than its bookings' peak would leave those
    bookings where no placement looks (the same devices booked twice: once by the old pool's reservation, once by
    the new pool's), or on devices that no longer exist. The operator drains the node first."""
    for node_id, new in merged.nodes.items():
        old = current.nodes.get(node_id)
        if old is None or new == old or old.pool_id not in calendar.pools:
            continue
        cal = calendar.pools[old.pool_id].nodes.get(node_id)
        if cal is None or cal.count == 0:
            continue
        holders = sorted(cal.owners())
        why = None
        if new.pool_id != old.pool_id:
            why = f"moves from pool {old.pool_id} to {new.pool_id}"
        else:
            gone = {u.id for u in old.units} - {u.id for u in new.units}
            held = sorted(u for u in gone if len(cal.devices.get(u, ())))
            if held:
                holders = sorted({o for u in held for o in cal.devices[u].owners})
                why = f"loses device{'s' if len(held) > 1 else ''} {', '.join(held)}"
            elif not old.capacity.fits_in(new.capacity) and not cal.host_peak(0, 2 ** 62).fits_in(new.capacity):
                # only a capacity the document lowers: an agent's node keeps its own (smaller, allocatable) one, which
                # bookings made before it registered may exceed, and a change of its BMC must still apply
                why = "gets less host capacity (vcpu, memory, hugepages) than is booked on it"
        if why is not None:
            shown = ", ".join(holders[:5]) + (f" and {len(holders) - 5} more" if len(holders) > 5 else "")
            return (f"node {node_id} {why} while reservations are booked on it ({shown}): drain it first "
                    f"(berth admin nodes drain {node_id}: the ones not started move), and apply this once those "
                    "running have ended or been released")
    return None


def merge(current: Catalog, declared: Catalog) -> Catalog:
    """The catalog after applying a bootstrap: what the file names replaces what is stored.

    A declared node that an agent has taken over keeps the agent's inventory (and takes the file's BMC); every
    node keeps the state an operator set (a cordon survives the restart that applies the file again) and a
    cleaning under way. A tenant keeps a budget set through the admin API while the file declares the budget it
    declared before (every replica applies the file at its start), and takes the file's once it declares another.
    """
    tenants = dict(current.tenants)
    for tenant_id, tenant in declared.tenants.items():
        existing = tenants.get(tenant_id)
        kept = existing is not None and existing.declared_budget_usd == tenant.declared_budget_usd
        tenants[tenant_id] = replace(tenant, budget_usd=existing.budget_usd) if kept else tenant
    nodes = dict(current.nodes)
    for node_id, node in declared.nodes.items():
        existing = nodes.get(node_id)
        if existing is not None and not existing.declared:
            nodes[node_id] = replace(existing, bmc=node.bmc)
            continue
        nodes[node_id] = (replace(node, state=existing.state, state_reason=existing.state_reason,
                                  cleaning=existing.cleaning)
                          if existing is not None else node)
    return Catalog(
        tenants,
        {**current.principals, **declared.principals},
        {**current.pools, **declared.pools},
        nodes,
        declared.policies or current.policies,
    )
