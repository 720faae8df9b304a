"""Which of a run's steps compile: a rank's compiled step (`worker.step.TrainStep`, mx.compile) is traced once per
input shapes, so a step on which some rank meets a batch shape new to its process waits for that compile.

One rule for both predictions of it: the rehearsal's census of the run's steps (`worker.objectives.step_census`)
and calibration's sample of them (`worker.bench.predict_point`). Pure; no mlx (the bench imports it before mlx).

Compatibility: Python 3.9+ (the nodes' python); stdlib only.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence


def meets_new_shape(steps: Iterable[Sequence[Hashable]]) -> list[bool]:
    """For each step, in order (each given as every rank's batch shape, in rank order), whether some rank meets a
    shape it has not met before."""
    seen: list[set[Hashable]] = []
    flags = []
    for shapes in steps:
        seen.extend(set() for _ in range(len(shapes) - len(seen)))
        flags.append(any(shape not in seen[r] for r, shape in enumerate(shapes)))
        for r, shape in enumerate(shapes):
            seen[r].add(shape)
    return flags
