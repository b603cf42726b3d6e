"""The `chaos` config value: which faults a run injects, and where (raysb.distributed.chaos fires them).

A spec is a comma-separated list of events, each `KIND@EPOCH[:POINT][:rankN][:committed]`:

- `kill-worker`: a rank's process exits. POINT is a selection round of the
  epoch (0-based; default: halfway) or `checkpoint`, while the epoch's
  checkpoint is being written (after the file, before it is reported).
- `nan`: a rank's weights turn NaN at the epoch's start.

`rankN` picks the rank that acts (default: the last).
`committed` first waits until the checkpoint before this epoch is committed by
Ray Train, so that the restart resumes from it rather than from an older one
(a checkpoint reported moments before a failure may never be committed).

Each event fires once per run: a marker file in the output folder remembers it
across the restarts it causes. Epochs are 1-based, as in the progress lines.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

KINDS = ("kill-worker", "nan")

# Files in a run's --out that remember which chaos events fired.
MARKER_PREFIX = ".chaos-"


class ChaosSpecError(ValueError):
    """A chaos spec that does not parse."""


@dataclass(frozen=True)
class ChaosEvent:
    index: int
    kind: str
    epoch: int
    round: int | None = None
    at_checkpoint: bool = False
    rank: int | None = None
    after_commit: bool = False

    def acting_rank(self, world: int) -> int:
        return world - 1 if self.rank is None else self.rank

    def marker(self, out: str | Path) -> Path:
        return Path(out) / f"{MARKER_PREFIX}{self.index}-{self.kind}-done"


def parse_chaos(spec: str) -> list[ChaosEvent]:
    return [_parse_event(index, event.strip()) for index, event in enumerate(spec.split(","))]


def _parse_event(index: int, event: str) -> ChaosEvent:
    usage = "KIND@EPOCH[:ROUND|:checkpoint][:rankN][:committed] with KIND one of " + ", ".join(KINDS)
    kind, sep, rest = event.partition("@")
    parts = rest.split(":")
    if kind not in KINDS or not sep or not parts[0].isdigit() or int(parts[0]) < 1:
        raise ChaosSpecError(f"chaos event {event!r} is not {usage}")
    fields: dict = {"index": index, "kind": kind, "epoch": int(parts[0])}
    for part in parts[1:]:
        if part.isdigit() and kind != "nan":
            fields["round"] = int(part)
        elif part == "checkpoint" and kind == "kill-worker":
            fields["at_checkpoint"] = True
        elif part.startswith("rank") and part[4:].isdigit():
            fields["rank"] = int(part[4:])
        elif part == "committed" and kind != "nan":
            fields["after_commit"] = True
        else:
            raise ChaosSpecError(f"chaos event {event!r}: {part!r} is not a point, rankN or committed ({usage})")
    if fields.get("at_checkpoint") and "round" in fields:
        raise ChaosSpecError(f"chaos event {event!r}: give a round or checkpoint, not both")
    return ChaosEvent(**fields)
