"""Reads the instruction order of a compiled (scheduled) XLA module from `compiled.as_text()`.

The entry computation of a scheduled module prints in schedule order. Calls (XLA:GPU outlines
command buffers into `call`s) are expanded in place; fusions and other called computations are
not expanded, but the op_names of everything they contain tag the calling instruction.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Dict, List

_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_INSTR = re.compile(r"^\s+(?:ROOT )?%?([\w.\-]+) = ")
_OPCODE = re.compile(r"\s([a-z][a-z\-]*)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_CALLEES = re.compile(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)|called_computations=\{([^}]*)\}")


@dataclasses.dataclass
class Instr:
    name: str
    opcode: str
    target: str          # custom_call_target, or ""
    op_names: frozenset  # metadata op_names of the instruction and of what it calls

    def tagged(self, scope: str) -> bool:
        return any(scope in n for n in self.op_names)


def _computations(text: str) -> tuple:
    comps: Dict[str, List[str]] = {}
    entry, cur = None, None
    for line in text.splitlines():
        m = _HEADER.match(line)
        if m:
            cur = m.group(2)
            comps[cur] = []
            if m.group(1):
                entry = cur
        elif line.strip() == "}":
            cur = None
        elif cur is not None and _INSTR.match(line):
            comps[cur].append(line)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


def _callees(line: str) -> List[str]:
    out = []
    for one, many in _CALLEES.findall(line):
        out += [one] if one else [c.strip().lstrip("%") for c in many.split(",") if c.strip()]
    return out


def schedule(text: str) -> List[Instr]:
    """The entry computation's instructions in schedule order, `call`s expanded."""
    if "is_scheduled=true" not in text.split("\n", 1)[0]:
        raise ValueError("the module is not scheduled (pass compiled.as_text(), not lowered text)")
    comps, entry = _computations(text)
    names_memo: Dict[str, frozenset] = {}

    def names_in(comp: str) -> frozenset:
        if comp not in names_memo:
            names_memo[comp] = frozenset()  # cycles cannot happen in HLO; guard anyway
            acc = set()
            for line in comps.get(comp, []):
                acc.update(_OP_NAME.findall(line))
                for c in _callees(line):
                    acc |= names_in(c)
            names_memo[comp] = frozenset(acc)
        return names_memo[comp]

    def flatten(comp: str) -> List[Instr]:
        seq = []
        for line in comps[comp]:
            name = _INSTR.match(line).group(1)
            rhs = line.split(" = ", 1)[1]
            op = _OPCODE.search(" " + rhs)
            opcode = op.group(1) if op else "?"
            callees = _callees(line)
            if opcode == "call" and len(callees) == 1 and callees[0] in comps:
                seq += flatten(callees[0])
                continue
            tags = set(_OP_NAME.findall(line))
            for c in callees:
                tags |= names_in(c)
            t = _TARGET.search(line)
            seq.append(Instr(name, opcode, t.group(1) if t else "", frozenset(tags)))
        return seq

    return flatten(entry)


def position(seq: List[Instr], target_suffix: str) -> int:
    """Index of the only custom call whose target ends with `target_suffix`."""
    hits = [i for i, ins in enumerate(seq) if ins.target.endswith(target_suffix)]
    if len(hits) != 1:
        raise AssertionError(f"expected one custom call *{target_suffix}, found {len(hits)}")
    return hits[0]


def tagged(seq: List[Instr], scope: str) -> List[int]:
    """Indices of the instructions that compute something under named scope `scope`."""
    return [i for i, ins in enumerate(seq) if ins.tagged(scope) and ins.opcode not in ("parameter", "constant")]
