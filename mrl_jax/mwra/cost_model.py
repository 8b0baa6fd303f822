"""XLA:TPU's own estimate of a compiled program's time, read from ``compiled.as_text()`` -- an estimate, never a
measurement.

Each fusion XLA:TPU emits carries ``"estimated_cycles"`` in its backend config (the compiler's cost model; a bf16
8192^3 matmul on v5e comes out at 88 % of peak at 1.5 GHz). `estimate` adds what that figure leaves out:

* loops: a ``while`` body is priced once by the compiler; here it counts its trip count times (the constant its
  condition compares the counter against, nested loops too). A loop whose condition is data dependent (the
  sampler's decode loop) has no trip count: it is counted once and listed in ``StepTime.open_loops`` with its
  per-iteration time, for the caller to multiply by the iterations it expects.
* Pallas kernels: a ``tpu_custom_call`` carries a placeholder. Each is priced at its roofline,
  max(flops / peak, bytes / HBM bandwidth), from the ``pl.CostEstimate`` it declares, else (JAX's splash and paged
  attention kernels declare none) from its operand shapes: attention FLOPs of its q, k, v at the causal block
  density, dense bytes of its operands and results.
* collectives: bytes each device sends (ring algorithms: all-gather and all-to-all (n-1)/n of the result,
  reduce-scatter (n-1) x its result, all-reduce 2 (n-1)/n) over the chip's ICI bandwidth; no overlap with compute
  is assumed (a serial sum: an upper bound where XLA overlaps them).
* every priced op is at least its own roofline (its matmul FLOPs at peak, its HBM operands and result at the HBM
  bandwidth), so no estimate is below the physical bound.

    t = estimate(jax.jit(f).lower(*args).compile(), CHIPS["v5e"])
    t.seconds, t.matmul, t.pallas, t.collective      # seconds per device
    t.open_loops[0].per_iteration.seconds             # a data-dependent loop's body, once

Chips (per chip; a device is a chip, or one TensorCore of a v4 chip: `for_device`): clock, peak bf16 FLOP/s, HBM
bytes/s, ICI bytes/s per chip in one direction (the pod's all-reduce bandwidth over its chips, or half the
bidirectional ICI figure), from Cloud TPU's system architecture pages (cloud.google.com/tpu/docs/v4, v5e, v5p,
v6e). The clock is peak / (MXU FLOPs per cycle): v4 2 x 4 MXUs of 128^2, v5e 4 x 128^2, v5p 2 x 4 x 128^2; v6e
4 x 256^2 at 1.75 GHz (the page's "two 256x256 MXUs" would mean 3.5 GHz, at which XLA's own 8192^3 matmul estimate
would run at 141 % of peak: impossible, so the least certain entry, checked the day a v6e is lent).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from typing import NamedTuple, Optional


class Chip(NamedTuple):
    """One TPU device's figures: clock (Hz), peak bf16 FLOP/s, HBM bytes/s, ICI bytes/s (one direction)."""

    name: str
    clock_hz: float
    peak_flops: float
    hbm_bytes_per_s: float
    ici_bytes_per_s: float
    source: str

    def share(self, fraction: float) -> "Chip":
        """The figures of a device that is ``fraction`` of a chip (a v4 TensorCore: 1/2); the clock is the chip's."""
        return self._replace(peak_flops=self.peak_flops * fraction, hbm_bytes_per_s=self.hbm_bytes_per_s * fraction,
                             ici_bytes_per_s=self.ici_bytes_per_s * fraction)


_DOCS = "https://cloud.google.com/tpu/docs/"
CHIPS = {
    "v4": Chip("v4", 1.05e9, 275e12, 1200e9, 1.1e15 / 4096, _DOCS + "v4 (all-reduce 1.1 PB/s per 4096-chip pod)"),
    "v5e": Chip("v5e", 1.5e9, 197e12, 819e9, 200e9, _DOCS + "v5e (ICI 400 GB/s bidirectional)"),
    "v5p": Chip("v5p", 1.75e9, 459e12, 2765e9, 600e9, _DOCS + "v5p (ICI 1200 GB/s bidirectional)"),
    "v6e": Chip("v6e", 1.75e9, 918e12, 1638e9, 400e9, _DOCS + "v6e (ICI 800 GB/s bidirectional)"),
}
_KINDS = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5": "v5p", "TPU v5p": "v5p",
          "TPU v6 lite": "v6e", "TPU v6e": "v6e"}
_CORES_PER_CHIP = {"v4": 2, "v5e": 1, "v5p": 2, "v6e": 1}


def for_device(device) -> Optional[Chip]:
    """The `Chip` figures of one ``jax.Device`` of a TPU (a v4 device is one of its chip's two TensorCores);
    None for another platform or an unknown generation."""
    gen = _KINDS.get(getattr(device, "device_kind", ""))
    if gen is None:
        return None
    cores = getattr(device, "num_cores", None) or _CORES_PER_CHIP[gen]
    return CHIPS[gen].share(min(1.0, cores / _CORES_PER_CHIP[gen]))


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Estimated seconds of one program per device, by kind of op; ``flops`` (matmul and kernel FLOPs counted from
    the shapes) and ``hbm_bytes`` (operands and results of priced ops in HBM), loops multiplied out.
    ``open_loops``: the data-dependent loops, each counted once in the figures above."""

    matmul: float = 0.0
    fusion: float = 0.0
    pallas: float = 0.0
    collective: float = 0.0
    copy: float = 0.0
    flops: float = 0.0
    hbm_bytes: float = 0.0
    collective_bytes: float = 0.0
    open_loops: tuple = ()

    _SUMMED = ("matmul", "fusion", "pallas", "collective", "copy", "flops", "hbm_bytes", "collective_bytes")

    @property
    def seconds(self) -> float:
        return self.matmul + self.fusion + self.pallas + self.collective + self.copy

    def __add__(self, other: "StepTime") -> "StepTime":
        return StepTime(**{k: getattr(self, k) + getattr(other, k) for k in self._SUMMED},
                        open_loops=self.open_loops + other.open_loops)

    def __sub__(self, other: "StepTime") -> "StepTime":
        return StepTime(**{k: getattr(self, k) - getattr(other, k) for k in self._SUMMED}, open_loops=self.open_loops)

    def times(self, k: float) -> "StepTime":
        """This program run ``k`` times (its open loops' iterations scaled alike)."""
        return StepTime(**{f: getattr(self, f) * k for f in self._SUMMED},
                        open_loops=tuple(lp._replace(per_iteration=lp.per_iteration.times(k)) for lp in self.open_loops))

    def without_open_loops(self) -> "StepTime":
        """The program outside its data-dependent loops (the sampler: its prefill and the moves between rungs)."""
        out = self
        for lp in self.open_loops:
            out = out - lp.per_iteration
        return dataclasses.replace(out, open_loops=())

    def roofline(self, chip: Chip) -> float:
        """The physical bound of these FLOPs and bytes: max(flops / peak, HBM bytes / bandwidth) + collectives."""
        return max(self.flops / chip.peak_flops, self.hbm_bytes / chip.hbm_bytes_per_s) + \
            self.collective_bytes / chip.ici_bytes_per_s

    def shares(self) -> dict:
        """Fractions of the time in Pallas kernels, collectives and the rest (matmuls, fusions, copies)."""
        s = self.seconds or 1.0
        return {"pallas": self.pallas / s, "collective": self.collective / s,
                "rest": (self.matmul + self.fusion + self.copy) / s}

    def to_dict(self) -> dict:
        return {"seconds": self.seconds, **{k: getattr(self, k) for k in self._SUMMED},
                "open_loops": [{"name": lp.name, "seconds_per_iteration": lp.per_iteration.seconds}
                               for lp in self.open_loops]}


class LoopTime(NamedTuple):
    """A data-dependent ``while`` loop: its instruction name and one iteration's time (body and condition)."""

    name: str
    per_iteration: StepTime


def estimate(compiled, chip: Chip) -> StepTime:
    """``compiled`` (a ``jax.stages.Compiled`` for TPU, or its ``as_text()``) priced on ``chip`` (see module doc)."""
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    return _Program(text, chip).entry()


# ----------------------------------------------------------------------------------------------- HLO text
_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\](\{[^}]*\})?")
_HEADER = re.compile(r"^(ENTRY )?%([\w.\-]+) .*\{$")
_INSTR = re.compile(r"^\s*(ROOT )?%([\w.\-]+) = (.*)$")
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
         "replica-id", "opt-barrier", "add-dependency"}
_SLICING = ("dynamic-slice", "slice", "gather")
_LAYOUT = ("copy", "bitcast", "transpose", "reshape")
_COLLECTIVES = {"all-gather": "gather", "all-gather-start": "gather", "all-reduce": "reduce",
                "all-reduce-start": "reduce", "reduce-scatter": "scatter", "all-to-all": "gather",
                "collective-permute": "permute", "collective-permute-start": "permute",
                "collective-broadcast": "permute"}


class _Instr(NamedTuple):
    name: str
    type: str       # the result type text
    op: str
    operands: tuple  # operand instruction names
    args: str        # the text between the opcode's parentheses (a constant's literal)
    attrs: str
    root: bool = False  # the computation's ROOT


def _arrays(type_text: str) -> list:
    """[(dtype, dims tuple, in HBM)] of a type (tuples flattened); arrays in another memory space (``S(n)``:
    VMEM, SMEM) are not HBM."""
    out = []
    for dt, dims, layout in _ARRAY.findall(type_text):
        if dt in _DTYPE_BYTES:
            shape = tuple(int(d) for d in dims.split(",") if d)
            out.append((dt, shape, "S(" not in (layout or "")))
    return out


def _bytes(type_text: str, hbm_only: bool = False) -> float:
    return sum(_DTYPE_BYTES[dt] * _prod(shape) for dt, shape, hbm in _arrays(type_text) if hbm or not hbm_only)


def _prod(xs) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


def _split_balanced(s: str, start: int) -> int:
    """Index just past the bracket group opening at ``s[start]``."""
    depth, pairs = 0, {"(": ")", "{": "}", "[": "]"}
    closing = set(pairs.values())
    for i in range(start, len(s)):
        c = s[i]
        if c in pairs:
            depth += 1
        elif c in closing:
            depth -= 1
            if depth == 0:
                return i + 1
    return len(s)


def _parse_instr(line: str) -> Optional[_Instr]:
    m = _INSTR.match(line)
    if m is None:
        return None
    root, name, rest = m.groups()
    end = _split_balanced(rest, 0) if rest.startswith("(") else rest.index(" ")
    type_text, rest = rest[:end], rest[end:].lstrip()
    op_end = rest.find("(")
    if op_end < 0:
        return None
    op = rest[:op_end]
    close = _split_balanced(rest, op_end)
    operands = tuple(re.findall(r"%([\w.\-]+)", rest[op_end:close]))
    return _Instr(name, type_text, op, operands, rest[op_end + 1:close - 1], rest[close:], root is not None)


def _computations(text: str) -> tuple[dict, str]:
    """({computation name: [instructions]}, the entry computation's name). An instruction may span lines (a
    kernel's metadata): a line that starts neither an instruction nor a computation's end continues the last."""
    comps, entry, current, pending = {}, None, None, []

    def flush():
        if pending:
            ins = _parse_instr(" ".join(pending))
            if ins is not None:
                current.append(ins)
            pending.clear()
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m:
                current = comps.setdefault(m.group(2), [])
                entry = m.group(2) if m.group(1) else entry
        elif line.rstrip() == "}":
            flush()
            current = None
        elif _INSTR.match(line):
            flush()
            pending.append(line)
        elif pending:
            pending.append(line)
    return comps, entry


def _attr(attrs: str, key: str) -> Optional[str]:
    m = re.search(rf"\b{key}=%([\w.\-]+)", attrs)
    return m.group(1) if m else None


def _backend(attrs: str) -> dict:
    i = attrs.find("backend_config=")
    if i < 0:
        return {}
    start = i + len("backend_config=")
    try:
        return json.loads(attrs[start:_split_balanced(attrs, start)])
    except ValueError:
        return {}


def _group_size(attrs: str) -> int:
    """Devices in one replica group of a collective (explicit ``{{0,1},{2,3}}``, iota ``[2,4]<=[8]`` or mesh axes
    ``mesh['x'=4,'y'=2] {'x'}`` forms)."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if m:
        sizes = dict((k, int(v)) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1)))
        return _prod(sizes[a] for a in re.findall(r"'([^']+)'", m.group(2)))
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", attrs)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", attrs)
    if m:
        return len([x for x in m.group(1).split(",") if x])
    m = re.search(r"source_target_pairs=\{", attrs)
    return 2 if m else 1


class _Program:
    """One compiled module's computations, priced on a chip (memoised per computation)."""

    def __init__(self, text: str, chip: Chip):
        self.comps, self.entry_name = _computations(text)
        self.chip = chip
        self.types = {c: {i.name: i.type for i in ins} for c, ins in self.comps.items()}

    def entry(self) -> StepTime:
        return self.computation(self.entry_name)

    @functools.lru_cache(maxsize=None)
    def computation(self, name: str) -> StepTime:
        total = StepTime()
        for ins in self.comps.get(name, ()):
            total = total + self.instruction(name, ins)
        return total

    @functools.lru_cache(maxsize=None)
    def matmul_flops(self, name: str) -> float:
        """FLOPs of the convolutions and dots of computation ``name`` and what it calls (a fusion's body)."""
        flops = 0.0
        for ins in self.comps.get(name, ()):
            if ins.op in ("convolution", "dot"):
                flops += self._dot_flops(name, ins)
            for sub in re.findall(r"\b(?:calls|to_apply)=%([\w.\-]+)", ins.attrs):
                flops += self.matmul_flops(sub)
        return flops

    def _dot_flops(self, comp: str, ins: _Instr) -> float:
        out = _prod(_arrays(ins.type)[0][1])
        shapes = [_arrays(self.types[comp].get(o, ""))[0][1] if _arrays(self.types[comp].get(o, "")) else ()
                  for o in ins.operands[:2]]
        if ins.op == "dot":
            dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
            k = _prod(shapes[0][int(d)] for d in dims.group(1).split(",") if d) if dims and shapes[0] else 1
            return 2.0 * out * k
        labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.attrs)
        rhs = shapes[1] if len(shapes) > 1 else ()
        if not labels or not rhs or "i" not in labels.group(2):
            return 0.0
        lhs_labels, rhs_labels, out_labels = labels.groups()
        out_shape = _arrays(ins.type)[0][1]
        dense = _prod(n for n, c in zip(out_shape, out_labels) if not c.isdigit())   # batch x output features
        return 2.0 * dense * rhs[rhs_labels.index("i")] * _window_taps(ins.attrs, shapes[0], lhs_labels, out_shape,
                                                                       out_labels)

    def _hbm_bytes(self, comp: str, ins: _Instr) -> float:
        """HBM bytes an op moves: its result written and its operands read, except that an operand only sliced
        (``dynamic-slice``, ``slice``, ``gather``: one layer of stacked weights in a scan, one block of K in a
        blockwise loop) is read for its slices alone, and a buffer updated in place (``dynamic-update-slice``)
        is neither read nor written beyond its update."""
        sub = _attr(ins.attrs, "calls") if ins.op == "fusion" else None
        reads, written = self._fused_access(sub) if sub else self._access(comp, ins)
        total = 0.0
        for i, o in enumerate(ins.operands):
            arrays = _arrays(self.types[comp].get(o, ""))
            if arrays and arrays[0][2]:
                total += min(reads.get(i, math.inf), _bytes(self.types[comp].get(o, "")))
        for i, (dt, shape, hbm) in enumerate(_arrays(ins.type)):
            if hbm:
                total += min(written.get(i, math.inf), _DTYPE_BYTES[dt] * _prod(shape))
        return total

    def _access(self, comp: str, ins: _Instr) -> tuple[dict, dict]:
        """({operand index: bytes read}, {result index: bytes written}) where an op reads or writes less than
        whole arrays; the others read and write all of theirs."""
        if ins.op in _SLICING:
            return {0: _bytes(ins.type)}, {}
        if ins.op == "dynamic-update-slice" and len(ins.operands) > 1:
            update = _bytes(self.types[comp].get(ins.operands[1], ""))
            return {0: 0.0}, {0: update}
        return {}, {}

    @functools.lru_cache(maxsize=None)
    def _fused_access(self, sub: str) -> tuple[dict, dict]:
        """`_access` of a fusion, from its body: a parameter whose every use slices it, or is the buffer of an
        in-place update, is read for that alone; a result that is such an update is written for its update."""
        body = self.comps.get(sub, ())
        users: dict = {}
        for ins in body:
            for k, o in enumerate(ins.operands):
                users.setdefault(o, []).append((ins, k))
        reads = {}
        for ins in body:
            if ins.op != "parameter" or not re.fullmatch(r"\d+", ins.args.strip()):
                continue
            read = self._reads_of(sub, ins.name, users)
            if read is not None:
                reads[int(ins.args)] = read
        root = next((i for i in body if i.root), None)
        outputs = list(root.operands) if root is not None and root.op == "tuple" else [root.name] if root else []
        table = {i.name: i for i in body}
        written = {}
        for j, name in enumerate(outputs):
            out = table.get(name)
            if out is not None and out.op == "dynamic-update-slice":
                written[j] = self._access(sub, out)[1][0]
        return reads, written

    def _reads_of(self, comp: str, name: str, users: dict) -> Optional[float]:
        """Bytes of value ``name`` that its users in fusion body ``comp`` read when they read only part of it
        (slices, the buffer of an in-place update, through layout changes and nested fusions that do either),
        else None (read whole)."""
        read = [self._partial_read(comp, u, k, users) for u, k in users.get(name, [])]
        return sum(read) if read and None not in read else None

    def _partial_read(self, comp: str, user: _Instr, k: int, users: dict) -> Optional[float]:
        if user.op in _LAYOUT and k == 0:
            return self._reads_of(comp, user.name, users)
        if user.op == "fusion" and _attr(user.attrs, "calls"):
            body = _attr(user.attrs, "calls")
            read = self._fused_access(body)[0].get(k)
            if read is None and all(i.op in _LAYOUT + ("parameter",) for i in self.comps.get(body, ())):
                return self._reads_of(comp, user.name, users)
            return read
        return self._access(comp, user)[0].get(k) if k == 0 else None

    def instruction(self, comp: str, ins: _Instr) -> StepTime:
        op = ins.op
        if op == "while":
            return self._loop(comp, ins)
        if op == "conditional":
            branches = re.findall(r"%([\w.\-]+)", (re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
                                                     or re.search(r"(true_computation=.*)", ins.attrs)).group(1))
            return max((self.computation(b) for b in branches), key=lambda t: t.seconds, default=StepTime())
        if op in ("call", "async-start"):
            sub = _attr(ins.attrs, "to_apply") or _attr(ins.attrs, "calls")
            return self.computation(sub) if sub else StepTime()
        if op in _COLLECTIVES:
            return self._collective(ins)
        if op == "custom-call" and 'custom_call_target="tpu_custom_call"' in ins.attrs:
            return self._kernel(comp, ins)
        if op in _FREE:
            return StepTime()
        cycles = _backend(ins.attrs).get("window_config", {}).get("estimated_cycles")
        if cycles is None and op == "copy-start":   # an async copy into VMEM (a prefetch): its HBM read
            nbytes = sum(_bytes(self.types[comp].get(o, ""), True) for o in ins.operands)
            return StepTime(copy=nbytes / self.chip.hbm_bytes_per_s, hbm_bytes=nbytes)
        if cycles is None:
            return StepTime()
        sub = _attr(ins.attrs, "calls")
        flops = self.matmul_flops(sub) if sub else (self._dot_flops(comp, ins) if op in ("convolution", "dot") else 0)
        nbytes = self._hbm_bytes(comp, ins)
        seconds = max(int(cycles) / self.chip.clock_hz, flops / self.chip.peak_flops,
                      nbytes / self.chip.hbm_bytes_per_s)
        kind = "copy" if op.startswith("copy") else ("matmul" if flops else "fusion")
        return StepTime(**{kind: seconds}, flops=flops, hbm_bytes=nbytes)

    def _loop(self, comp: str, ins: _Instr) -> StepTime:
        body = self.computation(_attr(ins.attrs, "body")) + self.computation(_attr(ins.attrs, "condition"))
        trips = self._trip_count(comp, ins)
        if trips is None:
            return dataclasses.replace(body, open_loops=(LoopTime(ins.name, body),) + body.open_loops)
        return body.times(trips)

    def _trip_count(self, comp: str, ins: _Instr) -> Optional[int]:
        """The ``known_trip_count`` XLA recorded, else N - init of a condition ``counter < N`` with constant N and
        a constant initial counter (0 when not found); None when the condition is data dependent."""
        known = _backend(ins.attrs).get("known_trip_count", {}).get("n")
        if known is not None:
            return int(known)
        cond = {i.name: i for i in self.comps.get(_attr(ins.attrs, "condition"), ())}
        root = list(cond.values())[-1] if cond else None
        if root is None or root.op != "compare" or len(root.operands) != 2:
            return None
        counter, limit = (cond.get(o) for o in root.operands)
        if counter is None or limit is None or counter.op != "get-tuple-element" or limit.op != "constant":
            return None
        n = _literal(limit)
        if n is None:
            return None
        index = int(re.search(r"index=(\d+)", counter.attrs).group(1))
        init = self._initial(comp, ins.operands[0], index)
        direction = re.search(r"direction=(\w+)", root.attrs).group(1)
        trips = n - init + (1 if direction == "LE" else 0)
        return max(trips, 0) if direction in ("LT", "LE") else None

    def _initial(self, comp: str, tuple_name: str, index: int) -> int:
        """The constant the loop's counter starts from (element ``index`` of its initial tuple), 0 if unknown."""
        table = {i.name: i for i in self.comps.get(comp, ())}
        t = table.get(tuple_name)
        if t is None or t.op != "tuple" or index >= len(t.operands):
            return 0
        x = table.get(t.operands[index])
        while x is not None and x.op == "copy" and x.operands:
            x = table.get(x.operands[0])
        return (_literal(x) or 0) if x is not None and x.op == "constant" else 0

    def _collective(self, ins: _Instr) -> StepTime:
        n = _group_size(ins.attrs)
        if n <= 1:
            return StepTime()
        data = max((_DTYPE_BYTES[dt] * _prod(s) for dt, s, _ in _arrays(ins.type)), default=0)
        kind = _COLLECTIVES[ins.op]
        sent = {"gather": data * (n - 1) / n, "reduce": 2 * data * (n - 1) / n, "scatter": data * (n - 1),
                "permute": data}[kind]
        return StepTime(collective=sent / self.chip.ici_bytes_per_s, collective_bytes=sent)

    def _kernel(self, comp: str, ins: _Instr) -> StepTime:
        """A Pallas kernel at its roofline: its declared ``CostEstimate``, else `kernel_cost` of its shapes."""
        declared = _backend(ins.attrs).get("custom_call_config", {}).get("cost_estimate")
        operands = [_arrays(self.types[comp].get(o, "")) for o in ins.operands]
        flops, nbytes = kernel_cost(ins.name, [a[0] if a else None for a in operands], _arrays(ins.type))
        if declared:
            flops, nbytes = float(declared.get("flops", 0)), float(declared.get("bytes_accessed", 0)) or nbytes
        seconds = max(flops / self.chip.peak_flops, nbytes / self.chip.hbm_bytes_per_s)
        return StepTime(pallas=seconds, flops=flops, hbm_bytes=nbytes)


def _window_taps(attrs: str, lhs: tuple, lhs_labels: str, out: tuple, out_labels: str) -> int:
    """The (output position, window tap) pairs of a convolution that meet an input element, over its spatial
    dimensions: the product of its window sizes for a plain convolution; far fewer where the input is dilated,
    as in XLA:TPU's batched matmuls written as convolutions (``lhs_dilate``: every tap but one meets a hole)."""
    window = dict(re.findall(r"(\w+)=([\dx_\-]+)", (re.search(r"window=\{([^}]*)\}", attrs) or [None, ""])[1]))
    spatial = sorted(int(c) for c in out_labels if c.isdigit())

    def per_dim(key, default):
        return [tuple(int(v) for v in x.split("_")) if "_" in x else int(x) for x in window[key].split("x")] \
            if key in window else [default] * len(spatial)
    size, stride, pad = per_dim("size", 1), per_dim("stride", 1), per_dim("pad", (0, 0))
    lhs_dilate, rhs_dilate = per_dim("lhs_dilate", 1), per_dim("rhs_dilate", 1)
    taps = 1
    for j, dim in enumerate(spatial):
        n_in, n_out = lhs[lhs_labels.index(str(dim))], out[out_labels.index(str(dim))]
        hits = 0
        for o in range(n_out):
            for t in range(size[j]):
                x = o * stride[j] + t * rhs_dilate[j] - pad[j][0]
                hits += x >= 0 and x % lhs_dilate[j] == 0 and x // lhs_dilate[j] < n_in
        taps *= hits
    return taps


def _literal(ins: _Instr) -> Optional[int]:
    """The integer literal of a scalar ``constant`` instruction, else None."""
    return int(ins.args) if re.fullmatch(r"-?\d+", ins.args.strip()) else None


def kernel_cost(name: str, operands: list, results: list) -> tuple[float, float]:
    """(FLOPs, bytes) of a Pallas kernel call ``name`` from its operand arrays [(dtype, shape, hbm) or None] and
    results: JAX's splash attention kernels (``splash_mha_fwd`` / ``_dq`` / ``_dkv``: 2, 3 and 4 matmuls of
    q [.., H, Tq, D] by k [.., K, Tk, D] at the causal density of Tq queries ending at key Tk) and its paged decode
    kernel (one query per sequence over the whole cache its page table spans); other kernels: no FLOPs. Bytes: the
    operands and results, dense."""
    arrays = [a for a in operands if a is not None]
    nbytes = sum(_DTYPE_BYTES[dt] * _prod(s) for dt, s, _ in arrays + list(results))
    floats = [s for dt, s, _ in arrays if dt in ("f32", "bf16", "f16") and len(s) >= 3]
    if name.startswith("splash_") and len(floats) >= 3:
        q, k = floats[0], floats[1]
        tq, tk, d = q[-2], k[-2], q[-1]
        pairs = tq * max(tk - tq, 0) + tq * (tq + 1) / 2 if tk >= tq else tq * tk / 2
        one = 2.0 * _prod(q[:-2]) * pairs * d
        matmuls = 3 if "_dq" in name else 4 if "_dkv" in name else 2
        return matmuls * one, nbytes
    if "paged_attention" in name and len(floats) >= 3:
        q, pages = floats[0], floats[1]
        table = next((s for dt, s, _ in arrays if dt == "s32" and len(s) == 2), None)
        tokens = table[1] * pages[-2] if table else pages[-3] * pages[-2]
        kv = 2 * _prod(pages[:1]) * tokens * pages[-1] * _DTYPE_BYTES[next(dt for dt, s, _ in arrays if s == pages)]
        seqs = table[0] if table else q[0]
        return 4.0 * _prod(q) * tokens, kv * seqs + sum(_DTYPE_BYTES[dt] * _prod(s) for dt, s, _ in [arrays[0]] +
                                                        list(results))
    return 0.0, nbytes


__all__ = ["CHIPS", "Chip", "LoopTime", "StepTime", "estimate", "for_device", "kernel_cost"]
