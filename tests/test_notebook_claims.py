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
from fovi_ref.check.bench.budget import DENSE_S_BUDGET_SOURCE
from fovi_ref.knn_gather_gemm import DENSE_S_BUDGET

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
BUDGET_NOTEBOOK = NOTEBOOKS / "04_scatter_matrix_budget.ipynb"
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
    """``DENSE_S_BUDGET["cuda"]`` is derived, not measured: it equals the budget notebook 04's
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
    (make notebooks measures it); prose that types a figure goes stale (notebook 06 said "a couple
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


# ------------------------------------------------------------- every stated figure is printed
# A figure typed into prose goes stale when the code beside it changes; one printed by the code
# cannot. So every number the prose of a notebook states (outside code spans and math, which
# name symbols and formulas) must be a value its outputs print, ignored cells included, unless
# it is one of these kinds of number, which name something rather than state a figure:
NAMING = (
    (r"^#+\s*\d+\.|\b[Ss]ections? \d+(?:(?:, | and )\d+)*", "a section's number"),
    (r"^\s*\d+\.\s", "a list item's number"),
    (r"\*\*\d+\.|^\|\s*\d+\.|\b[Ff]indings? \d+(?:(?:, | and )\d+)*", "a finding's number"),
    (r"\b[Nn]otebooks? \d\d(?:(?:, | and | or )\d\d)*|^# \d\d ·", "a notebook's number"),
    (r"\b\d+\.\d+\.\d+\b", "a version"),
    (r"\beq\. \d+(?:\.\d+)?", "an equation cited from a book"),
    (r"\blayer\d\.\d\.(?:conv\d|downsample\.\d)|\bconv\d\b", "a layer's name"),
    (r"\b(?:res|resnet|ResNet-?)18\b", "the network's name"),
    (
        r"\b(?:b?float|u?int)\d+\b|\b\d+-bit\b|\b[Ss]ixteen bits\b|\bConv2d\b",
        "a dtype or torch's name",
    ),
    (r"\bK = (?:V = )?1\b|\bV = 1\b", "the K = V = 1 case, the route's definition"),
)
# Number words from three on are figures too ("four strategies"); "one" and "two" are mostly
# not ("one GEMM", "two steps").
NUMBER_WORDS = {
    word: n
    for n, word in enumerate(
        ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
        + ["eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen"]
        + ["eighteen", "nineteen", "twenty"]
    )
    if n >= 3
}
# Numbers a notebook states that no pattern above covers and that are not printed, per notebook
# (keyed by the name after its number, so that renumbering keeps them), each with its reason.
EXEMPT: dict[str, dict[str, str]] = {}

HIDDEN = re.compile(  # fenced code, code spans, math, link targets, HTML
    r"```.*?```|`[^`\n]*`|\$\$.*?\$\$|\$[^$\n]*\$|\]\([^)]*\)|<!--.*?-->|<[^>\n]+>", re.DOTALL
)
STATED = re.compile(
    r"(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?%?(?![\w.]\w)|\b(?:" + "|".join(NUMBER_WORDS) + r")\b",
    re.IGNORECASE,
)
PRINTED = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?:e[-+]?\d+)?%?")


def output_texts(cell: dict) -> list[str]:
    """Every text a code cell's stored outputs show (streams, results, displayed markdown)."""
    texts = []
    for output in cell.get("outputs", []):
        data = output.get("data", {})
        for text in (output.get("text"), data.get("text/plain"), data.get("text/markdown")):
            if text:
                texts.append("".join(text) if isinstance(text, list) else text)
    return texts


def printed_values(cells: list[dict]) -> set[float]:
    """Every number the outputs of ``cells`` print; a percentage also as a fraction (51% as
    0.51)."""
    values = set()
    for cell in cells:
        for text in output_texts(cell):
            for token in PRINTED.findall(text):
                value = float(token.rstrip("%"))
                values |= {value, value / 100} if token.endswith("%") else {value}
    return values


def stated(token: str) -> tuple[float, int]:
    """A prose number's value and its decimals (a percentage's as a fraction: 45% is 0.45, 2)."""
    if token.lower() in NUMBER_WORDS:
        return NUMBER_WORDS[token.lower()], 0
    digits = token.rstrip("%").replace(",", "")
    decimals = len(digits.partition(".")[2]) + (2 if token.endswith("%") else 0)
    return float(digits) / (100 if token.endswith("%") else 1), decimals


def is_printed(token: str, values: set[float]) -> bool:
    """An integer must be printed as it is; a decimal may be a printed value rounded to the
    decimals the prose gives (0.97 states a printed 0.974)."""
    value, decimals = stated(token)
    if decimals == 0:
        return value in values
    return any(math.isclose(round(v, decimals), value, abs_tol=1e-9) for v in values)


def sections(cells: list[dict]) -> list[int]:
    """Each cell's section: 0 before the first ``## `` heading, then 1, 2, ... at each."""
    numbers, current = [], 0
    for cell in cells:
        if cell["cell_type"] == "markdown" and re.search(r"^## ", "".join(cell["source"]), re.M):
            current += 1
        numbers.append(current)
    return numbers


NOT_NOUNS = {"of", "the", "a", "an", "on", "in", "to", "its", "their", "real", "more", "such"}


def count_is_printed(count: int, rest: str, lines: list[str]) -> bool:
    """A count in words ("four strategies": ``count`` 4, ``rest`` the prose after the word) is
    backed by a printed line that holds the count in digits and the word it counts (its first
    five letters: "strat" matches "strategies" and "strategy")."""
    words = (re.sub(r"[^a-z0-9]", "", w.lower()) for w in rest.split()[:4])
    noun = next((w for w in words if w and w not in NOT_NOUNS), "")
    digits = re.compile(rf"(?<![\w.]){count}(?![\w.])")
    return any(digits.search(line) and noun[:5] in line.lower() for line in lines)


def unprinted_figures(notebook: dict, exempt: dict[str, str]) -> list[tuple[int, str]]:
    """(cell, number) for every number the prose states that no output prints. A number in
    words counts things ("four strategies"), and small numbers are printed all over a notebook,
    so it must be printed beside what it counts, in its own section (the opening, before the
    first section, previews the whole notebook)."""
    cells = notebook["cells"]
    values = printed_values(cells)
    section = sections(cells)
    found = []
    for i, cell in enumerate(cells):
        if cell["cell_type"] != "markdown":
            continue
        prose = HIDDEN.sub(" ", "".join(cell["source"]))
        for pattern, _ in NAMING:
            prose = re.sub(pattern, " ", prose, flags=re.MULTILINE)
        scope = [
            c for c, s in zip(cells, section, strict=True) if s == section[i] or not section[i]
        ]
        lines = [line for c in scope for text in output_texts(c) for line in text.splitlines()]
        for match in STATED.finditer(prose):
            token = match.group(0)
            if token in exempt:
                continue
            if token.lower() in NUMBER_WORDS:
                backed = count_is_printed(NUMBER_WORDS[token.lower()], prose[match.end() :], lines)
            else:
                backed = is_printed(token, values)
            if not backed:
                found.append((i, token))
    return found


def topic(path: Path) -> str:
    return path.stem.split("_", 1)[1]  # 04_scatter_matrix_budget -> scatter_matrix_budget


@pytest.mark.parametrize("path", notebook_paths(), ids=lambda p: p.stem)
def test_every_figure_the_prose_states_is_printed(path):
    exempt = EXEMPT.get(topic(path), {})
    unprinted = unprinted_figures(json.loads(path.read_text()), exempt)
    assert not unprinted, (
        f"figures stated in prose that no output prints (cell, number): {unprinted}; print the "
        "value from the code beside the sentence, or list it in EXEMPT with a reason"
    )


def test_exemptions_name_notebooks_that_exist_and_say_why():
    topics = {topic(p) for p in notebook_paths()}
    assert set(EXEMPT) <= topics
    assert all(reason.strip() for reasons in EXEMPT.values() for reason in reasons.values())


def markdown_cell(text: str) -> dict:
    return {"cell_type": "markdown", "source": [text], "metadata": {}}


def code_cell(printed: str) -> dict:
    output = {"output_type": "stream", "name": "stdout", "text": [printed]}
    return {"cell_type": "code", "source": [""], "outputs": [output], "metadata": {}}


def test_a_planted_figure_fails_the_rule():
    """The rule is not vacuous: a figure the code does not print is found, in digits or in
    words, while the printed ones, names, code spans and math pass."""
    honest = "In section 2, `layer2.0.conv1` of res18 (fovi 2.4.0, $K = 9$) runs in 0.97 of it."
    notebook = {"cells": [markdown_cell(honest), code_cell("ratio 0.974, 51% of the span\n")]}
    assert unprinted_figures(notebook, {}) == []
    notebook["cells"].append(markdown_cell("It takes 51% of the span, 1.3 times, four rounds."))
    assert unprinted_figures(notebook, {}) == [(2, "1.3"), (2, "four")]
    assert unprinted_figures(notebook, {"1.3": "planted", "four": "planted"}) == []


def test_a_count_in_words_must_be_printed_beside_what_it_counts_in_its_section():
    """A count in words is not backed by a 3 another section prints, nor by a 3 printed
    beside something else; "strategy count: 3" in its own section backs it."""
    counted = markdown_cell("## 1. Strategies\nThree of the strategies compute the same sums.")
    notebook = {"cells": [counted, code_cell("4 strategies\nCin 3\n")]}
    notebook["cells"] += [markdown_cell("## 2. Layers"), code_cell("strategies: 3\n")]
    assert unprinted_figures(notebook, {}) == [(0, "Three")]
    notebook["cells"][1] = code_cell("strategy count: 3\n")
    assert unprinted_figures(notebook, {}) == []


# ------------------------------------------------------ targets as the bench defines them
TARGET_TEXT = re.compile(r"([\w.()]+(?: [\w.()]+)* / [\w.() ]+?)\s*<=\s*(\d+(?:\.\d+)?)\b")


def stated_targets(notebook: dict) -> list[tuple[int, str, float]]:
    """(cell, ratio, threshold) for every ``ratio / other <= x`` the outputs print, ignored
    cells included, and the prose states."""
    found = []
    for i, cell in enumerate(notebook["cells"]):
        texts = output_texts(cell)
        if cell["cell_type"] == "markdown":
            texts = ["".join(cell["source"])]
        for text in texts:
            for ratio, at_most in TARGET_TEXT.findall(text):
                found.append((i, ratio.removeprefix("target "), float(at_most)))
    return found


def unknown_targets(notebook: dict) -> list[tuple[int, str, float]]:
    """The stated targets that no target of ``fovi_ref.check.bench.targets`` is: by ratio (or
    full name) and threshold."""
    from fovi_ref.check.bench import targets

    known = {(t.ratio, t.at_most) for t in targets.ALL} | {(t.name, t.at_most) for t in targets.ALL}
    return [found for found in stated_targets(notebook) if found[1:] not in known]


@pytest.mark.parametrize("path", notebook_paths(), ids=lambda p: p.stem)
def test_targets_the_notebooks_print_are_the_benchs(path):
    wrong = unknown_targets(json.loads(path.read_text()))
    assert not wrong, f"targets stated that fovi_ref.check.bench.targets lacks: {wrong}"


def test_a_retired_target_fails_the_rule():
    retired = code_cell("  target gather_gemm / einsum <= 1.0: met on 3 of 3 layers\n")
    current = code_cell("target gather_gemm / conv2d floor <= 1.0: met\n")
    assert unknown_targets({"cells": [current]}) == []
    assert unknown_targets({"cells": [retired]}) == [(0, "gather_gemm / einsum", 1.0)]


# --------------------------------------------------------- a figure printed twice, the same
LABELLED = re.compile(r"^(.*?[A-Za-z_)].*?)(?:: | = )(-?\d+(?:\.\d+)?(?:e[-+]?\d+)?%?)(?![\w.])")


def labelled_figures(notebook: dict) -> dict[str, set[tuple[int, str]]]:
    """``{label: {(cell, value)}}`` for every printed line that starts ``label: value`` or
    ``label = value`` (the label is the whole line before the value, "K=9" is no label)."""
    found: dict[str, set[tuple[int, str]]] = {}
    for i, cell in enumerate(notebook["cells"]):
        for text in output_texts(cell):
            for line in text.splitlines():
                if match := LABELLED.match(line.strip()):
                    label = " ".join(match.group(1).split())
                    found.setdefault(label, set()).add((i, match.group(2)))
    return found


def printed_differently(notebook: dict) -> dict[str, set[tuple[int, str]]]:
    """The labels two cells print with different values (one cell's loop may print a label once
    per row of a table: a figure printed twice is one that another cell prints again)."""
    return {
        label: seen
        for label, seen in labelled_figures(notebook).items()
        if len({cell for cell, _ in seen}) > 1 and len({value for _, value in seen}) > 1
    }


@pytest.mark.parametrize("path", notebook_paths(), ids=lambda p: p.stem)
def test_a_figure_printed_twice_is_printed_the_same(path):
    differ = printed_differently(json.loads(path.read_text()))
    assert not differ, f"the same label printed with different values (cell, value): {differ}"


def test_a_figure_printed_twice_differently_fails_the_rule():
    once = same = code_cell("gather_gemm / einsum: 0.97\n")
    again = code_cell("gather_gemm / einsum: 1.02\n")
    assert printed_differently({"cells": [once, same]}) == {}
    assert printed_differently({"cells": [once, again]}) == {
        "gather_gemm / einsum": {(0, "0.97"), (1, "1.02")}
    }
