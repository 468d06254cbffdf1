"""The pages' charts, drawn on the server as inline SVG (no script, no chart library, nothing loaded from
another host: the pages' Content-Security-Policy allows none).

This module computes geometry only: positions, sizes, CSS classes (colours live in static/style.css) and
the text of each mark's tooltip (an SVG ``<title>``). ``templates/_charts.html`` draws it, so every text
passes the pages' escaping. Each chart also carries a one-sentence summary for its ``aria-label``, and
the numbers it draws are in a table or list next to it on the page.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from durable_dataflow.core.units import US_PER_S
from durable_dataflow.dataflow.protocol import runs, views

HOUR_US = 3_600 * US_PER_S
DAY_US = views.DAY_US
# The windows a page offers (days); a window of one day is charted per hour, longer ones per day.
WINDOW_DAYS = (1, 7, 14, 30, 90)
WINDOW_DAYS_DEFAULT = 14
# Drawing sizes, in SVG user units (the SVG scales to the page's width).
PLOT_WIDTH = 720.0
PLOT_HEIGHT = 160.0
AXIS_LEFT = 44.0
PLOT_TOP = 10.0  # room above the axis' top label
AXIS_BOTTOM = 22.0
LABEL_WIDTH = 220.0
ROW_HEIGHT = 22.0
NAME_CHARS_SHOWN_MAX = 32
LANE_HEIGHT = 26.0
X_TICKS = 6


@dataclass(frozen=True)
class Mark:
    """A rectangle (a bar, a phase) or, with ``width`` 0, a dot at (x, y)."""

    x: float
    y: float
    width: float
    height: float
    css: str
    title: str


@dataclass(frozen=True)
class Label:
    x: float
    y: float
    text: str
    anchor: str = "start"  # SVG text-anchor: start, middle, end


@dataclass(frozen=True)
class Chart:
    """One SVG: its size, marks, axis labels, grid lines (y positions), legend and summary."""

    width: float
    height: float
    marks: tuple[Mark, ...]
    labels: tuple[Label, ...]
    grid: tuple[float, ...]
    legend: tuple[tuple[str, str], ...]  # (css class, text)
    summary: str

    @property
    def empty(self) -> bool:
        return not self.marks


def window_of(days: int) -> tuple[int, int]:
    """A page's window of ``days`` (1 to the longest of ``WINDOW_DAYS``) and its bucket: an hour for up to
    two days, a day for longer windows."""
    chosen = min(max(1, days), max(WINDOW_DAYS))
    return chosen, HOUR_US if chosen <= 2 else DAY_US


def window_choices(days: int) -> tuple[int, ...]:
    """The windows a page's select offers: ``WINDOW_DAYS``, and ``days`` when a link asked for another, so
    the select shows the window drawn and submitting the form keeps it."""
    return tuple(sorted({*WINDOW_DAYS, days}))


def _nice_ceiling(value: float) -> float:
    """The smallest of 2, 4, 6, 10 × 10^k at or above ``value`` (at least 2): a round top for a count axis
    whose middle line is a whole number too."""
    if value <= 2:
        return 2.0
    power = 10.0 ** math.floor(math.log10(value))
    return next(float(step * power) for step in (1, 2, 4, 6, 10) if step * power >= value)


def _bucket_text(start_us: int, bucket_us: int) -> str:
    moment = dt.datetime.fromtimestamp(start_us / US_PER_S, tz=dt.UTC)
    return moment.strftime("%H:00") if bucket_us < DAY_US else moment.strftime("%m-%d")


def _bucket_title(start_us: int, bucket_us: int) -> str:
    moment = dt.datetime.fromtimestamp(start_us / US_PER_S, tz=dt.UTC)
    return moment.strftime("%Y-%m-%d %H:00 UTC") if bucket_us < DAY_US else moment.strftime("%Y-%m-%d (UTC)")


def outcome_columns(
    counts: Iterable[tuple[int, str, int]],
    *,
    start_us: int,
    now_us: int,
    bucket_us: int,
    outcomes: Sequence[str] = runs.ACTIVITY_OUTCOMES,
    what: str = "runs",
) -> Chart:
    """Stacked columns: one per bucket from ``start_us`` to the bucket holding ``now_us`` (empty ones
    included, so the x axis is time), stacked by outcome in ``outcomes`` order (other outcomes are left
    out), from ``runs.outcome_counts`` rows."""
    buckets = list(range(start_us, now_us - now_us % bucket_us + 1, bucket_us))
    per: dict[int, dict[str, int]] = {b: {} for b in buckets}
    for bucket, outcome, n in counts:
        if bucket in per and outcome in outcomes:
            per[bucket][outcome] = per[bucket].get(outcome, 0) + n
    top = _nice_ceiling(max((sum(c.values()) for c in per.values()), default=0))
    slot = PLOT_WIDTH / max(1, len(buckets))
    scale = PLOT_HEIGHT / top
    marks: list[Mark] = []
    labels: list[Label] = []
    every = max(1, math.ceil(len(buckets) / 12))  # at most about 12 x labels
    for index, bucket in enumerate(buckets):
        x = AXIS_LEFT + index * slot
        base = PLOT_TOP + PLOT_HEIGHT
        for outcome in outcomes:
            n = per[bucket].get(outcome, 0)
            if n:
                height = n * scale
                base -= height
                title = f"{_bucket_title(bucket, bucket_us)}: {n} {outcome}"
                marks.append(Mark(x + slot * 0.1, base, slot * 0.8, height, _css(outcome), title))
        if index % every == 0:
            labels.append(Label(x + slot / 2, PLOT_TOP + PLOT_HEIGHT + 16, _bucket_text(bucket, bucket_us), "middle"))
    grid = (PLOT_TOP, PLOT_TOP + PLOT_HEIGHT / 2, PLOT_TOP + PLOT_HEIGHT)
    for y, value in zip(grid, (top, top / 2, 0.0), strict=True):
        labels.append(Label(AXIS_LEFT - 6, y + 4, f"{round(value):,}", "end"))
    totals = {o: sum(c.get(o, 0) for c in per.values()) for o in outcomes}
    unit = "hour" if bucket_us < DAY_US else "day"
    summary = f"{what} per {unit}, {len(buckets)} {unit}s: " + ", ".join(f"{n} {o}" for o, n in totals.items())
    return Chart(
        width=AXIS_LEFT + PLOT_WIDTH,
        height=PLOT_TOP + PLOT_HEIGHT + AXIS_BOTTOM,
        marks=tuple(marks),
        labels=tuple(labels),
        grid=grid,
        legend=tuple((_css(o), f"{o} ({totals[o]})") for o in outcomes),
        summary=summary,
    )


def duration_bars(stats: Sequence[runs.DurationStats], *, more: bool = False) -> Chart:
    """One row per definition: a bar to its mean duration and a tick at its longest, on one linear axis
    from 0 to the longest of all (so rows compare), the numbers written at the row's end; ``more``: other
    definitions had succeeded runs too (the summary says these are the ones with the most)."""
    longest = max((s.max_us for s in stats), default=0)
    scale = (PLOT_WIDTH - LABEL_WIDTH) / longest if longest else 0.0
    marks: list[Mark] = []
    labels: list[Label] = []
    for index, s in enumerate(stats):
        y = index * ROW_HEIGHT
        name = s.definition_name
        shown = name if len(name) <= NAME_CHARS_SHOWN_MAX else name[: NAME_CHARS_SHOWN_MAX - 1] + "…"
        mean, most = views.duration_text(s.mean_us), views.duration_text(s.max_us)
        title = f"{name}: {s.runs} succeeded run(s), mean {mean}, longest {most}"
        labels.append(Label(LABEL_WIDTH - 8, y + 15, shown, "end"))
        marks.append(Mark(LABEL_WIDTH, y + 4, max(1.0, s.mean_us * scale), ROW_HEIGHT - 8, "bar-mean", title))
        marks.append(Mark(LABEL_WIDTH + s.max_us * scale - 1, y + 2, 2.0, ROW_HEIGHT - 4, "bar-max", title))
        labels.append(Label(PLOT_WIDTH + 6, y + 15, f"{mean} · max {most} · {s.runs}"))
    return Chart(
        width=PLOT_WIDTH + 220,
        height=max(1, len(stats)) * ROW_HEIGHT,
        marks=tuple(marks),
        labels=tuple(labels),
        grid=(),
        legend=(("bar-mean", "mean"), ("bar-max", "longest")),
        summary=(
            f"mean and longest duration of succeeded runs, {len(stats)} definition(s)"
            + (f": the {len(stats)} with the most succeeded runs, others left out" if more else "")
        ),
    )


@dataclass(frozen=True)
class TimelineEntry:
    seq: int
    attempt: int
    kind: str
    at_us: int


def run_timeline(entries: Sequence[TimelineEntry], phases: Sequence[views.Phase], end_us: int) -> Chart:
    """A run on a time axis: its phases as one band on top, then one lane per attempt (``run`` for the
    entries of no attempt) with a dot per ledger entry at its recording time, from the first entry to
    ``end_us`` (the last entry, or now while the run has not finished). Axis labels are offsets from
    the first entry."""
    if not entries:
        return Chart(PLOT_WIDTH, 0.0, (), (), (), (), "no ledger entries")
    # From the earliest entry to the latest (or ``end_us``): a clock stepped back between two entries
    # moves a mark, it never draws one off the chart.
    start = min(e.at_us for e in entries)
    span = max(1, max(end_us, *(e.at_us for e in entries)) - start)
    left = 90.0
    width = PLOT_WIDTH - left
    scale = width / span
    attempts = sorted({e.attempt for e in entries})
    lane_of = {attempt: index + 1 for index, attempt in enumerate(attempts)}
    marks: list[Mark] = []
    labels: list[Label] = [Label(left - 8, LANE_HEIGHT / 2 + 5, "phases", "end")]
    for index, phase in enumerate(phases):
        x = left + (phase.start_us - start) * scale
        marks.append(
            Mark(
                x, 4.0, max(1.5, max(0, phase.end_us - phase.start_us) * scale), LANE_HEIGHT - 8,
                f"phase phase-{index % 4}", f"{phase.name}: {views.duration_text(phase.end_us - phase.start_us)}",
            )
        )  # fmt: skip
    for attempt, lane in lane_of.items():
        labels.append(
            Label(left - 8, lane * LANE_HEIGHT + LANE_HEIGHT / 2 + 5, f"attempt {attempt}" if attempt else "run", "end")
        )
    for e in entries:
        x = left + (e.at_us - start) * scale
        title = f"#{e.seq} {e.kind} at +{views.duration_text(e.at_us - start)} ({views.time_text(e.at_us, 'utc')})"
        marks.append(Mark(x, lane_of[e.attempt] * LANE_HEIGHT + LANE_HEIGHT / 2, 0.0, 0.0, _entry_css(e.kind), title))
    height = (len(attempts) + 1) * LANE_HEIGHT
    for tick in range(X_TICKS):
        offset = span * tick // (X_TICKS - 1)
        labels.append(Label(left + offset * scale, height + 16, f"+{views.duration_text(offset)}", "middle"))
    return Chart(
        width=PLOT_WIDTH + 40,
        height=height + AXIS_BOTTOM,
        marks=tuple(marks),
        labels=tuple(labels),
        grid=tuple(lane * LANE_HEIGHT + LANE_HEIGHT / 2 for lane in lane_of.values()),
        legend=tuple((_entry_css(kind), kind) for kind in ENTRY_FAMILIES),
        summary=(
            f"{len(entries)} ledger entries over {views.duration_text(span)} in {len(phases)} phase(s), "
            f"{len([a for a in attempts if a])} attempt(s)"
        ),
    )


# The timeline's dot colours, by the first word of an entry's kind (``attempt.started`` → attempt).
ENTRY_FAMILIES = ("run", "attempt", "dispatch", "publication", "reconcile")


def _entry_css(kind: str) -> str:
    family = kind.split(".", 1)[0]
    return f"dot dot-{family if family in ENTRY_FAMILIES else 'other'}"


def _css(outcome: str) -> str:
    return "bar-" + outcome.replace(" ", "-").replace("_", "-")
