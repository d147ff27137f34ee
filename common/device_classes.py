"""Device classes: normalized GPU model names (`H100_80GB`) derived from NVML's name and memory.

One mapping table, used by the agent when it reports its GPUs and by the
control plane when it matches a request's `gpuModel` to a pool. An operator
extends it with rules of their own (a JSON list of {"match": regex,
"class": name}) that are tried before the built-in ones.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

# Labelled memory sizes; NVML reports a little less or more than the label
# (an 80 GB H100 shows 81559 MiB = 79.6 GiB, an H200 143771 MiB = 140.4 GiB),
# so the reported size in GiB is rounded to the nearest label.
_LABEL_SIZES_GB = (8, 10, 12, 16, 20, 24, 32, 40, 48, 80, 94, 96, 141, 144, 180, 186, 192, 288)

# The model token of an NVML name, most specific first.
_MODEL_TOKENS = (
    "GH200", "GB200", "B200", "B100", "H200", "H100", "H800", "H20", "A100", "A800", "A40", "A30",
    "A10G", "A10", "A16", "A2", "L40S", "L40", "L20", "L4", "V100", "T4", "P100", "RTX 6000 Ada",
    "RTX A6000", "RTX PRO 6000",
)

CLASS_NAME = re.compile(r"^[A-Z0-9][A-Z0-9_]{1,63}$")


@dataclass(frozen=True, slots=True)
class Rule:
    match: re.Pattern
    device_class: str


def _label_gb(memory_mib: int) -> int:
    gib = memory_mib / 1024
    return min(_LABEL_SIZES_GB, key=lambda size: abs(size - gib))


def _builtin_class(name: str, memory_mib: int) -> str | None:
    upper = name.upper()
    for token in _MODEL_TOKENS:
        if re.search(r"(?<![A-Z0-9])" + re.escape(token) + r"(?![A-Z0-9])", upper):
            model = token.replace(" ", "_")
            return f"{model}_{_label_gb(memory_mib)}GB"
    return None


class DeviceClasses:
    """The mapping table: operator rules first, then the built-in model tokens."""

    def __init__(self, rules: list[Rule] | None = None):
        self.rules = list(rules or [])

    @classmethod
    def from_file(cls, path: str | Path) -> "DeviceClasses":
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"device class rules {path}: {exc}") from exc
        return cls.from_rules(raw, source=str(path))

    @classmethod
    def from_rules(cls, raw: list, source: str = "rules") -> "DeviceClasses":
        if not isinstance(raw, list):
            raise ValueError(f"{source}: must be a JSON list of rules, [{{\"match\": REGEX, \"class\": NAME}}, ...]")
        return cls([_rule(item, f"{source}[{i}]") for i, item in enumerate(raw)])

    def classify(self, nvml_name: str, memory_mib: int) -> str:
        """The device class of a GPU; unknown models get a class made from their name. DeviceClassError when that
        made class cannot be one (too long): only the operator can say what to call such a GPU."""
        for rule in self.rules:
            if rule.match.search(nvml_name):
                return rule.device_class
        known = _builtin_class(nvml_name, memory_mib)
        if known:
            return known
        base = re.sub(r"[^A-Z0-9]+", "_", nvml_name.upper().replace("NVIDIA", "")).strip("_") or "GPU"
        made = f"{base}_{_label_gb(memory_mib)}GB"
        if not CLASS_NAME.match(made):
            # Cutting it short could give two models one class, and a booking of one the other: refuse instead.
            raise DeviceClassError(f"{nvml_name!r} ({memory_mib} MiB) makes the class {made[:20]}..., which is "
                                   "longer than 64 characters: name its class with --device-classes (a JSON list of "
                                   "rules, [{\"match\": REGEX, \"class\": NAME}])")
        return made


class DeviceClassError(ValueError):
    """A GPU whose class cannot be made from its name; the message says how to name it."""


def _rule(item: object, where: str) -> Rule:
    """One operator rule, each field checked for its type (a JSON file may hold anything); ValueError names it."""
    if not isinstance(item, dict):
        raise ValueError(f"{where}: a rule is an object, {{\"match\": REGEX, \"class\": NAME}}, not {item!r}")
    for key in ("match", "class"):
        if key not in item:
            raise ValueError(f"{where}.{key}: missing; a rule is {{\"match\": REGEX, \"class\": NAME}}")
    name, match = item["class"], item["match"]
    if not isinstance(match, str):
        raise ValueError(f"{where}.match: {match!r} is not a regex: give a string, e.g. \"H100.*HBM3\"")
    try:
        pattern = re.compile(match, re.IGNORECASE)
    except re.error as exc:
        raise ValueError(f"{where}.match: {match!r} is not a regex: {exc}") from None
    if not isinstance(name, str):
        raise ValueError(f"{where}.class: {name!r} is not a string: give an UPPER_SNAKE device class, e.g. "
                         "\"H100_SXM\"")
    if not CLASS_NAME.match(name):
        raise ValueError(f"{where}.class: {name!r} is not an UPPER_SNAKE device class (A-Z, 0-9 and _, 2 to 64 "
                         "characters)")
    return Rule(pattern, name)


DEFAULT = DeviceClasses()


def classify(nvml_name: str, memory_mib: int) -> str:
    return DEFAULT.classify(nvml_name, memory_mib)
