"""cgroups.bpf_program: rules -> instructions, checked against a readable listing and by running the program."""
from __future__ import annotations

import itertools

from hypothesis import given, strategies as st

from cgroups import bpf_program as bp
from cgroups.devices import DeviceRule, rule


def run(insns: list[bp.Insn], kind: str, major: int, minor: int, access: str) -> int:
    """A tiny interpreter for the opcodes the builder emits, over struct bpf_cgroup_dev_ctx."""
    type_bits = {"c": bp.DEVCG_DEV_CHAR, "b": bp.DEVCG_DEV_BLOCK}[kind]
    acc_bits = sum({"m": 1, "r": 2, "w": 4}[a] for a in access)
    ctx = {0: (acc_bits << 16) | type_bits, 4: major, 8: minor}
    reg = [0] * 11
    pc = 0
    for _ in range(10_000):
        i = insns[pc]
        if i.code == bp.LDXW:
            assert i.src == bp.R1
            reg[i.dst] = ctx[i.off]
        elif i.code == bp.AND32_K:
            reg[i.dst] = (reg[i.dst] & i.imm) & 0xFFFFFFFF
        elif i.code == bp.RSH32_K:
            reg[i.dst] = (reg[i.dst] & 0xFFFFFFFF) >> i.imm
        elif i.code == bp.MOV32_K:
            reg[i.dst] = i.imm & 0xFFFFFFFF
        elif i.code == bp.MOV32_X:
            reg[i.dst] = reg[i.src] & 0xFFFFFFFF
        elif i.code == bp.JNE_K:
            if reg[i.dst] != i.imm:
                pc += i.off
        elif i.code == bp.JNE_X:
            if reg[i.dst] != reg[i.src]:
                pc += i.off
        elif i.code == bp.EXIT:
            return reg[0]
        else:
            raise AssertionError(f"unexpected opcode {i.code:#x}")
        pc += 1
    raise AssertionError("program did not exit")


def allowed(rules, kind, major, minor, access) -> int:
    """cgroup v1's devices.allow semantics: rules naming the same device add up their accesses, and one
    such device entry must match the request and allow all of its access."""
    entries: dict[tuple, set[str]] = {}
    for r in rules:
        entries.setdefault((r.kind, r.major, r.minor), set()).update(r.access)
    return int(any(k in ("a", kind) and ma in (None, major) and mi in (None, minor) and set(access) <= acc
                   for (k, ma, mi), acc in entries.items()))


def test_listing_of_one_rule_shows_prologue_block_and_default_deny():
    expected = """\
  0: r2 = *(u32 *)(r1 + 0)
  1: w2 &= 0xffff
  2: r3 = *(u32 *)(r1 + 0)
  3: w3 >>= 16
  4: r4 = *(u32 *)(r1 + 4)
  5: r5 = *(u32 *)(r1 + 8)
  6: if r2 != 0x2 goto 14
  7: w1 = w3
  8: w1 &= 0x6
  9: if r1 != r3 goto 14
 10: if r4 != 0xc3 goto 14
 11: if r5 != 0x0 goto 14
 12: w0 = 1
 13: exit
 14: w0 = 0
 15: exit"""
    assert expected == bp.disassemble(bp.build([rule("c", 195, 0, "rw")]))


def test_wildcards_and_full_access_emit_no_compare():
    expected = """\
  6: if r4 != 0x88 goto 9
  7: w0 = 1
  8: exit
  9: w0 = 0
 10: exit"""
    listing = bp.disassemble(bp.build([rule("a", 136, None, "rwm")]))
    assert expected == "\n".join(listing.splitlines()[6:])


def test_no_rules_is_deny_everything():
    assert ["w0 = 0", "exit"] == [line.split(": ", 1)[1] for line in bp.disassemble(bp.build([])).splitlines()[6:]]


def test_encode_decode_round_trip():
    insns = bp.build([rule("c", 195, 0, "rw"), rule("b", 7, None, "r")])
    assert insns == bp.decode(bp.encode(insns))
    assert 8 * len(insns) == len(bp.encode(insns))


def test_the_same_rules_in_another_order_give_the_same_tag():
    a = [rule("c", 1, 3, "rw"), rule("c", 195, 0, "rw")]
    assert bp.program_tag(bp.build(a)) == bp.program_tag(bp.build(reversed(a)))


rules_st = st.lists(st.builds(
    DeviceRule, st.sampled_from("abc"), st.one_of(st.none(), st.integers(0, 3)),
    st.one_of(st.none(), st.integers(0, 3)), st.frozensets(st.sampled_from("rwm"), min_size=1)), max_size=6)


@given(rules_st)
def test_the_program_allows_exactly_what_the_rules_allow(rules):
    insns = bp.build(rules)
    for kind, major, minor in itertools.product("cb", range(5), range(5)):
        for access in ("r", "w", "m", "rw", "rwm", "wm"):
            assert allowed(rules, kind, major, minor, access) == run(insns, kind, major, minor, access), (
                kind, major, minor, access, [str(r) for r in rules])
