"""One self-contained HTML page for the budget split explorer (sliders for ε, batch size and share).

The page embeds the σ(ε, B̄) grid of a :class:`~dpopt.accounting.split.SplitTable`
as JSON and an inline script; it loads nothing from the network. Moving a
slider recomputes, in the browser:

* σ at the chosen ε, interpolated linearly in (ln ε, ln σ) between the grid's
  ε values (exact at grid points), for the chosen batch size (a grid column);
* the B̄/20 rule: σ_b = B̄/20, a split only if B̄/10 > σ, then r = (10σ/B̄)²
  and σ_grad = σ/√(1 − r) — otherwise "no solution";
* the budget share r: σ_grad = σ/√(1 − r), σ_b = σ/(2√r), inflation σ_grad/σ − 1;
* the best share r* = a/(1 + a), a = (η_C·σ/(2B̄))^(2/3) (see
  :mod:`dpopt.accounting.split`).

Element ids the page guarantees (used by the browser test): sliders
``eps``, ``batch``, ``share``; values ``out-eps``, ``out-batch``, ``out-share``,
``sigma``, ``b20-grad``, ``b20-share``, ``share-grad``, ``share-inflation``,
``share-count-std``, ``best-share``, ``best-grad``, ``best-inflation``; a table
body ``rows`` with every batch size at the chosen ε and r. The ``body`` gets
``data-ready="1"`` once the script has run.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Union

from ..atomic import atomic_write_text

__all__ = ["render_split_html", "write_split_html"]


def _page_data(table) -> dict:
    return {
        "target_epsilon": table.target_epsilon,
        "delta": table.delta,
        "dataset_size": table.dataset_size,
        "epochs": table.epochs,
        "accountant": table.accountant,
        "count_share": table.count_share,
        "quantile_lr": table.quantile_lr,
        "batch_sizes": list(table.batch_sizes),
        "steps": [r.steps for r in table.rows],
        "epsilon_grid": list(table.epsilon_grid),
        "grid": [[None if s is None or not math.isfinite(s) else s for s in line] for line in table.grid],
    }


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 60em; color: #222; }
h1 { font-size: 1.4em; } .muted { color: #666; font-size: 0.9em; }
.controls { display: grid; grid-template-columns: 12em 1fr 8em; gap: 0.6em 1em; align-items: center; }
.cards { display: grid; grid-template-columns: repeat(3, 1fr); gap: 1em; margin: 1.5em 0; }
.card { border: 1px solid #ccc; border-radius: 6px; padding: 0.8em; }
.card h2 { font-size: 1em; margin: 0 0 0.5em 0; }
.bad { color: #b00020; font-weight: bold; } .num { font-variant-numeric: tabular-nums; }
table { border-collapse: collapse; width: 100%; } td, th { border-bottom: 1px solid #ddd; padding: 0.3em 0.5em;
text-align: right; } th { background: #f4f4f4; } tr.sel { background: #fff6d5; }
"""

_SCRIPT = r"""
(function () {
  "use strict";
  var D = JSON.parse(document.getElementById("split-data").textContent);
  var $ = function (id) { return document.getElementById(id); };
  var lnE = D.epsilon_grid.map(Math.log);
  function fmt(x, d) { return (x === null || !isFinite(x)) ? "n.a." : Number(x).toPrecision(d || 4); }
  function pct(x) { return (x === null || !isFinite(x)) ? "n.a." : (100 * x).toFixed(2) + " %"; }
  // sigma at epsilon for batch column j: linear in (ln eps, ln sigma) between grid rows
  function sigmaAt(eps, j) {
    var u = Math.log(eps), n = lnE.length;
    for (var i = 0; i < n; i++) {
      if (Math.abs(u - lnE[i]) < 1e-12) { return D.grid[i][j]; }
    }
    for (i = 0; i + 1 < n; i++) {
      if (u > lnE[i] && u < lnE[i + 1]) {
        var a = D.grid[i][j], b = D.grid[i + 1][j];
        if (a === null || b === null) { return null; }
        var t = (u - lnE[i]) / (lnE[i + 1] - lnE[i]);
        return Math.exp((1 - t) * Math.log(a) + t * Math.log(b));
      }
    }
    return null;
  }
  function splits(sigma, B, r) {
    var out = {sigma: sigma, b20_std: B / 20};
    if (sigma === null) { return out; }
    var c = B / 10;  // 2 sigma_b under the B/20 rule
    if (c > sigma) { out.b20_r = Math.pow(sigma / c, 2); out.b20_grad = sigma / Math.sqrt(1 - out.b20_r); }
    else { out.b20_r = null; out.b20_grad = null; }
    out.share_grad = sigma / Math.sqrt(1 - r);
    out.share_std = sigma / (2 * Math.sqrt(r));
    var a = Math.pow(D.quantile_lr * sigma / (2 * B), 2 / 3);
    out.best_r = a / (1 + a);
    out.best_grad = sigma / Math.sqrt(1 - out.best_r);
    return out;
  }
  function eps() { return Math.exp(parseFloat($("eps").value)); }
  function update() {
    var e = eps(), j = parseInt($("batch").value, 10), r = parseFloat($("share").value);
    var B = D.batch_sizes[j], s = splits(sigmaAt(e, j), B, r);
    $("out-eps").textContent = fmt(e, 4);
    $("out-batch").textContent = String(B);
    $("out-share").textContent = fmt(r, 3);
    $("sigma").textContent = fmt(s.sigma, 6);
    $("steps").textContent = String(D.steps[j]);
    $("b20-std").textContent = fmt(s.b20_std, 4);
    if (s.sigma !== null && s.b20_grad === null) {
      $("b20-grad").textContent = "no solution";
      $("b20-grad").className = "bad";
      $("b20-share").textContent = "needs B > 10\u03c3 = " + fmt(10 * s.sigma, 4);
    } else {
      $("b20-grad").textContent = fmt(s.b20_grad, 6);
      $("b20-grad").className = "num";
      $("b20-share").textContent = fmt(s.b20_r, 4) + " (inflation " + pct(s.b20_grad / s.sigma - 1) + ")";
    }
    $("share-grad").textContent = fmt(s.share_grad, 6);
    $("share-inflation").textContent = pct(s.share_grad / s.sigma - 1);
    $("share-count-std").textContent = fmt(s.share_std, 4);
    $("best-share").textContent = fmt(s.best_r, 4);
    $("best-grad").textContent = fmt(s.best_grad, 6);
    $("best-inflation").textContent = pct(s.best_grad / s.sigma - 1);
    var body = $("rows"), html = "";
    for (var k = 0; k < D.batch_sizes.length; k++) {
      var b = D.batch_sizes[k], t = splits(sigmaAt(e, k), b, r);
      var b20 = t.sigma === null ? "n.a." : (t.b20_grad === null ? "<span class=bad>no solution</span>" : fmt(t.b20_grad, 5));
      html += "<tr" + (k === j ? " class=sel" : "") + "><td>" + b + "</td><td>" + D.steps[k] + "</td><td>" +
        fmt(t.sigma, 5) + "</td><td>" + b20 + "</td><td>" + fmt(t.share_grad, 5) + "</td><td>" +
        fmt(t.best_r, 3) + "</td><td>" + fmt(t.best_grad, 5) + "</td></tr>";
    }
    body.innerHTML = html;
  }
  ["eps", "batch", "share"].forEach(function (id) { $(id).addEventListener("input", update); });
  update();
  document.body.setAttribute("data-ready", "1");
})();
"""


def render_split_html(table) -> str:
    """The explorer page for a :class:`~dpopt.accounting.split.SplitTable`, as one HTML string."""
    data = _page_data(table)
    payload = json.dumps(data).replace("</", "<\\/")
    lo, hi = math.log(min(table.epsilon_grid)), math.log(max(table.epsilon_grid))
    j0 = min(range(len(table.batch_sizes)), key=lambda j: abs(table.batch_sizes[j] - 256))
    esc = html.escape
    title = (
        f"Budget split explorer: N = {table.dataset_size}, {table.epochs:g} epochs, δ = {table.delta:g}, "
        f"accountant {table.accountant}"
    )
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{esc(title)}</title>
<style>{_CSS}</style>
</head>
<body>
<h1>What adaptive clipping's count costs in gradient noise</h1>
<p class="muted">{esc(title)}. Quantile clipping releases a noisy clipped count next to each noisy
gradient; both are charged, so for a target ε the gradient noise multiplier σ_grad must exceed the
σ calibrated without adaptive clipping. σ(ε, B̄) was calibrated by dpopt on a grid
(ε ∈ {esc(", ".join(f"{e:g}" for e in table.epsilon_grid))}) and is interpolated in (ln ε, ln σ) between
grid points; everything else is closed form. T = ⌈epochs·N/B̄⌉ steps at q = B̄/N. See docs/algorithms.md,
"Quantile adaptive clipping" and "The budget split explorer".</p>
<div class="controls">
  <label for="eps">target ε</label>
  <input type="range" id="eps" min="{lo!r}" max="{hi!r}" step="any" value="{math.log(table.target_epsilon)!r}">
  <span id="out-eps" class="num"></span>
  <label for="batch">expected batch size B̄</label>
  <input type="range" id="batch" min="0" max="{len(table.batch_sizes) - 1}" step="1" value="{j0}">
  <span id="out-batch" class="num"></span>
  <label for="share">budget share r</label>
  <input type="range" id="share" min="0.001" max="0.5" step="0.001" value="{table.count_share!r}">
  <span id="out-share" class="num"></span>
</div>
<div class="cards">
  <div class="card"><h2>No adaptive clipping</h2>
    σ = <span id="sigma" class="num"></span><br>T = <span id="steps" class="num"></span> steps</div>
  <div class="card"><h2>σ<sub>b</sub> = B̄/20 rule</h2>
    σ<sub>b</sub> = <span id="b20-std" class="num"></span><br>
    σ<sub>grad</sub> = <span id="b20-grad" class="num"></span><br>share r = <span id="b20-share" class="num"></span></div>
  <div class="card"><h2>Budget share r</h2>
    σ<sub>grad</sub> = <span id="share-grad" class="num"></span> (inflation <span id="share-inflation" class="num"></span>)<br>
    count noise σ<sub>b</sub> = <span id="share-count-std" class="num"></span><br>
    best r* = <span id="best-share" class="num"></span>: σ<sub>grad</sub> = <span id="best-grad" class="num"></span>
    (inflation <span id="best-inflation" class="num"></span>)</div>
</div>
<table>
<thead><tr><th>B̄</th><th>steps</th><th>σ (no adaptive clipping)</th><th>σ_grad, B̄/20 rule</th>
<th>σ_grad, share r</th><th>best r*</th><th>σ_grad at r*</th></tr></thead>
<tbody id="rows"></tbody>
</table>
<p class="muted">Best r* minimises 1/√(1−r) + η_C·σ/(2B̄√r), the gradient-noise inflation plus the clip
bound's per-step log-jitter from the count noise (η_C = {table.quantile_lr:g}); it is dpopt's choice, not a paper's.</p>
<script type="application/json" id="split-data">{payload}</script>
<script>{_SCRIPT}</script>
</body>
</html>
"""


def write_split_html(table, path: Union[str, Path]) -> Path:
    """Write :func:`render_split_html` to ``path`` (UTF-8); returns the path."""
    path = Path(path)
    atomic_write_text(path, render_split_html(table))
    return path
