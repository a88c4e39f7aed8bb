"""The bench's spreads and verdicts, on synthetic timings: no test here times anything.

A ratio is judged by its interquartile range over paired rounds: ``met`` when all of it is at or
below the target, ``MISSED`` when all of it is above, ``unsure`` when it straddles the target,
``invalid`` when its median is below a floor no implementation can beat (measured again, and
never printed as a number). :func:`fovi_ref.check.bench.timing.measure` is driven by a fake clock.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from fovi_ref.check.bench import layers, targets, timing
from fovi_ref.check.bench.timing import Ratio, paired_ratio, verdict


def test_paired_ratio_is_the_median_and_quartiles_of_per_round_ratios():
    num = [2.0, 2.2, 1.8, 2.0, 20.0]  # one wild round: the median does not move
    den = [1.0, 1.0, 1.0, 1.0, 1.0]
    r = paired_ratio(num, den)
    assert (r.median, r.low, r.high, r.rounds) == (2.0, 2.0, 2.2, 5)
    assert r.text() == "2.00±0.10" and r.valid


def test_rounds_pair_up_so_a_slow_phase_cancels():
    # The machine slows down 10x for two rounds; both contenders see it, the ratio does not.
    num = [1.0, 10.0, 10.0, 1.0]
    den = [2.0, 20.0, 20.0, 2.0]
    assert paired_ratio(num, den).spread == 0.0


@pytest.mark.parametrize(
    "low,high,expected",
    [(0.70, 0.78, "met"), (0.70, 0.80, "met"), (0.81, 0.90, "MISSED"), (0.75, 0.85, "unsure")],
)
def test_verdict_reads_the_interquartile_range(low, high, expected):
    ratio = Ratio((low + high) / 2, low, high, rounds=10)
    assert verdict(ratio, 0.8) == expected


def test_a_ratio_below_its_floor_is_invalid_and_never_printed():
    r = paired_ratio([0.1] * 5, [1.0] * 5, floor=timing.FLOOR_VALID)  # 10x below the floor
    assert not r.valid and verdict(r, 2.0) == "invalid" and r.text() == "invalid"
    assert paired_ratio([1.2] * 5, [1.0] * 5, floor=timing.FLOOR_VALID).valid


def test_a_row_takes_its_worst_verdict():
    assert timing.overall(["met", "unsure"]) == "unsure"
    assert timing.overall(["met", "MISSED", "unsure"]) == "MISSED"
    assert timing.overall(["MISSED", "invalid"]) == "invalid"
    assert timing.overall([]) == "-"


class FakeClock:
    """A clock that moves only when a contender runs: each call advances it by the contender's
    next synthetic duration."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def contender(self, durations):
        it = itertools.cycle(durations)

        def run():
            self.now += next(it)

        return run


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(timing, "clock", fake)
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=fake))
    return fake


def test_measure_stops_at_the_band_when_the_spread_is_small(clock):
    contenders = {"a": clock.contender([1.0]), "b": clock.contender([2.0])}
    t = timing.measure(contenders, ratios=[("a", "b")], repeats=5, warmup=1)
    assert (t.stopped, t.rounds) == ("band", 5)
    assert t.ratio("a", "b").median == 0.5 and "within 10%" in t.stop_note()


def test_measure_adds_rounds_until_the_cap_when_the_spread_stays_wide(clock):
    contenders = {"a": clock.contender([1.0, 3.0]), "b": clock.contender([1.0])}
    t = timing.measure(
        contenders, ratios=[("a", "b")], repeats=4, warmup=0, max_rounds=12, cap_s=1e9
    )
    assert (t.stopped, t.rounds) == ("cap", 12)
    assert "cap" in t.stop_note()
    t = timing.measure(contenders, ratios=[("a", "b")], repeats=4, warmup=0, cap_s=10.0)
    assert t.stopped == "cap" and t.rounds < 12  # the time cap (fake seconds) came first


def test_measure_measures_again_below_a_floor(clock):
    calls = []
    fast = clock.contender([0.1])

    def backend():
        calls.append(1)
        fast()

    contenders = {"backend": backend, "floor": clock.contender([1.0])}
    pair = ("backend", "floor")
    t = timing.measure(
        contenders, ratios=[pair], floors={pair: timing.FLOOR_VALID}, repeats=3, warmup=0
    )
    assert t.attempts == 3 and not t.ratio(*pair).valid
    assert len(calls) == 3 * 3  # three attempts of three rounds, each discarded
    assert "measured 3 times" in t.stop_note()


def test_a_layers_row_prints_spreads_marks_and_its_verdict():
    row = {
        "layer": "layer2.0.downsample.0",
        "batch": 64,
        "dtype": "float32",
        "rounds": 9,
        "invalid": ["gather_gemm / gemm floor"],
        "iqr": {
            "gather_gemm / einsum (fovi)": (0.75, 0.85),
            "gather_gemm / conv2d floor": (0.5, 0.6),
        },
        "gather_gemm / einsum (fovi)": 0.8,
        "gather_gemm / conv2d floor": 0.55,
        "gather_gemm / gemm floor": 0.1,
    }
    row["verdicts"] = layers.verdicts(row)
    # A time below its floor makes the row's timings untrustworthy: none of its timed ratios is
    # printed (issue 30: an invalid row prints no number).
    assert layers.mark(row, "gather_gemm / einsum (fovi)") == "-"
    assert layers.mark(row, "gather_gemm / conv2d floor") == "-"
    assert layers.mark(row, "gather_gemm / gemm floor") == "invalid"
    assert layers.verdict(row) == "invalid"
    valid = {**row, "invalid": [], "gather_gemm / gemm floor": 0.9}
    valid["iqr"] = {**row["iqr"], "gather_gemm / gemm floor": (0.85, 0.95)}
    valid["verdicts"] = layers.verdicts(valid)
    # float32 K = 1 against fovi's einsum: retired (no mark); in bfloat16 held to 0.8 (unsure)
    assert layers.mark(valid, "gather_gemm / einsum (fovi)") == "0.80±0.05"
    assert layers.mark(valid, "gather_gemm / conv2d floor") == "0.55±0.05"
    in_16 = {**valid, "dtype": "bfloat16"}
    in_16["verdicts"] = layers.verdicts(in_16)
    assert layers.mark(in_16, "gather_gemm / einsum (fovi)") == "0.80±0.05?"
    assert list(in_16["verdicts"]) == ["gather_gemm / einsum (fovi), bfloat16"]


def test_bfloat16_rows_have_their_targets_and_float16_rows_none():
    k1 = {"dtype": "bfloat16", "gather_gemm / einsum (fovi)": 1.0, "layer": "res18_ds2"}
    general = {"dtype": "bfloat16", "layer": "layer1.0.conv1"}
    assert [t.name for t in targets.holding(k1)] == ["gather_gemm / einsum (fovi), bfloat16"]
    assert [t.name for t in targets.holding(general)] == ["general / einsum time, bfloat16"]
    assert targets.holding({**general, "dtype": "float16"}) == []
    assert "float16 rows to none" in targets.LOW_PRECISION


def _rows(dtype: str, general_ms: float, einsum_ms: float) -> tuple[list[dict], list[dict]]:
    """A K = 1 row at batches 64 and 256, and one K > 1 row timed once for two layers."""
    ds = [
        {"dtype": dtype, "batch": b, "ms": {"gather_gemm": 1.0, "einsum (fovi)": 2.0}}
        for b in (64, 256)
    ]
    gen = [
        {
            "dtype": dtype,
            "batch": 64,
            "layer": "layer1.0.conv1, layer1.0.conv2",
            "ms": {"general": general_ms, "einsum (fovi)": einsum_ms},
        }
    ]
    return ds, gen


def test_the_trunk_adds_every_layer_once_and_holds_the_summed_targets():
    ds32, gen32 = _rows("float32", 4.0, 10.0)
    ds16, gen16 = _rows("bfloat16", 1.0, 10.0)
    trunk = layers.trunk_sums(ds32 + ds16, gen32 + gen16, batch=64, layers=3)
    # float32: (1 + 2 * 4) / (2 + 2 * 10) = 9 / 22; bfloat16: 3 / 22; bfloat16 / float32: 3 / 9
    assert trunk["float32"] == {"routed": 9.0, "einsum": 22.0}
    assert trunk["bfloat16"] == {"routed": 3.0, "einsum": 22.0}
    got = {t["target"]: (round(t["ratio"], 4), t["verdict"]) for t in trunk["targets"]}
    assert got == {
        "routed / einsum (fovi), summed over the layers": (round(9 / 22, 4), "met"),
        "routed / einsum (fovi), summed over the layers, bfloat16": (round(3 / 22, 4), "met"),
        "routed bfloat16 / routed float32, summed over the layers": (round(3 / 9, 4), "met"),
    }
    assert layers.trunk_sums(ds32, gen32, batch=64, layers=20) == {}  # not every layer timed
