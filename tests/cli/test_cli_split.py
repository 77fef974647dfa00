"""``dpopt split``: the printed table, the PNG and the HTML page, and the page's sliders in a real browser.

The browser test drives Debian's ``chromium`` through Selenium and
``chromedriver`` (``.ci/run`` installs them); it is skipped where any of the
three is missing.
"""

import json
import math
import shutil

import pytest
from typer.testing import CliRunner

from dpopt.cli import app

runner = CliRunner()

# small enough for a fast test: rdp, 2 batch sizes x 3 epsilons (about a second)
ARGS = [
    "split",
    "--target-epsilon",
    "0.5",
    "--dataset-size",
    "60000",
    "--epochs",
    "30",
    "--batch-sizes",
    "8,256",
    "--epsilon-grid",
    "0.25,0.5,1",
    "--accountant",
    "rdp",
]


@pytest.fixture(scope="module")
def explorer(tmp_path_factory):
    out = tmp_path_factory.mktemp("split")
    res = runner.invoke(app, ARGS + ["--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    return out, json.loads(res.stdout)


def test_split_prints_the_three_columns_and_marks_no_solution(tmp_path):
    res = runner.invoke(app, ARGS + ["--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    row8 = next(line for line in lines if line.split()[0] == "8")
    row256 = next(line for line in lines if line.split()[0] == "256")
    assert "NO SOLUTION" in row8 and "NO SOLUTION" not in row256  # B/10 = 0.8 <= sigma ~ 1.05
    assert "+2.60%" in row8 and "+2.60%" in row256  # share r = 0.05 inflates by 1/sqrt(0.95) - 1
    assert (tmp_path / "split.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "split.html").exists()


def test_split_json_and_a_self_contained_page(explorer):
    out, data = explorer
    rows = {r["batch_size"]: r for r in data["rows"]}
    assert rows[8.0]["b20_solvable"] is False and rows[8.0]["b20_grad_noise_multiplier"] is None
    assert rows[256.0]["steps"] == math.ceil(30 * 60000 / 256)
    sigma = rows[256.0]["noise_multiplier"]
    assert rows[256.0]["share_grad_noise_multiplier"] == pytest.approx(sigma / math.sqrt(0.95))
    assert data["epsilon_grid"] == [0.25, 0.5, 1.0] and len(data["grid"]) == 3
    page = (out / "split.html").read_text(encoding="utf-8")
    assert "http://" not in page and "https://" not in page and "<script src" not in page
    assert "<link" not in page and "@import" not in page
    for slider in ('id="eps"', 'id="batch"', 'id="share"'):
        assert slider in page


def test_split_errors_name_flags(tmp_path):
    res = runner.invoke(
        app,
        [
            "split",
            "--target-epsilon",
            "1",
            "--dataset-size",
            "100",
            "--epochs",
            "1",
            "--batch-sizes",
            "8,500",
            "--out",
            str(tmp_path),
        ],
    )
    assert res.exit_code == 2 and res.stderr.startswith("error: every batch size must be in (0, N = 100]")
    res = runner.invoke(
        app,
        [
            "split",
            "--target-epsilon",
            "1",
            "--dataset-size",
            "100",
            "--epochs",
            "1",
            "--batch-sizes",
            "8,x",
            "--out",
            str(tmp_path),
        ],
    )
    assert res.exit_code == 2 and "--batch-sizes takes comma-separated numbers" in res.stderr
    res = runner.invoke(
        app,
        [
            "split",
            "--target-epsilon",
            "1",
            "--dataset-size",
            "100",
            "--epochs",
            "1",
            "--count-share",
            "1.5",
            "--out",
            str(tmp_path),
        ],
    )
    assert res.exit_code == 2 and res.stderr.startswith("error: --count-share must be in (0, 1)")


def _browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    binary = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
    driver = shutil.which("chromedriver")
    if binary is None or driver is None:
        pytest.skip("no headless browser (chromium + chromedriver) installed")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    options.binary_location = binary
    return webdriver.Chrome(options=options, service=Service(driver))


def test_page_sliders_recompute_in_a_real_browser(explorer):
    out, data = explorer
    browser = _browser()
    try:
        browser.get((out / "split.html").resolve().as_uri())
        assert browser.execute_script("return document.body.getAttribute('data-ready')") == "1"

        def text(id_):
            return browser.execute_script(f"return document.getElementById('{id_}').textContent")

        def move(id_, value):  # set the slider and fire the event a user's drag fires
            browser.execute_script(
                "const s = document.getElementById(arguments[0]); s.value = arguments[1];"
                "s.dispatchEvent(new Event('input', {bubbles: true}));",
                id_,
                str(value),
            )

        grid, sizes, eps = data["grid"], data["batch_sizes"], data["epsilon_grid"]
        # initial state: eps = 0.5 (grid row 1), B = 256 (column 1)
        assert text("out-batch") == "256"
        assert float(text("sigma")) == pytest.approx(grid[1][1], rel=1e-5)

        move("batch", 0)  # B = 8: the B/20 rule has no solution there, the share still has one
        assert text("out-batch") == "8"
        assert float(text("sigma")) == pytest.approx(grid[1][0], rel=1e-5)
        assert text("b20-grad") == "no solution"
        assert float(text("share-grad")) == pytest.approx(grid[1][0] / math.sqrt(0.95), rel=1e-3)

        move("eps", math.log(eps[2]))  # eps = 1: a grid point, exact
        assert float(text("out-eps")) == pytest.approx(1.0, rel=1e-3)
        assert float(text("sigma")) == pytest.approx(grid[2][0], rel=1e-5)

        mid = 0.5 * (math.log(eps[1]) + math.log(eps[2]))  # between grid points: geometric interpolation
        move("eps", mid)
        expected = math.sqrt(grid[1][0] * grid[2][0])
        assert float(text("sigma")) == pytest.approx(expected, rel=1e-3)

        move("share", 0.2)
        assert float(text("out-share")) == pytest.approx(0.2)
        assert float(text("share-grad")) == pytest.approx(expected / math.sqrt(0.8), rel=1e-3)
        assert float(text("share-count-std")) == pytest.approx(expected / (2 * math.sqrt(0.2)), rel=1e-3)
        a = (0.2 * expected / (2 * 8)) ** (2 / 3)
        assert float(text("best-share")) == pytest.approx(a / (1 + a), rel=1e-3)
        rows = browser.execute_script("return document.getElementById('rows').rows.length")
        assert rows == len(sizes)
    finally:
        browser.quit()
