"""The book builds with warnings as errors from the committed, executed notebooks, and every page reads right in a
real browser (headless Chromium): math typeset, images loaded, tables legible, no tracebacks, Colab links, and every
table, figure and display equation within the page's content column at a 1280 px window."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).parent.parent
OUT = ROOT / "_build" / "test-book"  # the HTML and the screenshots stay here as test artifacts
WINDOW = (1280, 1800)  # the browser window the pages are read in, in CSS pixels
REPOSITORY = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]["url"].removeprefix("https://github.com/")


@pytest.fixture(scope="module")
def html(tmp_path_factory) -> Path:
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    config["execute"]["execute_notebooks"] = "off"  # nbval executes each chapter once; build from its outputs
    extensions = config["sphinx"].get("local_extensions") or {}  # relative to the config file, which moves
    config["sphinx"]["local_extensions"] = {name: str(ROOT / path) for name, path in extensions.items()}
    config_file = tmp_path_factory.mktemp("book") / "_config.yml"
    config_file.write_text(yaml.safe_dump(config))
    shutil.rmtree(OUT, ignore_errors=True)
    result = subprocess.run(
        [str(Path(sys.executable).parent / "jupyter-book"), "build", str(ROOT), "-W", "-n", "--keep-going",
         "--config", str(config_file), "--path-output", str(OUT)],
        capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return OUT / "_build" / "html"


def pages(html: Path) -> list[Path]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]] + [c["file"] for part in toc["parts"] for c in part["chapters"]]
    return [html / f"{f}.html" for f in files]


def test_book_builds(html):
    assert all(p.exists() for p in pages(html)), [p.name for p in pages(html) if not p.exists()]


def test_the_intro_gives_the_ways_in():
    """The intro gives the README's install command and three routes (a laptop CPU with the tiny model, a local GPU,
    Colab), one item each."""
    intro = (ROOT / "book" / "intro.md").read_text()
    build = next(line for line in (ROOT / "README.md").read_text().splitlines()
                 if line.endswith(" && jupyter-book build . -W"))
    assert build.removesuffix(" && jupyter-book build . -W") in intro.splitlines()
    routes = re.findall(r"^- \*\*(.+?):\*\* (.+)$", intro, re.MULTILINE)
    assert [name for name, _ in routes] == ["A laptop CPU, with the tiny model", "A local GPU", "Colab"]
    assert "jupyter-book build . -W" in routes[0][1] and "LOOPED_KV_MODEL=" in intro and "launch button" in routes[2][1]


def _browser():
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    driver_path = shutil.which("chromedriver")
    try:
        from selenium import webdriver
    except ImportError:
        pytest.skip("selenium is not installed (pip install -e '.[test]')")
    if not chromium or not driver_path:
        pytest.skip("no headless Chromium here (Debian: apt-get install chromium chromium-driver; .ci/run does)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--window-size={WINDOW[0]},{WINDOW[1]}", "--allow-file-access-from-files"):
        options.add_argument(flag)
    service = webdriver.ChromeService(executable_path=driver_path)
    return webdriver.Chrome(options=options, service=service)


@pytest.fixture(scope="module")
def browser():
    driver = _browser()
    yield driver
    driver.quit()


# After MathJax has typeset the page: the article's prose (code, outputs of streams and math removed), the
# images, the table cells, and the Colab link.
PAGE_STATE = """
const done = arguments[arguments.length - 1];
const ready = (window.MathJax && MathJax.startup && MathJax.startup.promise) || Promise.resolve();
ready.then(() => {
  const article = document.querySelector('main article') || document.body;
  const prose = article.cloneNode(true);
  prose.querySelectorAll('pre, code, script, style, mjx-container, .cell_input, .output.stream')
       .forEach(e => e.remove());
  done({
    typeset: !!(window.MathJax && MathJax.startup),
    prose: prose.innerText,
    text: article.innerText,
    images: [...article.querySelectorAll('img')].map(i => [i.src, i.complete, i.naturalWidth]),
    cells: [...article.querySelectorAll('td')].map(c => c.innerText.trim()),
    stderr: article.querySelectorAll('.output.stderr').length,
    colab: [...document.querySelectorAll('a[href*="colab.research.google.com"]')].map(a => a.href),
  });
}).catch(e => done({error: String(e)}));
"""
RUN_TOGETHER = re.compile(r"\d\.\d+\.\d|\d,\d{3}\.\d+\.\d|(?<![\w.])nan(?![\w.])", re.IGNORECASE)


def _open(browser, page: Path) -> None:
    """Load ``page`` and wait for the new document, not the previous one's teardown."""
    from selenium.webdriver.support.ui import WebDriverWait

    browser.set_script_timeout(60)
    browser.get(page.as_uri())
    WebDriverWait(browser, 30).until(
        lambda d: d.execute_script("return document.readyState === 'complete' && !!document.body "
                                   "&& document.location.href") == page.as_uri())


def test_every_page_reads_right_in_a_browser(html, browser):
    shots = OUT / "screenshots"
    shots.mkdir(parents=True, exist_ok=True)
    problems = []
    for page in pages(html):
        _open(browser, page)
        state = browser.execute_async_script(PAGE_STATE)
        browser.save_screenshot(str(shots / f"{page.stem}.png"))
        name = page.relative_to(html).as_posix()
        if "error" in state:
            problems.append(f"{name}: {state['error']}")
            continue
        raw = [m for m in ("$$", "\\(", "\\[", "$") if m in state["prose"]]
        if raw:
            where = state["prose"].index(raw[0])
            problems.append(f"{name}: raw math {raw[0]!r} near {state['prose'][max(0, where - 60):where + 60]!r}")
        broken = [src for src, complete, width in state["images"] if not complete or width == 0]
        if broken:
            problems.append(f"{name}: images not loaded: {broken}")
        run_together = [c for c in state["cells"] if RUN_TOGETHER.search(c)]
        if run_together:
            problems.append(f"{name}: table cells with numbers run together or NaN: {run_together[:5]}")
        if "Traceback (most recent call last)" in state["text"] or state["stderr"]:
            problems.append(f"{name}: a traceback or a stderr block is shown")
        if page.parent.name == "notebooks":
            expected = f"colab.research.google.com/github/{REPOSITORY}/blob/main/notebooks/{page.stem}.ipynb"
            if not any(expected in link for link in state["colab"]):
                problems.append(f"{name}: no Colab launch link to {expected} (found {state['colab']})")
    assert not problems, "\n".join(problems)


# After MathJax has typeset the page: the content column's width (the article's content box), and what is wider:
# tables (their box or their scrolled content), figures (images, SVG, canvases, as rendered), and display equations
# (a MathJax container whose content is wider than its box is clipped or scrolls).
PAGE_WIDTHS = """
const done = arguments[arguments.length - 1];
const ready = (window.MathJax && MathJax.startup && MathJax.startup.promise) || Promise.resolve();
ready.then(() => {
  const article = document.querySelector('main article') || document.body;
  const style = getComputedStyle(article);
  const column = article.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
  const label = e => [...(e.innerText || e.getAttribute('src') || e.getAttribute('aria-label') || e.tagName)
    .trim().replace(/\\s+/g, ' ')].slice(0, 60).join('');  // whole characters: math text is outside the BMP
  const wide = (e, width) => width > column + 1 ? [[label(e), Math.round(width)]] : [];
  done({
    window: window.innerWidth,
    column: Math.round(column),
    tables: [...article.querySelectorAll('table')]
      .flatMap(t => wide(t, Math.max(t.getBoundingClientRect().width, t.scrollWidth))),
    figures: [...article.querySelectorAll('img, svg, canvas')].filter(f => !f.closest('mjx-container'))
      .flatMap(f => wide(f, f.getBoundingClientRect().width)),
    equations: [...article.querySelectorAll('mjx-container[display="true"]')]
      .filter(m => m.scrollWidth > m.clientWidth + 1 || m.getBoundingClientRect().width > column + 1)
      .map(m => [label(m), m.scrollWidth, m.clientWidth]),
  });
}).catch(e => done({error: String(e)}));
"""


def test_every_page_fits_its_content_column(html, browser):
    """At a 1280 px window no table, figure or display equation on any page is wider than the page's content column:
    a table whose cells do not wrap hides its last columns (the verdict, once) off-screen, and a clipped equation
    loses its end."""
    problems = []
    for page in pages(html):
        _open(browser, page)
        state = browser.execute_async_script(PAGE_WIDTHS)
        name = page.relative_to(html).as_posix()
        if "error" in state:
            problems.append(f"{name}: {state['error']}")
            continue
        assert state["window"] == WINDOW[0], state["window"]
        column = state["column"]
        problems += [f"{name}: a table {width} px wide in a {column} px column: {text!r}"
                     for text, width in state["tables"]]
        problems += [f"{name}: a figure {width} px wide in a {column} px column: {text!r}"
                     for text, width in state["figures"]]
        problems += [f"{name}: a display equation {needs} px wide in its {box} px box: {text!r}"
                     for text, needs, box in state["equations"]]
    assert not problems, "\n".join(problems)



KERNEL_RUN = """
import sys, nbformat
from nbclient import NotebookClient
if sys.argv[1] == "encrypted":
    from looped_kv.book import encrypt_kernel_channels
    encrypt_kernel_channels()
notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(6 * 7)")])
client = NotebookClient(notebook, kernel_name="python3", timeout=120)
client.execute()
print(notebook.cells[0].outputs[0]["text"].strip())
"""


@pytest.mark.parametrize("channels", ["encrypted", "plain"])
def test_chapter_kernels_do_not_warn_of_plain_tcp(channels):
    """The book build and nbval start kernels the way nbclient does here; with the setting both apply
    (book/_ext/encrypted_kernels.py, tests/conftest.py) the channels are encrypted and the kernel does not warn.
    The plain run shows the check can fail."""
    result = subprocess.run([sys.executable, "-c", KERNEL_RUN, channels], capture_output=True, text=True,
                            timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    warned = "without encryption" in result.stderr
    assert result.stdout.split() == ["42"]
    assert warned == (channels == "plain"), result.stderr[-2000:]


def test_nbval_kernels_are_encrypted():
    """nbval starts its own kernels; under this suite's setting (tests/conftest.py) they get CurveZMQ keys."""
    from nbval.kernel import CURRENT_ENV_KERNEL_NAME, start_new_kernel

    manager, client = start_new_kernel(kernel_name=CURRENT_ENV_KERNEL_NAME)
    try:
        assert manager.curve_publickey is not None and manager.curve_secretkey is not None
    finally:
        client.stop_channels()
        manager.shutdown_kernel()
