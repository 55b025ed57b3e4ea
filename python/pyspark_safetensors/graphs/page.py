"""The graph browser: static files, opened from disk (no server). ``index.html`` lists
the prompts with their scores; ``graph.html#ID`` draws prompt ID's pruned graph as an
SVG (input tokens at the bottom, one row per block, the logits on top; a feature a
circle, an error node a square; an edge blue when it excites, red when it inhibits, its
width its weight; the positions fit to the window's width, whitespace in tokens shown)
and lists a clicked node's incoming edges, the others dimmed, with a link to a feature's
page in a feature browser (``data/pages.js``'s pattern, when set). The data are ``.js`` files
(``data/index.js``, ``data/graph-ID.js``) that set a global, so the pages work from
``file://`` where a browser refuses to fetch JSON.
"""

from __future__ import annotations

import json
from pathlib import Path

INDEX = """<!doctype html><meta charset="utf-8"><title>Attribution graphs</title>
<style>body{font:14px sans-serif;margin:2em}td,th{padding:2px 10px;text-align:left}
tr.graph-row{cursor:pointer}tr.graph-row:hover{background:#eef}.error{color:#a00}</style>
<h1>Attribution graphs</h1><table id="graphs"><thead><tr><th>id</th><th>prompt</th>
<th>replacement</th><th>completeness</th><th>nodes kept</th><th>edges kept</th></tr></thead>
<tbody></tbody></table><script src="data/index.js"></script><script>
const body = document.querySelector('#graphs tbody');
for (const g of GRAPHS) {
  const tr = document.createElement('tr');
  tr.className = g.status === 'ok' ? 'graph-row' : 'graph-row error';
  tr.dataset.id = g.prompt_id;
  const cells = g.status === 'ok'
    ? [g.prompt_id, g.prompt, g.replacement_score.toFixed(3), g.completeness_score.toFixed(3),
       g.n_kept_nodes + ' / ' + g.n_nodes, g.n_kept_edges]
    : [g.prompt_id, g.prompt, 'refused: ' + g.error, '', '', ''];
  for (const c of cells) { const td = document.createElement('td'); td.textContent = c; tr.append(td); }
  if (g.status === 'ok') tr.onclick = () => { location.href = 'graph.html#' + g.prompt_id; };
  body.append(tr);
}
</script>"""

GRAPH = r"""<!doctype html><meta charset="utf-8"><title>Attribution graph</title>
<style>body{font:13px sans-serif;margin:1em}#info td{padding:1px 8px}
.node{cursor:pointer;stroke:#fff;stroke-width:1}.node.selected{stroke:#000;stroke-width:3}
.edge.dim{stroke-opacity:0.06}.row-label{fill:#666;font-size:12px}
.token{font:11px monospace;text-anchor:middle}.logit-label{font:11px monospace}
#legend span{margin-right:1.5em}#legend i{display:inline-block;width:10px;height:10px;
margin-right:4px;border-radius:5px}</style>
<a href="index.html">all graphs</a><h2 id="title"></h2><div id="scores"></div>
<div id="legend"><span><i style="background:#fa0"></i>feature</span>
<span><i style="background:#999;border-radius:0"></i>error</span>
<span><i style="background:#6a6"></i>token embedding</span><span><i style="background:#a6f"></i>logit</span>
<span style="color:#36c">&#9472; excites</span><span style="color:#c33">&#9472; inhibits</span>
<span>click a node: its incoming edges</span></div>
<svg id="graph" xmlns="http://www.w3.org/2000/svg"></svg><table id="info"></table>
<script src="data/pages.js"></script><script>
const id = location.hash.slice(1);
const s = document.createElement('script');
s.src = 'data/graph-' + id + '.js';
s.onload = () => draw(GRAPH);
document.body.append(s);
function visible(text) {  // whitespace a reader can see
  return text.replace(/ /g, '\u2423').replace(/\n/g, '\u23ce').replace(/\t/g, '\u21e5');
}
function layout(g, left, W, H, rows) {
  // rows: embeddings at the bottom, a row per block, logits on top; a cell's nodes side by side
  const cells = {}, xy = {};
  for (const n of g.nodes) {
    const row = n.kind === 'embedding' ? 0 : n.kind === 'logit' ? rows - 1 : n.layer + 1;
    const col = n.kind === 'logit' ? g.tokens.length - 1 : n.pos;
    (cells[row + ',' + col] = cells[row + ',' + col] || []).push([n, row, col]);
  }
  for (const cell of Object.values(cells)) {
    const logits = cell[0][1] === rows - 1, step = logits ? 70 : Math.min(12, (W - 4) / cell.length);
    cell.forEach(([n, row, col], i) => {
      const x0 = left + W * (col + 0.5);
      const x = logits ? x0 - step * i : x0 + step * (i - (cell.length - 1) / 2);
      xy[n.node] = [x, 30 + H * (rows - 1 - row) + (logits ? 0 : (i % 2) * 8 * (step < 8))];
    });
  }
  return xy;
}
function draw(g) {
  document.getElementById('title').textContent = g.prompt;
  document.getElementById('scores').textContent = 'replacement ' +
    g.replacement_score.toFixed(3) + ', completeness ' + g.completeness_score.toFixed(3) +
    ' (' + g.n_kept_nodes + ' of ' + g.n_nodes + ' nodes and ' + g.n_kept_edges + ' edges kept)';
  const P = g.tokens.length, rows = g.n_blocks + 2, left = 60, H = 70;
  const W = Math.max(24, Math.min(90, (Math.max(window.innerWidth, 900) - left - 70) / P));
  const svg = document.getElementById('graph'), ns = 'http://www.w3.org/2000/svg';
  svg.setAttribute('width', left + W * P + 20); svg.setAttribute('height', H * rows + 20);
  const xy = layout(g, left, W, H, rows);
  const text = (x, y, t, cls) => { const e = document.createElementNS(ns, 'text');
    e.setAttribute('x', x); e.setAttribute('y', y); e.textContent = t; e.classList.add(cls);
    svg.append(e); return e; };
  for (let r = 0; r < rows; r++)
    text(4, 34 + H * (rows - 1 - r), r === 0 ? 'tokens' : r === rows - 1 ? 'logits' : 'layer ' + (r - 1), 'row-label');
  const maxw = Math.max(...g.edges.map(e => Math.abs(e.weight)), 1e-9);
  for (const e of g.edges) {
    const [x1, y1] = xy[e.source], [x2, y2] = xy[e.target], l = document.createElementNS(ns, 'line');
    Object.entries({x1, y1, x2, y2, stroke: e.weight > 0 ? '#36c' : '#c33',
      'stroke-opacity': 0.45, 'stroke-width': 0.4 + 3.6 * Math.abs(e.weight) / maxw})
      .forEach(([a, v]) => l.setAttribute(a, v));
    l.classList.add('edge'); l.dataset.target = e.target; svg.append(l);
  }
  for (const n of g.nodes) {
    const [x, y] = xy[n.node], el = document.createElementNS(ns, n.kind === 'error' ? 'rect' : 'circle');
    if (n.kind === 'error') { el.setAttribute('x', x - 4); el.setAttribute('y', y - 4);
      el.setAttribute('width', 8); el.setAttribute('height', 8); }
    else { el.setAttribute('cx', x); el.setAttribute('cy', y); el.setAttribute('r', n.kind === 'feature' ? 4.5 : 6); }
    el.setAttribute('fill', {feature: '#fa0', error: '#999', embedding: '#6a6', logit: '#a6f'}[n.kind]);
    el.classList.add('node', n.kind); el.dataset.node = n.node; el.onclick = () => show(g, n, el);
    const tip = document.createElementNS(ns, 'title');
    tip.textContent = n.node_id + (n.label !== n.node_id ? ' ' + JSON.stringify(n.label) : '') +
      (n.activation != null ? ', activation ' + n.activation.toFixed(3) : '');
    el.append(tip); svg.append(el);
    if (n.kind === 'embedding') text(x, y + 20, visible(n.label).slice(0, Math.max(2, W / 7)), 'token');
    if (n.kind === 'logit') text(x - 10, y - 12, visible(n.label), 'logit-label');
  }
}
function show(g, n, el) {
  document.querySelectorAll('.node.selected').forEach(e => e.classList.remove('selected'));
  el.classList.add('selected');
  document.querySelectorAll('line.edge').forEach(l =>
    l.classList.toggle('dim', Number(l.dataset.target) !== n.node));
  const info = document.getElementById('info'); info.innerHTML = '';
  const head = info.insertRow();
  head.insertCell().textContent = n.node_id + ' (' + n.kind + (n.kind === 'logit' ? ' ' + JSON.stringify(n.label) : '') + ')';
  head.insertCell().textContent = 'value ' + n.value.toFixed(4);
  if (n.kind === 'feature' && window.FEATURE_PAGES) {  // that latent's feature page
    const a = document.createElement('a'); a.className = 'feature-page'; a.target = '_blank';
    a.href = FEATURE_PAGES.replace(/\{layer\}/g, n.layer).replace(/\{latent\}/g, n.latent);
    a.textContent = 'feature browser \u2197'; head.insertCell().append(a);
  }
  const byId = Object.fromEntries(g.nodes.map(m => [m.node, m]));
  for (const e of g.edges.filter(e => e.target === n.node).sort((a, b) => Math.abs(b.weight) - Math.abs(a.weight))) {
    const r = info.insertRow(); r.className = 'incoming';
    const m = byId[e.source];
    r.insertCell().textContent = m.node_id + (m.kind === 'embedding' ? ' ' + JSON.stringify(m.label) : '');
    r.insertCell().textContent = e.weight.toFixed(4);
  }
}
</script>"""


def _js(name: str, value) -> str:
    return f"var {name} = {json.dumps(value)};\n"


def index_files(scalars: list[dict], feature_pages: str = "") -> dict[str, str]:
    """The pages and the index's data (``data/index.js``) by relative path, from the
    graphs' scalar rows (``job.SCALARS``), in prompt order; ``data/pages.js`` holds the
    feature pages' pattern (``GraphsConfig.feature_pages``; empty: no link)."""
    return {"index.html": INDEX, "graph.html": GRAPH, "data/index.js": _js("GRAPHS", scalars),
            "data/pages.js": _js("FEATURE_PAGES", feature_pages)}  # fmt: skip


def graph_data(row: dict, token_text) -> str:
    """``data/graph-ID.js`` of one attributed prompt's row (``job.graph_row``): its
    scalars, kept nodes (each with a ``label``: its token's text, ``token_text(id)``, or
    its id) and pruned edges."""
    scalars = {k: v for k, v in row.items() if k not in ("nodes", "edges", "adjacency")}
    nodes = [
        {**n, "label": token_text(n["token"]) if n["token"] is not None else n["node_id"]}
        for n in row["nodes"]
        if n["kept"]
    ]
    tokens = [n["token"] for n in nodes if n["kind"] == "embedding"]  # always kept
    logits = sum(n["kind"] == "logit" for n in nodes)
    n_blocks = (row["n_nodes"] - row["n_features"] - len(tokens) - logits) // len(tokens)
    data = {**scalars, "nodes": nodes, "edges": row["edges"], "tokens": tokens,
            "n_blocks": n_blocks}  # fmt: skip
    return _js("GRAPH", data)


def screenshot_graph(root: str | Path, png: str | Path, prompt_id: int | None = None, *,
                     width: int = 1400, height: int = 900) -> Path | None:  # fmt: skip
    """A PNG of the browser in ``root``: prompt ``prompt_id``'s graph (default: the first
    graph of the index) with its most probable logit's node selected (its incoming edges
    listed); None when headless Chromium is not available here or no prompt has a graph."""
    from ..features.screenshot import chromium, chromium_missing

    if chromium_missing():
        return None
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    with chromium(width, height) as driver:
        driver.get((Path(root) / "index.html").resolve().as_uri())
        rows = driver.find_elements(By.CSS_SELECTOR, "tr.graph-row:not(.error)")
        if prompt_id is not None:
            rows = [r for r in rows if r.get_attribute("data-id") == str(prompt_id)]
        if not rows:
            return None
        rows[0].click()
        WebDriverWait(driver, 10).until(lambda d: d.find_elements(By.CSS_SELECTOR, ".node.logit"))
        logit = driver.find_elements(By.CSS_SELECTOR, ".node.logit")[0]
        driver.execute_script("arguments[0].dispatchEvent(new MouseEvent('click'))", logit)
        Path(png).parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(png))
    return Path(png)
