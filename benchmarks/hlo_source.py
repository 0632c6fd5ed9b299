"""Which Python code made each instruction of a compiled XLA module, so that a profiler's kernels (each named by
its HLO instruction) can be charged to the specjax functions that traced them.

jax writes the call stack of every traced operation into the module: tables of file names, function names, file
locations and stack frames, and on each instruction a `stack_frame_id`. XLA keeps them through its passes, so
the optimized module's text (`compiled.as_text()`) still holds them: a fusion's frame is its root operation's.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import re


@dataclasses.dataclass(frozen=True)
class Frame:
    file: str        # from the specjax package down ("engine/loop.py"), else the file's own name
    function: str
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.function}"


def instruction_stacks(hlo: str) -> dict[str, tuple[Frame, ...]]:
    """Each instruction's call stack, innermost frame first, by instruction name (unique in a module); an
    instruction whose metadata names no frame is left out."""
    files = dict(_table(hlo, "FileNames", r'(\d+) "([^"]*)"'))
    functions = dict(_table(hlo, "FunctionNames", r'(\d+) "([^"]*)"'))
    locations = {i: Frame(_short(files[f]), functions[fn], int(line)) for i, f, fn, line in
                 _table(hlo, "FileLocations", r"(\d+) \{file_name_id=(\d+) function_name_id=(\d+) line=(\d+)")}
    frames = {int(i): (location, int(parent)) for i, location, parent in
              _table(hlo, "StackFrames", r"(\d+) \{file_location_id=(\d+) parent_frame_id=(\d+)")}
    # The text writes a frame's parent one above its id (a root's as 1, the first frame's own id) in the
    # versions seen so far; a table where no frame names itself as parent is read as written. Frames past the
    # innermost few can repeat (a caller's chain copied into an inlined computation's): read the inner ones.
    shift = 1 if any(parent == i for i, (_, parent) in frames.items()) else 0

    def stack(frame: int) -> tuple[Frame, ...]:
        found = []
        while frame in frames and len(found) <= len(frames):
            location, parent = frames[frame]
            found.append(locations[location])
            frame = parent - shift
        return tuple(found)

    return {name: stack(int(frame)) for name, frame in
            re.findall(r"^\s*(?:ROOT )?%?([\w.-]+) = [^\n]*stack_frame_id=(\d+)", hlo, re.M)}


def charged_to(stack: tuple[Frame, ...], caller: str | None = None) -> str:
    """The function a kernel of this stack is charged to, as file:function: the innermost frame, or (caller: a
    file) the frame that the caller file's innermost frame called, i.e. which of that file's calls made it (the
    innermost frame when the caller is not on the stack, "?" for an empty stack)."""
    if not stack:
        return "?"
    calls = [i for i, frame in enumerate(stack) if frame.file == caller]
    return str(stack[calls[0] - 1] if calls and calls[0] > 0 else stack[0])


# Instructions that run as kernels of their own (on a GPU; on a CPU, as loops of their own).
LAUNCHING = ("fusion", "custom-call", "copy", "sort", "dot", "scatter", "gather", "reduce", "dynamic-update-slice",
             "dynamic-slice", "convolution", "all-reduce", "all-gather", "reduce-scatter", "all-to-all")


def launches_per_iteration(hlo: str) -> collections.Counter:
    """How often each launching instruction runs in one iteration of the module's outermost loop of unknown
    trip count (the generate loop: of several such loops outside any loop, the largest), by instruction name: a
    nested loop's body counts its known trip count times (once where unknown: an adaptive loop's iteration counts
    one step of every tier's segment, though one tier runs), a conditional its costliest branch."""
    computations = _computations(hlo)
    loops = [(body, computations[body].count("\n")) for body, config in _outermost_whiles(computations, _entry(hlo))
             if "known_trip_count" not in config]
    counts: collections.Counter = collections.Counter()
    if loops:
        _count(computations, max(loops, key=lambda loop: loop[1])[0], 1, counts)
    return counts


def launches_per_call(hlo: str) -> collections.Counter:
    """How often each launching instruction runs in one call of the module (a step, not a loop): loops of known
    trip count times it, of unknown once, conditionals their costliest branch."""
    computations = _computations(hlo)
    counts: collections.Counter = collections.Counter()
    _count(computations, _entry(hlo), 1, counts)
    return counts


def charged_weights(weighted, stacks: dict, caller: str | None = None) -> collections.Counter:
    """The weights of (instruction, weight) pairs (launches, kernel times) summed by the function each instruction
    is charged to (charged_to)."""
    total = collections.Counter()
    for instruction, weight in weighted:
        total[charged_to(stacks.get(instruction, ()), caller)] += weight
    return total


def _outermost_whiles(computations: dict[str, str], entry: str) -> list[tuple[str, str]]:
    """The while loops (body, backend config) that run outside any loop: in `entry` or what it calls, branches
    included."""
    found, pending, seen = [], [entry], set()
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        text = computations[name]
        found += _whiles([text])
        pending += [branch for branches in _branch_sets(text) for branch in branches] + _calls(text)
    return found


# An instruction's name, shape and opcode; a shape is an array's or a tuple's (a multi-output fusion, a top-k, an
# argmax's variadic reduce: "(f32[4,4]{1,0}, s32[4,4]{1,0})").
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.-]+) = (?:\((?:[^()]|\([^()]*\))*\)|\S+) ([\w-]+)\(", re.M)


def _count(computations: dict[str, str], name: str, times: int, counts: collections.Counter) -> None:
    text = computations[name]
    for instruction, kind in _INSTRUCTION.findall(text):
        if kind in LAUNCHING:
            counts[instruction] += times
    for body, config in _whiles([text]):
        trip = json.loads(config).get("known_trip_count", {}).get("n", 1) if config else 1
        _count(computations, body, times * int(trip), counts)
    for branches in _branch_sets(text):
        costs = []
        for branch in branches:
            branch_counts: collections.Counter = collections.Counter()
            _count(computations, branch, times, branch_counts)
            costs.append(branch_counts)
        counts.update(max(costs, key=lambda c: sum(c.values())))
    for callee in _calls(text):
        _count(computations, callee, times, counts)


def _entry(hlo: str) -> str:
    return re.search(r"^ENTRY %?([\w.-]+) ", hlo, re.M).group(1)


def _branch_sets(text: str) -> list[list[str]]:
    """Each conditional's branch computations in a computation's text: an indexed one's list, or a boolean one's
    pair (how the GPU compiler prints a lax.cond)."""
    indexed = [re.findall(r"%?([\w.-]+)", branches) for branches in re.findall(r"branch_computations=\{([^}]*)\}", text)]
    boolean = [[false, true] for true, false in   # in the indexed form's order: false is branch 0
               re.findall(r"true_computation=%?([\w.-]+), false_computation=%?([\w.-]+)", text)]
    return indexed + boolean


def _calls(text: str) -> list[str]:
    """The computations a computation's text calls (call instructions)."""
    return re.findall(r" call\([^\n]*to_apply=%?([\w.-]+)", text)


def _computations(hlo: str) -> dict[str, str]:
    """Each computation's text (its instructions), by name."""
    return {name: body for name, body in
            re.findall(r"^(?:ENTRY )?%?([\w.-]+) \([^\n]*\{\n(.*?)^\}", hlo, re.M | re.S)}


def _whiles(texts) -> list[tuple[str, str]]:
    """(body computation, backend config or "") of each while loop in the texts."""
    found = []
    for text in texts:
        for line in re.findall(r"^[^\n]* while\([^\n]*$", text, re.M):
            config = re.search(r"backend_config=(\{.*\})", line)
            found.append((re.search(r"body=%?([\w.-]+)", line).group(1), config.group(1) if config else ""))
    return found


def _table(hlo: str, title: str, row: str) -> list[tuple[str, ...]]:
    """The rows of one of the module's trailing tables (a title line, then rows up to a blank line)."""
    found = re.search(rf"^{title}\n((?:.+\n?)*)", hlo, re.M)
    return re.findall(rf"^{row}", found.group(1), re.M) if found else []


def _short(path: str) -> str:
    return path.rsplit("/specjax/", 1)[1] if "/specjax/" in path else path.rsplit("/", 1)[-1]
