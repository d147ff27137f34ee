"""The device filter as eBPF instructions: a pure function from rules to a program, and its readable listing.

Layout (after runc's and crun's device filters): a prologue loads type,
access, major and minor from struct bpf_cgroup_dev_ctx into r2..r5; one
block per normalised rule compares what the rule fixes and jumps to the next
block on the first mismatch (a wildcard emits no compare); a match returns 1
(allow); the epilogue returns 0 (deny). Nothing here touches the kernel.
"""
from __future__ import annotations

import functools
import hashlib
import struct
from typing import Iterable, NamedTuple

from .devices import DeviceRule, normalise

# struct bpf_cgroup_dev_ctx { u32 access_type; u32 major; u32 minor; }
# access_type = (BPF_DEVCG_ACC_* << 16) | BPF_DEVCG_DEV_*
DEVCG_ACC_MKNOD, DEVCG_ACC_READ, DEVCG_ACC_WRITE = 1, 2, 4
DEVCG_DEV_BLOCK, DEVCG_DEV_CHAR = 1, 2
ACC_ALL = DEVCG_ACC_MKNOD | DEVCG_ACC_READ | DEVCG_ACC_WRITE
_ACC_BITS = {"m": DEVCG_ACC_MKNOD, "r": DEVCG_ACC_READ, "w": DEVCG_ACC_WRITE}
_TYPE_BITS = {"c": DEVCG_DEV_CHAR, "b": DEVCG_DEV_BLOCK}

# opcodes (linux/bpf_common.h, linux/bpf.h)
BPF_LDX, BPF_ALU, BPF_JMP, BPF_ALU64 = 0x01, 0x04, 0x05, 0x07
BPF_W, BPF_MEM = 0x00, 0x60
BPF_K, BPF_X = 0x00, 0x08
BPF_AND, BPF_RSH, BPF_MOV = 0x50, 0x70, 0xB0
BPF_JNE, BPF_EXIT = 0x50, 0x90

LDXW = BPF_LDX | BPF_MEM | BPF_W      # 0x61  dst = *(u32 *)(src + off)
AND32_K = BPF_ALU | BPF_AND | BPF_K   # 0x54  wdst &= imm
RSH32_K = BPF_ALU | BPF_RSH | BPF_K   # 0x74  wdst >>= imm
MOV32_K = BPF_ALU | BPF_MOV | BPF_K   # 0xb4  wdst = imm
MOV32_X = BPF_ALU | BPF_MOV | BPF_X   # 0xbc  wdst = wsrc
JNE_K = BPF_JMP | BPF_JNE | BPF_K     # 0x55  if dst != imm goto +off
JNE_X = BPF_JMP | BPF_JNE | BPF_X     # 0x5d  if dst != src goto +off
EXIT = BPF_JMP | BPF_EXIT             # 0x95

R0, R1, R2, R3, R4, R5 = range(6)
R_TYPE, R_ACCESS, R_MAJOR, R_MINOR = R2, R3, R4, R5


class Insn(NamedTuple):
    """struct bpf_insn: code, dst_reg:4, src_reg:4, off (s16), imm (s32)."""

    code: int
    dst: int = 0
    src: int = 0
    off: int = 0
    imm: int = 0


_INSN = struct.Struct("<BBhi")


def encode(insns: Iterable[Insn]) -> bytes:
    return b"".join(_INSN.pack(i.code, (i.src << 4) | i.dst, i.off, i.imm) for i in insns)


def decode(data: bytes) -> list[Insn]:
    out = []
    for code, regs, off, imm in _INSN.iter_unpack(data):
        out.append(Insn(code, regs & 0xF, regs >> 4, off, imm))
    return out


def program_tag(insns: Iterable[Insn], algorithm: str = "sha256") -> bytes:
    """The tag the kernel gives this program: the first 8 bytes of a hash over the instructions (no maps here).

    Linux hashed with SHA-1 up to 6.17 and with SHA-256 since; `bpf.tag_algorithm()` probes which.
    """
    return hashlib.new(algorithm, encode(insns)).digest()[:8]


def _prologue() -> list[Insn]:
    return [
        Insn(LDXW, R_TYPE, R1, 0),       # r2 = access_type
        Insn(AND32_K, R_TYPE, imm=0xFFFF),  # w2 &= 0xffff          (device type)
        Insn(LDXW, R_ACCESS, R1, 0),     # r3 = access_type
        Insn(RSH32_K, R_ACCESS, imm=16),  # w3 >>= 16             (access)
        Insn(LDXW, R_MAJOR, R1, 4),      # r4 = major
        Insn(LDXW, R_MINOR, R1, 8),      # r5 = minor
    ]


def _block(r: DeviceRule) -> list[Insn]:
    """Compares with off=None meaning 'to the next block', patched once the block's length is known."""
    body: list[Insn] = []
    if r.kind != "a":
        body.append(Insn(JNE_K, R_TYPE, imm=_TYPE_BITS[r.kind], off=None))
    acc = sum(_ACC_BITS[a] for a in r.access)
    if acc != ACC_ALL:
        # allowed only if every requested access bit is in acc: (access & acc) == access
        body += [Insn(MOV32_X, R1, R_ACCESS), Insn(AND32_K, R1, imm=acc), Insn(JNE_X, R1, R_ACCESS, off=None)]
    if r.major is not None:
        body.append(Insn(JNE_K, R_MAJOR, imm=r.major, off=None))
    if r.minor is not None:
        body.append(Insn(JNE_K, R_MINOR, imm=r.minor, off=None))
    body += [Insn(MOV32_K, R0, imm=1), Insn(EXIT)]
    n = len(body)
    # a jump's offset counts from the instruction after it; the next block starts at index n
    return [i._replace(off=n - idx - 1) if i.off is None else i for idx, i in enumerate(body)]


def build(rules: Iterable[DeviceRule]) -> list[Insn]:
    """Rules -> instructions, default deny. The rules are normalised first, so order does not matter."""
    return list(_build(normalise(rules)))


@functools.lru_cache(maxsize=1024)
def _build(rules: tuple[DeviceRule, ...]) -> tuple[Insn, ...]:
    insns = _prologue()
    for r in rules:
        insns += _block(r)
    insns += [Insn(MOV32_K, R0, imm=0), Insn(EXIT)]
    return tuple(insns)


def _fmt(i: Insn, pc: int) -> str:
    if i.code == LDXW:
        return f"r{i.dst} = *(u32 *)(r{i.src} + {i.off})"
    if i.code == AND32_K:
        return f"w{i.dst} &= {i.imm:#x}"
    if i.code == RSH32_K:
        return f"w{i.dst} >>= {i.imm}"
    if i.code == MOV32_K:
        return f"w{i.dst} = {i.imm}"
    if i.code == MOV32_X:
        return f"w{i.dst} = w{i.src}"
    if i.code == JNE_K:
        return f"if r{i.dst} != {i.imm:#x} goto {pc + 1 + i.off}"
    if i.code == JNE_X:
        return f"if r{i.dst} != r{i.src} goto {pc + 1 + i.off}"
    if i.code == EXIT:
        return "exit"
    return f"<code {i.code:#04x} dst r{i.dst} src r{i.src} off {i.off} imm {i.imm}>"


def disassemble(insns: Iterable[Insn]) -> str:
    """One line per instruction, 'pc: text', jumps shown with their absolute target."""
    return "\n".join(f"{pc:3d}: {_fmt(i, pc)}" for pc, i in enumerate(insns))
