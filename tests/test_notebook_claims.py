"""What the notebooks conclude from measurements, held to the code; and what keeps them readable.

``pytest --nbval`` re-executes the notebooks and compares their machine-independent outputs, but
it ignores timings (cells marked ``# NBVAL_IGNORE_OUTPUT``). A constant chosen from timings, such
as ``DENSE_S_BUDGET``, is checked here instead, against the measurement stored in the notebook:
re-executing the notebook on another machine replaces the record, and this test then says
whether the constant still agrees with the new evidence.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from fovi_ref.check.bench import budget
from fovi_ref.knn_gather_gemm import DENSE_S_BUDGET, DENSE_S_BUDGET_SOURCE

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
BUDGET_NOTEBOOK = NOTEBOOKS / "03_scatter_matrix_budget.ipynb"
MAX_WIDTH = 100  # JupyterLab wraps longer printed lines mid-row


def notebook_paths() -> list[Path]:
    return sorted(NOTEBOOKS.glob("*.ipynb"))


def stored_record(path: Path, kind: str) -> dict:
    """The ``application/json`` output whose ``kind`` is ``kind`` in a stored notebook."""
    try:
        return budget.notebook_record(path, kind)
    except ValueError as err:
        raise AssertionError(f"{err} (make notebooks)") from None


# ------------------------------------------------------------------------ DENSE_S_BUDGET
def test_dense_s_budget_agrees_with_the_stored_sweep():
    """The constant sends every size the stored sweep found clearly faster on the dense path to
    the dense path and every size clearly slower to the index path (ties either way); the
    three res18 downsamples' own measurements included."""
    record = stored_record(BUDGET_NOTEBOOK, "fovi_ref dense-S sweep")
    sweep, layers = budget.from_record(record)
    band = budget.noise_band(sweep)
    constant = DENSE_S_BUDGET[record["device"]]
    wrong = budget.disagreements(constant, sweep, band)
    wrong += budget.disagreements(constant, list(layers.values()), band, smooth=False)
    derived = budget.derive_budget(sweep, band)
    assert not wrong, (
        f"DENSE_S_BUDGET[{record['device']!r}] = {constant} disagrees with the sweep stored in "
        f"{BUDGET_NOTEBOOK.name} (noise band {band:.0%}, derived budget {derived}) at "
        + ", ".join(f"Nout*Nin = {p.size} (measured {v} faster)" for p, v in wrong)
    )


def test_the_cuda_budget_is_the_models_until_a_cuda_sweep_is_stored():
    """``DENSE_S_BUDGET["cuda"]`` is derived, not measured: it equals the budget notebook 03's
    model predicts for an H200, and says so, until scripts/gpu_check.sh's record of a CUDA sweep
    is stored at ``budget.CUDA_RECORD``; from then on it equals that sweep's budget."""
    if budget.CUDA_RECORD.exists():
        record = json.loads(budget.CUDA_RECORD.read_text())
        assert record["device"] == "cuda"
        sweep, _ = budget.from_record(record)
        expected, source = budget.derive_budget(sweep, budget.noise_band(sweep)), "measured"
    else:
        expected, source = budget.model_budget(), "derived"
    assert DENSE_S_BUDGET["cuda"] == expected
    assert DENSE_S_BUDGET_SOURCE["cuda"].startswith(source)
    assert DENSE_S_BUDGET_SOURCE["cpu"].startswith("measured")


def test_the_model_budget_moves_with_its_ceilings():
    """The model can fail: a slower launch favours the one-kernel dense path, a slower GEMM the
    index path, and a model whose dense path never wins gives 0."""
    h200 = budget.H200
    base = budget.model_budget(h200)
    slow_launch = budget.Roofline("slow launch", h200.bandwidth, h200.rates, 10 * h200.launch)
    slow_gemm = budget.Roofline("slow GEMM", h200.bandwidth, {torch.float32: 1e9}, h200.launch)
    no_launch = budget.Roofline("no launch cost", h200.bandwidth, {torch.float32: 1e9}, 0.0)
    assert 0 < base < budget.S_MAX_ELEMENTS
    assert budget.model_budget(slow_launch) > base > budget.model_budget(slow_gemm)
    assert budget.model_budget(no_launch) == 0


def test_the_stored_sweep_is_a_usable_measurement():
    record = stored_record(BUDGET_NOTEBOOK, "fovi_ref dense-S sweep")
    sweep, layers = budget.from_record(record)
    assert len(sweep) >= 10 and set(layers) == {"res18_ds2", "res18_ds3", "res18_ds4"}
    assert [p.size for p in sweep] == sorted(p.size for p in sweep)
    # A band so wide that every ratio is a tie would let any constant "agree".
    assert budget.noise_band(sweep) < 0.5


def point(size: int, ratio: float, aa: float = 1.0) -> budget.PathTimes:
    return budget.PathTimes(size, dense=ratio * 1e-4, index=1e-4, index_again=aa * 1e-4)


def test_budget_is_zero_when_dense_never_clearly_wins():
    sweep = [point(100, 1.02), point(200, 1.03), point(400, 1.3), point(800, 2.0)]
    band = budget.noise_band(sweep)
    assert band == budget.MIN_BAND
    assert budget.verdicts(sweep, band) == ["tie", "tie", "index", "index"]
    assert budget.derive_budget(sweep, band) == 0
    assert not budget.disagreements(0, sweep, band)
    assert not budget.disagreements(200, sweep, band)  # ties may go either way
    assert budget.disagreements(400, sweep, band)  # 400 is measured slower on the dense path


def test_budget_follows_a_dense_win_and_ignores_one_outlier():
    ratios = [0.5, 0.6, 3.0, 0.7, 0.8, 2.0, 3.0]  # a spike at 400; dense slower from 3200 on
    sweep = [point(100 * 2**j, r) for j, r in enumerate(ratios)]
    band = budget.noise_band(sweep)
    assert budget.verdicts(sweep, band) == ["dense"] * 5 + ["index"] * 2  # spike smoothed out
    assert budget.derive_budget(sweep, band) == 1600
    assert not budget.disagreements(1600, sweep, band)
    assert budget.disagreements(100, sweep, band)  # sends 200..1600 to the slower path
    assert budget.disagreements(3200, sweep, band)


def test_noise_band_comes_from_the_aa_ratios():
    quiet = [point(s, 1.0, aa=1.01) for s in (1, 2, 3, 4)]
    noisy = [point(s, 1.0, aa=1.3) for s in (1, 2, 3, 4)]
    assert budget.noise_band(quiet) == budget.MIN_BAND
    assert math.isclose(budget.noise_band(noisy), 0.3)
    assert budget.verdicts([point(1, 1.25)], budget.noise_band(noisy), smooth=False) == ["tie"]


def test_record_round_trip():
    sweep = [point(100, 1.1, 0.99), point(200, 1.2)]
    layers = {"res18_ds4": point(32, 1.0)}
    record = json.loads(json.dumps(budget.to_record(sweep, layers, device="cpu")))
    assert budget.from_record(record) == (sweep, layers)


# ----------------------------------------------------------------- readable, public, runnable
@pytest.mark.parametrize("path", notebook_paths(), ids=lambda p: p.stem)
def test_printed_lines_fit_jupyterlab(path):
    too_wide = []
    for i, cell in enumerate(json.loads(path.read_text())["cells"]):
        for output in cell.get("outputs", []):
            text = output.get("text") or output.get("data", {}).get("text/plain") or ""
            text = "".join(text) if isinstance(text, list) else text
            too_wide += [(i, len(line)) for line in text.splitlines() if len(line) > MAX_WIDTH]
    assert not too_wide, f"printed lines wider than {MAX_WIDTH} (cell, width): {too_wide}"


@pytest.mark.parametrize("path", notebook_paths(), ids=lambda p: p.stem)
def test_notebooks_use_public_names_only(path):
    private = re.compile(r"(?:\bimport\s+|\.|,\s*|\(\s*)(_[A-Za-z]\w*)")
    found = []
    for i, cell in enumerate(json.loads(path.read_text())["cells"]):
        if cell["cell_type"] == "code":
            found += [(i, name) for name in private.findall("".join(cell["source"]))]
    assert not found, f"private names used (cell, name): {found}"


@pytest.mark.parametrize("path", notebook_paths(), ids=lambda p: p.stem)
def test_notebooks_are_stored_executed(path):
    """Every code cell was run, in order, without an error, and no cell ends on a matplotlib
    object (its repr would be compared: end plotting cells with ``plt.show()``)."""
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    assert [c["execution_count"] for c in cells] == list(range(1, len(cells) + 1))
    for cell in cells:
        head = "".join(cell["source"])[:80]
        for output in cell["outputs"]:
            assert output["output_type"] != "error", head
            if output["output_type"] == "execute_result":
                assert not "".join(output["data"].get("text/plain", "")).startswith("<"), head


@pytest.mark.parametrize("path", notebook_paths(), ids=lambda p: p.stem)
def test_no_prose_states_a_run_time(path):
    """How long a notebook takes is printed by its code or stored in notebooks/run_times.txt
    (make notebooks measures it); prose that types a figure goes stale (notebook 05 said "a couple
    of minutes" beside a printed 30 s and a stored 581 s)."""
    duration = re.compile(
        r"\b(\d+(\.\d+)?|a couple of|a few|several)\s*(s|seconds?|min|minutes?|hours?)\b", re.I
    )
    found = []
    for i, cell in enumerate(json.loads(path.read_text())["cells"]):
        if cell["cell_type"] == "markdown":
            found += [(i, m.group(0)) for m in duration.finditer("".join(cell["source"]))]
    assert not found, f"durations typed in prose (cell, text): {found}"
    assert path.name in (NOTEBOOKS / "run_times.txt").read_text()
