"""looped_kv.papers: every printed number held once, and equal to the papers' text.

Two kinds of checks:

* Held once. A set of distinctive printed values (ones that occur exactly once in ``looped_kv/papers.py``
  and are unlikely in unrelated code) must not be typed as a number anywhere else in the package, the
  tests or the chapter sources, nor inside a string of a chapter's code. A chapter or test that needs
  one imports it from ``looped_kv.papers``.
* As printed. Whole tables and a few sentences, rebuilt from the constants, are found in the papers'
  text (``papers/`` next to the project's design notes; ``$LOOPED_KV_PAPERS`` names another folder).
  These checks are skipped where the text is absent.
"""

from __future__ import annotations

import io
import os
import re
import tokenize
from pathlib import Path

import pytest

from looped_kv import papers
from looped_kv.analysis.planes import TABLE3_POLICIES, table3_policies

ROOT = Path(__file__).resolve().parent.parent
PAPERS_MODULE = ROOT / "looped_kv" / "papers.py"

#: Printed values that ``looped_kv/papers.py`` holds exactly once and nothing else may type. A value that another
#: quantity of the papers shares leaves the list (DAS Tables 8 and 13 print 1.07, 2.28, 2.52, ... as well as RIPE;
#: RIPE Sec. 5.5's rerun KL is Table 7's 1.6e-4).
DISTINCTIVE = (
    2788, 28.7,  # RIPE Sec. 2
    14.2, 15.8, 13.7, 2.06,  # RIPE Sec. 3.1
    0.845, 0.935, 0.995,  # RIPE Table 3
    3.6e-6, 1.7e-6, 3.2e-6, 2.4e-9, 1.8e-8, 4.7e-9, 2.7e-8,  # RIPE Sec. 3.2, Eq. (6)
    0.0072, 0.0115, 0.0116, 0.0192, 0.0162, 0.0048, 0.0101, 0.0047, 0.0098, 3.7e-4,  # RIPE Table 7
    0.026, 4.47, 3.61, 4.53,  # RIPE Sec. 3.3
    0.637, 0.805, 0.932, 0.928, 0.984, 2280, 1676, 1281, 1619, 1276, 1139,  # RIPE Table 9
    4.84, 4.34, 4.85, 0.76, 0.42, 0.66,
    0.054, 2.58,  # RIPE Sec. 3.4
    0.0015, 2.25, 302, 218, 365, 487,  # RIPE Sec. 3.5
    449, 689, 612, 656,  # RIPE Table 8
    2855, 843, 0.295, 0.302, 0.119, 0.128,  # RIPE Table 2
    5.05, 5.03, 5.24, 670, 168,  # RIPE Table 4
    21.2, 6.4e-5, 8.2e-5, 0.74,  # RIPE Sec. 5.1
    253, 572, 99.4, 7130, 7647,  # RIPE Secs. 5.2, 5.3 and Figure 4
    0.57, 0.84, 0.96,  # DAS Sec. 3.1
    15.6, 4.64, 6.96,  # DAS Table 1
    0.4722, 0.8399, 0.6693, 0.6362, 0.9127, 0.4683, 0.6005,  # DAS Table 6
    16.60, 18.30, 17.97, 19.88, 2.38, 3.14, 3.99,  # DAS Table 9
    2.85, 0.83,  # DAS Sec. C.4
    4.14, 0.91, 0.94,  # RIPE Sec. 5.2 (batch 5) and Table 6
    3.54, 3.66, 3.94, 10.9, 11.6,  # DAS Table 7
    0.65, 2.97, 4.11, 4.63, 5.99, 6.29,  # DAS Table 8
    2.94, 8.64,  # DAS Table 10
    3.91, 4.96, 5.09, 6.49, 6.64,  # DAS Table 13
    4070, 2293, 50.7, 36.1,  # DAS Table 14
)


def _tokens(path: Path) -> list[tokenize.TokenInfo]:
    return list(tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline))


def _number(token: str) -> float | None:
    if token.lower().startswith(("0x", "0o", "0b")) or token.lower().endswith("j"):
        return None
    return float(token.replace("_", ""))


def _sources() -> list[Path]:
    files = [*sorted((ROOT / "looped_kv").rglob("*.py")), *sorted((ROOT / "notebooks").glob("*.py")),
             *sorted((ROOT / "tests").glob("*.py"))]
    return [f for f in files if f not in (PAPERS_MODULE, Path(__file__).resolve())]


def _printed_forms() -> dict[float, set[str]]:
    """Each distinctive value and the literal spellings papers.py gives it (e.g. 16.60, 3.6e-6)."""
    values = {float(v) for v in DISTINCTIVE}
    forms: dict[float, set[str]] = {}
    for tok in _tokens(PAPERS_MODULE):
        value = _number(tok.string) if tok.type == tokenize.NUMBER else None
        if value in values:
            forms.setdefault(value, set()).add(tok.string)
    return forms


def test_distinctive_values_are_held_once_in_papers():
    counts: dict[float, int] = {}
    for tok in _tokens(PAPERS_MODULE):
        if tok.type == tokenize.NUMBER and (value := _number(tok.string)) is not None:
            counts[value] = counts.get(value, 0) + 1
    assert len(set(DISTINCTIVE)) == len(DISTINCTIVE)
    wrong = {v: counts.get(float(v), 0) for v in DISTINCTIVE if counts.get(float(v), 0) != 1}
    assert not wrong, f"values held other than once in looped_kv/papers.py: {wrong}"


def test_no_printed_value_is_typed_twice():
    """No distinctive value is a number literal outside papers.py, nor text inside a chapter's code strings."""
    values = {float(v) for v in DISTINCTIVE}
    patterns = {value: re.compile("|".join(rf"(?<![\w.]){re.escape(form)}(?![\w]|\.\d)" for form in sorted(forms)))
                for value, forms in _printed_forms().items()}
    found = []
    for path in _sources():
        chapter = path.parent.name == "notebooks"
        for tok in _tokens(path):
            where = f"{path.relative_to(ROOT)}:{tok.start[0]}"
            if tok.type == tokenize.NUMBER and _number(tok.string) in values:
                found.append(f"{where}: {tok.string}")
            elif chapter and tok.type == tokenize.STRING:
                found += [f"{where}: {m.group(0)!r} in a string"
                          for p in patterns.values() if (m := p.search(tok.string))]
    assert not found, "printed values typed outside looped_kv/papers.py (import them instead):\n" + "\n".join(found)


# -- accessors and the package's use of the tables ----------------------------------------------------


def test_accessors():
    assert papers.ripe_table_9("alpha")["deepest"] == {2: 0.800, 4: 0.928, 8: 0.984}
    assert papers.ripe_table_9("blocks")["full"][2] == papers.RIPE_TABLE_9["full"][2][2]
    with pytest.raises(ValueError):
        papers.ripe_table_9("beta")
    rows = {(r.batch, r.slots, r.scheduler, r.alpha): r for r in papers.RIPE_TABLE_8}
    assert len(rows) == len(papers.RIPE_TABLE_8)  # one row per (batch, slots, scheduler, alpha)
    row = rows[6, 0, "DtV", 0.878]
    assert (row.t_inf, row.b_half, row.residual, row.b_range) == (449, 33, 0.02, (1, 32))
    assert rows[8, 1, "AR", None].cells == 5
    assert len(papers.RIPE_TABLE_8) == 25 and sum(r.batch == 6 for r in papers.RIPE_TABLE_8) == 15


def test_table_shapes():
    models = (papers.HUGINN, papers.RAVEN_LLAMA, papers.RAVEN_OLMO, papers.RAVEN_TINYLLAMA)
    assert tuple(papers.DAS_TABLE_1) == models == tuple(papers.DAS_TABLE_6) == tuple(papers.DAS_TABLE_9)
    for model in models:
        assert len(papers.DAS_TABLE_1[model]) == 7
        assert all(tuple(row) == papers.DAS_TABLE_1_TASKS for row in papers.DAS_TABLE_1[model].values())
        assert all(len(row) == len(papers.DAS_TABLE_6_DEPTHS) for row in papers.DAS_TABLE_6[model].values())
        assert all(len(row) == len(papers.DAS_TABLE_9_CELLS) for row in papers.DAS_TABLE_9[model].values())
    for table, columns in ((papers.RIPE_TABLE_2, papers.RIPE_TABLE_2_COLUMNS),
                           (papers.RIPE_TABLE_3, papers.RIPE_TABLE_3_COLUMNS),
                           (papers.RIPE_TABLE_4, papers.RIPE_TABLE_4_COLUMNS)):
        assert all(len(row) == len(columns) for row in table.values())


def test_table3_policies_are_the_printed_rows():
    """The package's Table 3 caches are the printed rows, with the printed number of planes at R = 32."""
    assert [label for label, _, _ in TABLE3_POLICIES] == list(papers.RIPE_TABLE_3)
    kept = {label: len(policy.kept) for label, policy in table3_policies(32).items()}
    assert kept == {label: planes for label, (planes, _) in papers.RIPE_TABLE_3.items()}


# -- against the papers' text -----------------------------------------------------------------------


def _paper(name: str) -> str:
    folders = [os.environ.get("LOOPED_KV_PAPERS"), ROOT / "shared" / "papers", ROOT.parent / "shared" / "papers"]
    for folder in folders:
        if folder and (Path(folder) / name).exists():
            return (Path(folder) / name).read_text(encoding="utf-8")
    pytest.skip(f"{name} not found (set LOOPED_KV_PAPERS to the folder that holds it)")


@pytest.fixture(scope="module")
def ripe() -> str:
    return _paper("ripe-prefix-kv-matter-late.txt")


@pytest.fixture(scope="module")
def das() -> str:
    # the extraction repeats inline math ("47.22%47.22\%"); single spaces keep table rows on one line
    return re.sub(r"\s+", " ", _paper("das-shallow-queries-mature-values.txt"))


def _after(text: str, start: str, end: str) -> str:
    """The text between the first ``start`` and the next ``end``."""
    i = text.index(start)
    return text[i:text.index(end, i)]


def _percent(fraction: float, decimals: int = 1) -> str:
    return "100%" if fraction == 1 else f"{100 * fraction:.{decimals}f}%"


def test_ripe_table_2(ripe):
    table = _after(ripe, "Table 2. KV memory per sequence", "with half-saturation")
    columns = list(zip(*papers.RIPE_TABLE_2.values(), strict=True))
    assert " ".join(f"{mb:,}" for mb in columns[0]) in table  # "2,855 173 260 215 341 843"
    assert " ".join(map(_percent, columns[1])) in table
    assert " ".join(f"{mb:,}" for mb in columns[2]) in table
    assert " ".join(map(_percent, columns[3])) in table


def test_ripe_table_3(ripe):
    table = _after(ripe, "Table 3. Equal-storage caches", "Table 4.")
    planes, agreement = zip(*papers.RIPE_TABLE_3.values(), strict=True)
    assert f"{' '.join(map(str, planes))}\n\n{' '.join(f'{a:.3f}' for a in agreement)}" in table


def test_ripe_table_4(ripe):
    table = _after(ripe, "Table 4. RIPE windows on Huginn", "13.0, bf16")
    tail, max_kl, flips, extra = zip(*papers.RIPE_TABLE_4.values(), strict=True)
    printed = [" ".join(map(str, tail)), " ".join(f"{x:.2f}" for x in max_kl), " ".join(map(str, flips)),
               " ".join("—" if x is None else str(x) for x in extra)]
    assert "\n\n".join(printed) in table
    setup = papers.RIPE_TABLE_4_SETUP
    assert f"batch 8, {setup['prompts']} prompts" in table and f"KL> {setup['tail KL']}" in table
    assert f"L = {setup['length']}" in table


def test_ripe_table_7(ripe):
    table = _after(ripe, "Table 7. Ripening fits", "Table 8.")
    hug = papers.RIPE_TABLE_7[papers.HUGINN]
    pairs = ["rho", "half-life (loops)", "Delta_inf (bf16)", "deep-loop Delta, bf16", "deep-loop Delta, fp32"]
    column = " ".join(f"{hug[k][0]} ({hug[k][1]})" for k in pairs) + f" {hug['max |log residual|, fp32']}"
    assert column in table  # "0.88 (0.87) 5.2 (5.1) 0.0072 (0.0115) ... 0.28"
    rav = papers.RIPE_TABLE_7[papers.RAVEN_LLAMA]
    column = " ".join(f"{rav[k][0]} ({rav[k][1]})" for k in pairs[:4])
    assert column + " 1.6 × 10−4 (3.7 × 10−4 ) " + str(rav["max |log residual|, fp32"]) in table
    assert rav["deep-loop Delta, fp32"] == (1.6e-4, 3.7e-4)


def test_ripe_table_8(ripe):
    table = _after(ripe, "Table 8. Throughput fits", "Table 9.")
    rows = papers.RIPE_TABLE_8
    printed = [" ".join(str(r.batch) for r in rows), " ".join(str(r.slots) for r in rows),
               " ".join(r.scheduler for r in rows), " ".join("—" if r.alpha is None else str(r.alpha) for r in rows),
               " ".join(f"{r.b_range[0]}–{r.b_range[1]}" for r in rows), " ".join(str(r.cells) for r in rows),
               " ".join(str(r.t_inf) for r in rows), " ".join(str(r.b_half) for r in rows),
               " ".join(_percent(r.residual, 0) for r in rows)]
    assert "\n\n".join(printed) in table


def test_ripe_table_9(ripe):
    table = _after(ripe, "Table 9. Acceptance model check", "Figure 6.")
    formats = ("{:.3f}", "{:.3f}", "{}", "{:.2f}", "{:.2f}")
    for column, fmt in zip(papers.RIPE_TABLE_9_COLUMNS, formats, strict=True):
        values = [v for by_d in papers.ripe_table_9(column).values() for v in by_d.values()]
        assert " ".join(fmt.format(v) for v in values) in table, column
    (k_full, rho_full), (k_deep, rho_deep) = papers.RIPE_TABLE_9_REJECTION.values()
    assert f"k = {k_full}, ρa = {rho_full} (full cache) and k = {k_deep}, ρa = {rho_deep} (deepest plane)" in table


def test_ripe_sections(ripe):
    kb = papers.RIPE_SEC_2_KV_PER_TOKEN
    assert (f"{kb[papers.HUGINN]['full']:,} vs. {kb[papers.HUGINN]['deepest']} KB per token on Huginn (6.1%) and "
            f"{kb[papers.RAVEN_LLAMA]['full']} vs. {kb[papers.RAVEN_LLAMA]['deepest']} KB on Raven") in ripe
    hug = papers.RIPE_SEC_3_1_SENSITIVITY[papers.HUGINN]
    rav = papers.RIPE_SEC_3_1_SENSITIVITY[papers.RAVEN_LLAMA]
    assert "1.82 [1.68, 1.97] on Raven" in ripe and rav["g"] == (1.82, 1.68, 1.97)
    assert f"g = {hug['g'][0]:.2f} [{hug['g'][1]}, {hug['g'][2]}] on Huginn" in ripe
    assert f"quadratic (slope {hug['shallow slope']}) but its deep loops are steeper ({hug['deep slope']})" in ripe
    assert (f"e{hug['b'][0]} [e{hug['b'][1]} , e{hug['b'][2]} ] (Huginn, {hug['texts']} texts) and "
            f"e{rav['b'][0]} [e{rav['b'][1]} , e{rav['b'][2]} ] (Raven, {rav['texts']} texts)") in ripe
    assert f"coefficients are {hug['b, bf16']} and {rav['b, bf16']}" in ripe
    eq6 = papers.RIPE_SEC_3_2_EQ_6[papers.HUGINN]
    assert eq6 == {"from the ripening curve": 3.6e-6, "from the measured size": 1.7e-6,
                   "deepest-plane arm, median": 3.2e-6, "plane R in the shallow loops only": 2.4e-9}
    assert "predicts 3.6 × 10−6 at the first decoded position from the ripening curve, or 1.7 × 10−6" in ripe
    assert "measures 3.2×10−6 (median)" in ripe and "costs only 2.4×10−9" in ripe
    assert "predicts 1.8 × 10−8 (4.7 × 10−9 from the measured size)" in ripe and "mean 2.7 × 10−8" in ripe
    acc = papers.RIPE_SEC_3_3_ACCEPTANCE
    assert (f"at most {acc['largest spread']['full']} (full cache) and {acc['largest spread']['deepest']} "
            f"(deepest plane)") in ripe
    assert f"within {100 * acc['largest tau error']:.1f}%" in ripe
    m24, m12 = acc["tau measured, 24 problems"], acc["tau measured, 12 problems"]
    assert (f"measured {m24['full']} and {m24['deepest']} on 24 other GSM8K problems and {m12['full']} and "
            f"{m12['deepest']} on 12 more") in ripe
    sp = papers.RIPE_SEC_3_4_SPEEDUP
    assert f"c(R) = {sp['layer passes c(R)']} passes" in ripe
    assert (f"gives {sp['model, eta = 1']['full']:.2f}× and {sp['model, eta = 1']['deepest']:.2f}× against measured "
            f"{sp['measured']['full']}× and {sp['measured']['deepest']}×") in ripe
    assert (f"One factor η = {sp['eta']}, fitted to all 24 per-problem timings at once, gives "
            f"{sp['model, fitted eta']['full']}× and {sp['model, fitted eta']['deepest']}×, with per-problem errors "
            f"up to {100 * sp['largest per-problem error']:.1f}%") in ripe
    (g_full, s_full), (g_deep, s_deep) = sp["figure 5b, d = 4"].values()
    assert f"peaks at γ = {g_full} ({s_full}×), while the deepest plane still rises at γ = {g_deep} ({s_deep}×)" in ripe
    mem = papers.RIPE_SEC_3_5_MEMORY
    assert (f"o0 = {mem['o0 (GB)']} GB and o1 = {mem['o1 (GB)']['full']} GB (full) or {mem['o1 (GB)']['one slot']} "
            f"GB (one slot)") in ripe
    assert f"predicts the {mem['held-out cells']} batch-8 cells" in ripe and "within 0.15%" in ripe
    assert (f"Under the pre-registered {mem['budget (GB)']} GB budget, the largest batch is Bmax = "
            f"{mem['B_max']['full']} with the full cache ({mem['full cache per sequence (GB)']} GB per sequence) and "
            f"{mem['B_max']['one slot']} with one slot") in ripe
    assert f"sequences of {mem['sequence length']} tokens" in ripe
    fixed, factors = papers.RIPE_SEC_3_5_FIXED_MEMORY, papers.RIPE_SEC_3_5_FACTORS
    assert (f"already runs {fixed['shared, B = 32']} tokens/s against the best full-cache configuration’s "
            f"{fixed['best full, B = 32']}, {factors['same batch']}×") in ripe
    assert f"the shared slot is {factors['cache only']}× faster" in ripe
    assert f"another {factors['batch']}×, for {factors['total']}× in all" in ripe
    assert f"WaveFront at B = 64 ({fixed['shared, B = 64']})" in ripe


def test_ripe_section_5(ripe):
    s51 = papers.RIPE_SEC_5_1
    ratio = s51["exceeding bin ratio"]
    assert (f"label is “{s51['fidelity label']}”, through a single bin "
            f"(ratio {ratio[0]} [{ratio[1]}, {ratio[2]}])") in ripe
    assert f"other bins have ratios {s51['other bin ratios'][0]}–{s51['other bin ratios'][1]}" in ripe
    median = s51["median KL"]
    assert (f"({median[0] * 1e5:.1f} × 10−5 vs. {median[1] * 1e5:.1f} × 10−5 ) "
            f"but the mean is {s51['mean KL ratio']}") in ripe
    share = s51["top 1% share of KL"]
    assert f"1% of positions carry {share[0]:.0%} of the KL (fp32: {share[1]:.0%}" in ripe
    assert f"lie in {s51['tail prompts']} prompts, {s51['tail positions in one problem']} of them in one" in ripe
    tail = s51["tail ratio W = 64"]
    assert f"({s51['tail reduction W = 64']:.0%} fewer; ratio {tail[0]} [{tail[1]:.2f}, {tail[2]:.2f}]" in ripe
    s52 = papers.RIPE_SEC_5_2
    dep = s52["block dependence ratio"]
    assert (f"The ratio is {dep[0]} [{dep[1]:.2f}, {dep[2]}], below the pre-registered threshold of "
            f"{s52['block dependence threshold']} (label “{s52['block dependence label']}”") in ripe
    equal, of = s52["batched trajectories equal"]
    assert f"{equal} of {of} batched trajectories equal the sequential ones" in ripe
    s53 = papers.RIPE_SEC_5_3
    (b_full, t_full), (b_shared, t_shared) = s53["batch 8, best full"], s53["batch 8, shared"]
    assert f"B = {b_full} ({t_full} tokens/s, batch 8)" in ripe and f"B = {b_shared} ({t_shared})" in ripe
    assert f"sharing is {papers.RIPE_SEC_3_5_FACTORS['total']}× and {s53['batch 8, sharing gain']}× faster" in ripe
    assert f"B = 38 needs {s53['peak at B = 38 (GB)']} GB" in ripe
    fig4 = papers.RIPE_FIGURE_4
    assert (f"{fig4['positions'][papers.HUGINN]:,} Huginn and {fig4['positions'][papers.RAVEN_LLAMA]:,} Raven "
            f"positions on the same {fig4['prompts']} prompts") in ripe
    table1 = papers.RIPE_TABLE_1
    assert f"≤ {table1['KV memory, largest error (GB)']} GB (print precision)" in ripe
    bf16 = table1["ripening, max |log err|, bf16"]
    assert f"bf16 {bf16[papers.HUGINN]} / {bf16[papers.RAVEN_LLAMA]}" in ripe
    assert f"within {100 * table1['acceptance, held-out error']:.0f}%" in ripe


def test_ripe_minimum_effects(ripe):
    """The smallest effects the book takes from RIPE are its pre-registered thresholds, as printed."""
    ledger = _after(ripe, "Table 6. Pre-registered predictions and outcomes", "F ITTED PARAMETERS")
    t6 = papers.RIPE_TABLE_6_THRESHOLDS
    assert f"+ ≥ {t6['tau gain of the deepest plane']} (shared)" in ledger
    assert f"shared ≥ {t6['fixed-memory gain of one shared slot']}×" in ledger
    assert f"deep coefficient ≥ {t6['deep coefficient b']} (bf16)" in ledger
    assert f"changes the ratio by > {t6['reference asymmetry']:.0%}" in ledger
    assert papers.RIPE_SEC_3_2_EQ_6_FACTOR == 2 and "The agreement is to within a factor of two, not better" in ripe
    assert f"threshold of {papers.RIPE_SEC_5_2['block dependence threshold']}" in ripe


DAS_NAMES = {papers.HUGINN: "Huginn", papers.RAVEN_LLAMA: "Raven Llama", papers.RAVEN_OLMO: "Raven OLMo",
             papers.RAVEN_TINYLLAMA: "Raven TinyLlama"}


def test_das_table_1(das):
    table = _after(das, "Model Method Speedup A Speedup A Speedup A Speedup A", "4.2 Decoding performance")
    printed = " ".join(
        f"{DAS_NAMES[model]} " + " ".join(
            f"{method} " + " ".join(f"{s:.2f}× {a:.1f}" for s, a in row.values()) for method, row in rows.items())
        for model, rows in papers.DAS_TABLE_1.items())
    assert printed in table


def test_das_table_6(das):
    table = _after(das, "Table 6: Draft–target token agreement", "The separate Huginn depth grid")
    printed = " ".join(f"{DAS_NAMES[model]} " + " ".join(f"{policy} " + " ".join(f"{v:.4f}" for v in row)
                                                          for policy, row in rows.items())
                       for model, rows in papers.DAS_TABLE_6.items())
    assert printed in table


def test_das_table_9(das):
    table = _after(das, "Table 9: Complete carry/K/V factorial", "C.5 Retuned")
    columns = [cells for rows in papers.DAS_TABLE_9.values() for cells in rows.values()]
    printed = " ".join(" ".join(map(str, cell)) + " " + " ".join(f"{column[i]:.2f}" for column in columns)
                       for i, cell in enumerate(papers.DAS_TABLE_9_CELLS))
    assert printed in table
    assert [task for rows in papers.DAS_TABLE_9.values() for task in rows] == ["GSM8K", "MATH-500"] * 4


def test_das_sections(das):
    cos = papers.DAS_SEC_3_1_COSINE
    for model, name in ((papers.HUGINN, "on Huginn"), (papers.RAVEN_LLAMA, "on Raven-Llama")):
        q, k, v = (f"{cos[model][x]:.2f}" for x in "qkv")
        assert re.search(rf"{q}/{k}/{v}\S* (for Q/K/V )?{name}", das), model
    e = papers.DAS_SEC_C_4_ECKV
    twice = lambda x: f"{x:.2f}{x:.2f}"  # noqa: E731  (the extraction prints inline math twice)
    assert (f"is {twice(e[(papers.HUGINN, 'GSM8K')])} and {twice(e[(papers.RAVEN_LLAMA, 'GSM8K')])} tokens on GSM8K, "
            f"and {twice(e[(papers.HUGINN, 'MATH-500')])} and {twice(e[(papers.RAVEN_LLAMA, 'MATH-500')])} tokens on "
            "MATH-500") in das
    # Sec. 3.1 quotes Table 6's d = 1 cells in percent
    t6 = papers.DAS_TABLE_6
    hug, rav = t6[papers.HUGINN], t6[papers.RAVEN_LLAMA]
    pct = lambda x: f"{100 * x:.2f}%"  # noqa: E731
    assert f"from {pct(hug['Aligned'][0])}" in das and f"to {pct(hug['Deep V'][0])}" in das
    assert f"gives {pct(hug['Deep K'][0])}" in das
    assert f"from {pct(rav['Aligned'][0])}" in das and f"to {pct(rav['Deep V'][0])}" in das


# -- issue 40: the tables and sections added ----------------------------------------------------------


def _in_order(text: str, cells) -> bool:
    """Whether ``cells`` occur in ``text`` one after another (columns of a table the extraction interleaves)."""
    at = 0
    for cell in cells:
        at = text.find(cell, at)
        if at < 0:
            return False
        at += len(cell)
    return True


def test_ripe_table_1(ripe):
    """Every column of Table 1 in the printed order; the results rebuilt from the sections that hold them; the
    held-out checks are the memory and acceptance models, as the conclusion says."""
    table = _after(ripe, "Table 1. Post hoc models", "where F (p)")
    assert _in_order(table, papers.RIPE_TABLE_1_MODELS)
    for column in zip(*papers.RIPE_TABLE_1_MODELS.values(), strict=True):
        assert _in_order(table, column), column
    hug, rav = papers.RIPE_SEC_3_1_SENSITIVITY[papers.HUGINN], papers.RIPE_SEC_3_1_SENSITIVITY[papers.RAVEN_LLAMA]
    t7 = {m: papers.RIPE_TABLE_7[m]["max |log residual|, fp32"] for m in (papers.HUGINN, papers.RAVEN_LLAMA)}
    bf16 = papers.RIPE_TABLE_1["ripening, max |log err|, bf16"]
    eq6, sp = papers.RIPE_SEC_3_2_EQ_6[papers.HUGINN], papers.RIPE_SEC_3_4_SPEEDUP
    results = [f"≤ {100 * papers.RIPE_SEC_3_5_MEMORY['held-out error']:.2f}%",
               f"g = {hug['g'][0]:.2f} / {rav['g'][0]} (fp32)",
               f"max | log err| fp32 {t7[papers.HUGINN]} / {t7[papers.RAVEN_LLAMA]}, bf16 {bf16[papers.HUGINN]} / "
               f"{bf16[papers.RAVEN_LLAMA]}",
               f"{eq6['from the ripening curve'] * 1e6:.1f} × 10−6 vs. {eq6['deepest-plane arm, median'] * 1e6:.1f} × "
               f"10−6 (factor {papers.RIPE_SEC_3_2_EQ_6_FACTOR})",
               "{}/{} vs. {}/{}".format(*sp["model, fitted eta"].values(), *sp["measured"].values())]
    assert _in_order(table, results)
    held_out = {model for model, cells in papers.RIPE_TABLE_1_MODELS.items() if cells[-1] == "held out"}
    assert held_out == {"KV memory", "Peak memory", "Acceptance"}
    assert "the memory and accep-\n\ntance models predict held-out measurements" in ripe


def test_ripe_table_5(ripe):
    table = _after(ripe, "Table 5. Pre-registered batches", "P REDICTION LEDGER")
    questions, labels = zip(*papers.RIPE_TABLE_5.values(), strict=True)
    assert "\n\n".join([" ".join(papers.RIPE_TABLE_5), " ".join(questions), " ".join(labels)]) in table
    assert len(papers.RIPE_TABLE_5) == 9 and "Nine pre-registered GPU batches back these results" in ripe


def test_ripe_table_6(ripe):
    """The ledger's three columns as printed (the extraction puts batch 1's rows apart from the others)."""
    ledger = _after(ripe, "Table 6. Pre-registered predictions and outcomes", "F ITTED PARAMETERS")
    rows = papers.RIPE_TABLE_6
    first = [r for r in rows if r.batch == "1"]
    rest = rows[len(first):]
    predictions = [r.printed[0] for r in rows]
    assert " ".join(r.batch for r in first) + "\n\n" + " ".join(predictions[:len(first)]) in ledger
    assert " ".join(r.batch for r in rest) + "\n\n" + " ".join(predictions[len(first):]) in ledger
    assert " ".join(r.printed[1] for r in rows) in ledger
    assert len(rows) == 35 and {r.batch for r in rows} == {b for key in papers.RIPE_TABLE_5 for b in key.split(", ")}
    assert papers.ripe_table_6("8", "window").printed == ("window 64 removes most tail positions", "held (89%)")
    with pytest.raises(ValueError, match="0 rows"):
        papers.ripe_table_6("8", "coverage")


def test_ripe_table_6_outcomes_follow_from_the_printed_measurements():
    """Where a prediction has a band and the outcome a measured value, the band decides the printed outcome."""

    def within(value, low, high):
        return low <= value <= high

    def row(batch, start):
        r = papers.ripe_table_6(batch, start)
        return r.bounds, r.measured, r.held

    rules = {
        ("2", "compress-s4"): lambda b, m: m[0] >= b[0],
        ("3", "deepest-plane cache raises"): lambda b, m: m[1] > m[0],
        ("4", "reference asymmetry"): lambda b, m: max(m) > b[0],
        ("4", "bf16 reruns"): lambda b, m: m[0] == 1,
        ("5", "speed-up"): lambda b, m: within(m[0], b[0], b[1]) and within(m[1], b[2], b[3]),
        ("5", "WaveFront token-lossless"): lambda b, m: m[0] / m[1] >= b[0],
        ("6", "shared ≥"): lambda b, m: m[0] >= b[0],
        ("6", "unshared runs out"): lambda b, m: not m[0] <= papers.RIPE_SEC_3_5_MEMORY["B_max"]["full"],
        ("7", "WaveFront"): lambda b, m: m[0] / m[1] >= b[0] / b[1],
        ("8", "batched deepest-plane"): lambda b, m: within(m[0], b[0], b[1]),
        ("8", "tokens per verification"): lambda b, m: within(m[0], b[0], b[1]) and m[1] - m[0] >= b[2],
        ("8", "speed-up"): lambda b, m: within(m[0], b[0], b[1]) and within(m[1], b[2], b[3]),
        ("8", "window"): lambda b, m: m[0] > 0.5,
        ("8", "per-head"): lambda b, m: within(1, *papers.RIPE_SEC_5_4["per-head over top-k"][1:]),
        ("8", "filtering costs"): lambda b, m: m[0] > b[0],
        ("8", "shared/lossless"): lambda b, m: within(m[0], b[0], b[1]),
        ("9", "Raven: deep KV"): lambda b, m: m[0] >= b[0],
        ("9", "Raven: deepest-plane first"): lambda b, m: m[0] >= b[0],
    }
    for (batch, start), rule in rules.items():
        bounds, measured, held = row(batch, start)
        assert rule(bounds, measured) is held, (batch, start)
    # batch 8, two planes: Table 4's tail counts (9 with two planes, 9 without) remove none, outside 20-50%
    table4 = papers.RIPE_TABLE_4
    removed = 1 - table4["two planes (s8)"][0] / table4["deepest plane (W = 0)"][0]
    assert removed == 0 and papers.ripe_table_6("8", "two planes").held is False
    # batch 1: 0.91 lies above the 0.6-0.85 band (GSM8K), "AlpacaEval held": a mixed outcome
    (_, _, high), (gsm8k,), held = row("1", "head-median")
    assert gsm8k > high and held is None
    # Table 5's labels and Sec. 5.1/5.2's agree with the ledger
    assert papers.RIPE_TABLE_5["8"][1].startswith("as numerics") and "numerics" in papers.RIPE_SEC_5_2[
        "block dependence label"]


def test_ripe_sections_5_2_5_4_5_5_and_figure_4c(ripe):
    text = re.sub(r"\s+", " ", ripe)
    alphas = sorted({r.alpha for r in papers.RIPE_TABLE_8 if r.alpha is not None})
    wave = papers.RIPE_SEC_5_2["WaveFront speed-up, batch 5"]
    assert (f"speed-up {wave['unshared']}× at acceptance {alphas[0]} without sharing and {wave['one slot']}× at "
            f"{alphas[1]} with one shared slot") in text
    s54 = papers.RIPE_SEC_5_4
    per_head, (early, late) = s54["per-head over top-k"], s54["selection loops"]
    assert (f"tested it on {s54['texts']} unseen AlpacaEval texts at a budget of {s54['budget']:.0%} of the prefix: "
            f"filtering costs {s54['KL over deepest-plane storage']} times more KL than deepest-plane storage, the two "
            f"costs add (ratio {s54['costs add, ratio']}), and the per-head policy is {per_head[0]}× worse than top-k "
            f"for every head [{per_head[1]}, {per_head[2]:.2f}]. Selecting at loop {late} instead of {early} cuts the "
            f"cost to {s54['later selection, cost fraction']} of its value") in text
    s55 = papers.RIPE_SEC_5_5
    assert (f"matched bitwise at only {s55['rerun bitwise equal']:.0%} of positions, with mean KL "
            f"{s55['rerun mean KL'] * 1e4:.1f} × 10−4 , about two thirds of the bf16-to-fp32 floor") in text
    assert s55["rerun KL over the bf16-to-fp32 floor"] == (2, 3)
    assert f"(cuDNN {s55['cuDNN version']})" in text
    assert f"reruns are bitwise identical ({s55['bitwise equal, cuDNN off']:.0%} of positions" in text
    assert "identical texts on {}/{} problems".format(*s55["WaveFront identical texts"]) in text
    assert "agree on only {} of {} trajectories in bf16".format(*s55["batched vs sequential equal, bf16"]) in text
    table4 = papers.RIPE_TABLE_4
    assert (f"On the problem of Figure 4c, W = 16 already cuts the peak to {table4['RIPE, W = 16'][1]} and W = 64 to "
            f"{table4['RIPE, W = 64'][1]}") in text
    alpha4 = papers.ripe_table_9("alpha")
    assert f"accept α4 = {alpha4['deepest'][4]:.2f} instead of {alpha4['full'][4]:.2f}" in text


DAS_TABLE_3_NAMES = {papers.HUGINN: "Huginn-0125", papers.RAVEN_LLAMA: "Raven-Llama-3.2",
                     papers.RAVEN_OLMO: "Raven-OLMo-2", papers.RAVEN_TINYLLAMA: "Raven-TinyLlama"}


def test_das_tables_3_and_4(das):
    table3 = _after(das, "Table 3: Evaluated recurrent-depth models.", "The main evaluation")
    rows = papers.DAS_TABLE_3.items()
    assert " ".join(f"{DAS_TABLE_3_NAMES[m]} {' '.join(map(str, row))}" for m, row in rows) in table3
    table4 = _after(das, "Table 4: Prompt conventions and generation caps.", "All main latency")
    assert " ".join(f"{task} {cap} {convention}" for task, (cap, convention) in papers.DAS_TABLE_4.items()) in table4
    assert tuple(papers.DAS_TABLE_4) == papers.DAS_TABLE_1_TASKS


def _ci(point: float, interval) -> str:
    return f"{point:.2f}× [{interval[0]:.2f}, {interval[1]:.2f}]"


def test_das_table_7(das):
    """Deep V as held; the Deep K/V columns rebuilt from Table 13's intervals and Table 1's points and A."""
    table = _after(das, "Table 7: Sequential mature-prefix policies", "C.3 Fixed-setting")
    names = {papers.RAVEN_LLAMA: "Raven-Llama", papers.RAVEN_OLMO: "Raven-OLMo",
             papers.RAVEN_TINYLLAMA: "Raven-TinyLlama"}
    printed = []
    for model, rows in papers.DAS_TABLE_7.items():
        cells = []
        for i, (task, (s, low, high, a)) in enumerate(rows.items()):
            kv_s, kv_a = papers.DAS_TABLE_1[model]["Mature-Spec"][task]
            kv_ci = papers.DAS_TABLE_13[model]["Mature-Spec"][i]
            cells.append(f"{task} {_ci(s, (low, high))} {a:.1f} {_ci(kv_s, kv_ci)} {kv_a:.1f}")
        printed.append(f"{names[model]} " + " ".join(cells))
    assert " ".join(printed) in table
    assert all(tuple(rows) == papers.DAS_TABLE_1_TASKS for rows in papers.DAS_TABLE_7.values())


def test_das_table_8(das):
    table = _after(das, "Table 8: Fixed-setting component speedups", "C.4 Complete")
    names = {papers.HUGINN: "Huginn", papers.RAVEN_LLAMA: "Raven-Llama"}
    printed = " ".join(f"{names[model]} " + " ".join(
        f"{procedure} {prefix} " + " ".join(f"{_ci(s, (low, high))}" for s, low, high in cells)
        for (procedure, prefix), cells in rows.items()) for model, rows in papers.DAS_TABLE_8.items())
    assert printed in table
    # Sec. 4.3 quotes the GSM8K points (Table 2's speed-ups); the extraction prints inline math twice
    hug, rav = (papers.DAS_TABLE_8[m] for m in (papers.HUGINN, papers.RAVEN_LLAMA))
    x = lambda row, i=0: f"{row[i][0]:.2f}×{row[i][0]:.2f}×"  # noqa: E731
    assert f"speedup from {x(hug['Sequential', 'Aligned'])} to {x(hug['Sequential', 'Deep K/V'])}" in das
    assert (f"runs at {x(hug['Parallel, no carry', 'Aligned'])}; Deep K/V without carry reaches "
            f"{x(hug['Parallel, no carry', 'Deep K/V'])}, and carry with aligned reads reaches "
            f"{x(hug['Parallel + carry', 'Aligned'])}, while their combination reaches "
            f"{x(hug['Parallel + carry', 'Deep K/V'])}") in das
    assert (f"reach {x(rav['Parallel, no carry', 'Deep K/V'])} and {x(rav['Parallel + carry', 'Aligned'])}, compared "
            f"with {x(rav['Parallel + carry', 'Deep K/V'])}") in das
    assert (f"give {x(hug['Parallel + carry', 'Aligned'])}, {x(hug['Parallel + carry', 'Deep V'])}, and "
            f"{x(hug['Parallel + carry', 'Deep K/V'])} speedup") in das


def test_das_tables_10_13_and_14(das):
    table10 = _after(das, "Table 10: Independently retuned carried controls", "Appendix D")
    printed = " ".join(f"{DAS_NAMES[model]} " + " ".join(
        f"{policy} {g} {j} {k} {s:.2f}× {a:.2f}" for policy, (g, j, k, s, a) in rows.items())
        for model, rows in papers.DAS_TABLE_10.items())
    assert printed in table10
    table13 = _after(das, "Table 13: Main-result uncertainty", "E.2 Sequential")
    printed = " ".join(f"{DAS_NAMES[model]} " + " ".join(
        f"{method} " + " ".join(_ci(papers.DAS_TABLE_1[model][method][task][0], ci)
                                for task, ci in zip(papers.DAS_TABLE_1_TASKS, intervals, strict=True))
        for method, intervals in rows.items()) for model, rows in papers.DAS_TABLE_13.items())
    assert printed in table13
    assert {m: tuple(r) for m, r in papers.DAS_TABLE_13.items()} == {m: tuple(r) for m, r in papers.DAS_TABLE_1.items()}
    table14 = _after(das, "Table 14: Huginn/GSM8K sequential proposal-cost", "Draft d A")
    assert "cumulative CUDA-event time spent on proposal construction per request" in table14
    assert " ".join(f"{method} {' '.join(map(str, row))}" for method, row in papers.DAS_TABLE_14.items()) in das
