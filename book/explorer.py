"""An interactive attention explorer for the book's pages, working offline.

`attention_explorer(weights, tokens)` returns an object that a notebook shows
as the explorer: the reader picks a sequence, a layer and a head (menus shown
only where there are several), then hovers over or clicks a token to see the
weights that token gives to every token: the tokens are shaded by weight and
a bar chart shows the numbers; a heatmap of the whole matrix sits beside it
(hovering over or clicking a row selects that query as well).

The charts are drawn by plotly.js (the JavaScript of the PyPI package
`plotly`, which the book's site ships in `_static/plotly/`; see
`_ext/site_extras.py`); no CDN and no kernel is needed. The token menus and
shading need no library, so they work in Jupyter too once the cell has run
(or the notebook is trusted), where only the charts are missing unless
plotly.js is loaded. Printed and downloaded pages keep the
chapter's static figure: the explorer is hidden in print.

The weights are stored in the page rounded to `precision` decimals (3 by
default) in a JSON block (class `attention-explorer-data`), the numbers the
explorer shows and the browser test compares.

The plain-text form (what nbval compares besides the HTML) names only the
shapes and the precision, for example
`<attention explorer: 2 sequences, 1 layer, 4 heads; T = 6, 5; 3 decimals>`.
"""

import hashlib
import html
import json

import numpy as np

PRECISION = 3

__all__ = [
    "PRECISION",
    "AttentionExplorer",
    "attention_explorer",
    "distance_to_tie",
]


def _as_array(x, what):
    parts = x if isinstance(x, list | tuple) else [x]
    if any(a is None for a in parts):
        raise ValueError(
            f"{what} hold None: a layer that computes no weight matrix (the "
            f"flash or sdpa backend, linear attention) has none to explore"
        )
    if hasattr(x, "detach"):  # a torch tensor
        x = x.detach().cpu().numpy()
    try:
        a = np.asarray(x)
        if np.iscomplexobj(a):
            raise ValueError("complex numbers")
        a = a.astype(np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"{what} is not an array of real numbers: {e}"
        ) from None
    return a


def _token_list(tokens, what):
    if isinstance(tokens, str) or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"{what} must be a list of strings, got {tokens!r}")
    return list(tokens)


def check_precision(precision):
    """Raise ValueError unless precision is an int from 1 to 8."""
    if type(precision) is not int or not 1 <= precision <= 8:
        raise ValueError(
            f"precision must be an int from 1 to 8: {precision!r}"
        )


def _plural(n, word):
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


class AttentionExplorer:
    """What `attention_explorer` returns: `.data` is the JSON-ready payload
    (rounded weights, tokens, names); a notebook displays the HTML."""

    def __init__(self, data, figure=None, first_position=1):
        self.data = data
        self.figure = figure
        self.first_position = first_position
        text = json.dumps(data, separators=(",", ":"), ensure_ascii=True)
        self.key = hashlib.sha1(text.encode()).hexdigest()[:12]
        self._json = text.replace("</", "<\\/")

    def __repr__(self):
        d = self.data
        lengths = ", ".join(str(len(s["queries"])) for s in d["sequences"])
        return (
            f"<attention explorer: {_plural(len(d['sequences']), 'sequence')}"
            f", {_plural(len(d['layers']), 'layer')}"
            f", {_plural(len(d['heads']), 'head')}; T = {lengths}"
            f"; {d['precision']} decimals>"
        )

    def _repr_html_(self):
        element_id = f"attention-explorer-{self.key}"
        title = html.escape(self.data["title"])
        if self.figure is None:  # the default, laid out as it always was
            caption, noscript = "the same weights", "the same\nweights"
        else:
            caption = noscript = html.escape(self.figure)
        script = _SCRIPT.replace("@ID@", element_id).replace(
            "@FIRST@", str(self.first_position)
        )
        return (
            _TEMPLATE.replace("@ID@", element_id)
            .replace("@TITLE@", title)
            .replace("@FIGURE@", caption)
            .replace("@FIG_NS@", noscript)
            .replace("@DATA@", self._json)
            .replace("@SCRIPT@", script)
        )


def attention_explorer(
    weights,
    tokens,
    *,
    key_tokens=None,
    sequences=None,
    layer_names=None,
    head_names=None,
    title="Attention weights",
    precision=PRECISION,
    figure=None,
    first_position=1,
):
    """The interactive explorer of attention weights, for a notebook page.

    weights: shape (S, L, H, T_q, T_k), sequences x layers x heads x queries
        x keys (a NumPy array or a tensor); or, for sequences of different
        lengths, a list of S arrays shaped (L, H, T_q, T_k). Each row is one
        query's softmax weights: numbers in [0, 1] that sum to 1 (masked
        positions hold 0).
    tokens: the query tokens, a list of S lists of strings (one list of
        strings when S = 1).
    key_tokens: the key tokens in the same form, where they differ from the
        queries (cross-attention); by default the queries.
    sequences, layer_names, head_names: the names in the menus (default
        "sequence 1", "layer 1", "head 1", ...).
    precision: decimals kept in the page (and shown).
    figure: what the chapter's static figure shows of these weights, for the
        caption ("the chapter's static figure shows ..."); by default "the
        same weights".
    first_position: the number the status line gives the first token (1 by
        default; 0 for a chapter that counts positions from 0).

    Raises ValueError naming the problem when shapes, tokens or weights do not
    fit. Display the result (last expression of a cell) to show it.
    """
    if isinstance(weights, list | tuple):
        per_sequence = [_as_array(w, "weights") for w in weights]
    else:
        array = _as_array(weights, "weights")
        if array.ndim != 5:
            raise ValueError(
                "weights must have shape (sequences, layers, heads, T_q, T_k)"
                f" or be a list of (layers, heads, T_q, T_k) arrays; got "
                f"shape {array.shape}"
            )
        per_sequence = list(array)
    if not per_sequence:
        raise ValueError("weights hold no sequence")
    shapes = [w.shape for w in per_sequence]
    if any(len(s) != 4 for s in shapes):
        raise ValueError(
            f"each sequence's weights must be (layers, heads, T_q, T_k); got "
            f"shapes {shapes}"
        )
    n_layers, n_heads = shapes[0][:2]
    if any(s[:2] != (n_layers, n_heads) for s in shapes):
        raise ValueError(f"sequences differ in layers or heads: {shapes}")
    if n_layers == 0 or n_heads == 0:
        raise ValueError(f"no layer or no head in shape {shapes[0]}")
    check_precision(precision)
    if type(first_position) is not int or first_position not in (0, 1):
        raise ValueError(f"first_position must be 0 or 1: {first_position!r}")
    if figure is not None and not isinstance(figure, str):
        raise ValueError(f"figure must be a string: {figure!r}")

    n = len(per_sequence)

    def per_sequence_tokens(given, what):
        if given is None:
            return None
        if given and all(isinstance(t, str) for t in given):
            given = [given]
        if len(given) != n:
            raise ValueError(
                f"{what}: {len(given)} lists of tokens for {n} sequences"
            )
        return [_token_list(t, what) for t in given]

    queries = per_sequence_tokens(tokens, "tokens")
    if queries is None:
        raise ValueError("tokens are required")
    keys = per_sequence_tokens(key_tokens, "key_tokens") or queries

    def names(given, count, word):
        if given is None:
            return [f"{word} {i + 1}" for i in range(count)]
        if not hasattr(given, "__iter__"):
            raise ValueError(f"the {word} names must be a list: {given!r}")
        given = [str(g) for g in given]
        if len(given) != count:
            raise ValueError(f"{len(given)} {word} names for {count} {word}s")
        return given

    seq_names = names(sequences, n, "sequence")
    data = {
        "title": str(title),
        "precision": precision,
        "layers": names(layer_names, n_layers, "layer"),
        "heads": names(head_names, n_heads, "head"),
        "sequences": [],
    }
    for s, w in enumerate(per_sequence):
        t_q, t_k = w.shape[2:]
        if (t_q, t_k) != (len(queries[s]), len(keys[s])):
            raise ValueError(
                f"sequence {s + 1}: weights are {t_q} x {t_k} but there are "
                f"{len(queries[s])} query and {len(keys[s])} key tokens"
            )
        if t_q == 0 or t_k == 0:
            raise ValueError(f"sequence {s + 1} is empty")
        if not np.isfinite(w).all():
            raise ValueError(f"sequence {s + 1}: weights hold NaN or inf")
        if w.min() < -1e-6 or w.max() > 1 + 1e-6:
            raise ValueError(
                f"sequence {s + 1}: weights must lie in [0, 1]; found "
                f"{w.min():.3g} to {w.max():.3g}"
            )
        worst = np.abs(w.sum(axis=-1) - 1).max()
        if worst > 1e-3:
            raise ValueError(
                f"sequence {s + 1}: a row of weights sums to 1 +- {worst:.3g}"
                " (expected softmax rows that sum to 1)"
            )
        rounded = np.round(np.clip(w, 0.0, 1.0), precision) + 0.0  # no -0.0
        data["sequences"].append(
            {
                "name": seq_names[s],
                "queries": queries[s],
                "keys": keys[s],
                "weights": [
                    [[[float(x) for x in row] for row in m] for m in layer]
                    for layer in rounded
                ],
            }
        )
    return AttentionExplorer(data, figure, first_position)


def distance_to_tie(weights, precision=PRECISION):
    """The smallest distance from any weight to a rounding tie at `precision`
    decimals (a number whose next decimal is a 5 followed by zeros).

    The page stores the weights rounded: a weight this far from a tie rounds
    to the same digits on a processor whose last bits differ by less. Takes
    an array (or tensor) of any shape, or a list of them.
    """
    if isinstance(weights, list | tuple):
        if not weights:
            raise ValueError("weights hold no array")
        flat = np.concatenate(
            [_as_array(w, "weights").ravel() for w in weights]
        )
    else:
        flat = _as_array(weights, "weights").ravel()
    if flat.size == 0 or not np.isfinite(flat).all():
        raise ValueError("weights are empty or hold NaN or inf")
    check_precision(precision)
    scaled = flat * 10.0**precision
    return float(np.abs(scaled - np.floor(scaled) - 0.5).min()) / 10**precision


_TEMPLATE = """\
<div class="attention-explorer" id="@ID@">
<style>
#@ID@ {margin: 0.5em 0; font-size: 0.95em}
#@ID@ .ae-controls label {margin-right: 1em}
#@ID@ .ae-row {display: flex; flex-wrap: wrap; gap: 0.3em; align-items: center;
  margin: 0.3em 0}
#@ID@ .ae-row > b {min-width: 7.5em}
#@ID@ .ae-token {font: inherit; padding: 0.1em 0.4em; border-radius: 0.25em;
  border: 1px solid rgba(128, 128, 128, 0.6); color: inherit;
  background: transparent; cursor: pointer}
#@ID@ .ae-token.ae-selected {outline: 2px solid #d62728}
#@ID@ .ae-key {padding: 0.1em 0.4em; border-radius: 0.25em;
  border: 1px solid rgba(128, 128, 128, 0.3); text-align: center}
#@ID@ .ae-key small {display: block; font-size: 0.75em}
@media print {#@ID@ {display: none}}
</style>
<p class="ae-title"><b>@TITLE@</b> (interactive: hover over or click a
query token; the chapter's static figure shows @FIGURE@)</p>
<script type="application/json" class="attention-explorer-data">@DATA@</script>
<div class="ae-controls"></div>
<div class="ae-row ae-queries"></div>
<div class="ae-row ae-keys"></div>
<div class="ae-plot"></div>
<p class="ae-status" aria-live="polite"></p>
<noscript>The explorer needs JavaScript; the static figure shows @FIG_NS@.</noscript>
</div>
<script>@SCRIPT@</script>
"""

# The explorer's behaviour. Plain DOM code for the menus and the token
# shading; plotly.js (window.Plotly, shipped with the site) for the charts.
_SCRIPT = r"""
(function () {
  "use strict";
  var root = document.getElementById("@ID@");
  if (!root || root.dataset.ready) { return; }
  root.dataset.ready = "1";
  var data = JSON.parse(
    root.querySelector(".attention-explorer-data").textContent);
  var state = {s: 0, l: 0, h: 0, q: 0};
  var fmt = function (x) { return x.toFixed(data.precision); };

  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) { e.className = cls; }
    if (text !== undefined) { e.textContent = text; }
    return e;
  }
  function menu(name, options, key) {
    if (options.length < 2) { return; }
    var label = el("label", "", name + " ");
    var select = el("select", "ae-" + name);
    options.forEach(function (o, i) {
      var opt = el("option", "", o);
      opt.value = String(i);
      select.appendChild(opt);
    });
    select.addEventListener("change", function () {
      state[key] = Number(select.value);
      if (key === "s") { state.q = 0; drawTokens(); }
      update();
    });
    label.appendChild(select);
    root.querySelector(".ae-controls").appendChild(label);
  }
  function seq() { return data.sequences[state.s]; }
  function matrix() { return seq().weights[state.l][state.h]; }

  function drawTokens() {
    var qs = root.querySelector(".ae-queries");
    var ks = root.querySelector(".ae-keys");
    qs.textContent = ""; ks.textContent = "";
    qs.appendChild(el("b", "", "query token:"));
    ks.appendChild(el("b", "", "weights it gives:"));
    seq().queries.forEach(function (t, i) {
      var b = el("button", "ae-token", t);
      b.type = "button";
      b.dataset.index = String(i);
      b.addEventListener("mouseenter", function () { select(i); });
      b.addEventListener("focus", function () { select(i); });
      b.addEventListener("click", function () { select(i); });
      qs.appendChild(b);
    });
    seq().keys.forEach(function (t, j) {
      var k = el("span", "ae-key", t);
      k.dataset.index = String(j);
      k.appendChild(el("small", "ae-weight"));
      ks.appendChild(k);
    });
  }
  function select(i) {
    if (i === state.q) { return; }
    state.q = i;
    update();
  }

  function update() {
    var row = matrix()[state.q];
    root.dataset.sequence = String(state.s);
    root.dataset.layer = String(state.l);
    root.dataset.head = String(state.h);
    root.dataset.query = String(state.q);
    root.querySelectorAll(".ae-token").forEach(function (b, i) {
      b.classList.toggle("ae-selected", i === state.q);
      b.setAttribute("aria-pressed", i === state.q ? "true" : "false");
    });
    root.querySelectorAll(".ae-key").forEach(function (k, j) {
      k.dataset.weight = String(row[j]);
      k.style.background = "rgba(31, 119, 180, " + row[j] + ")";
      k.querySelector(".ae-weight").textContent = fmt(row[j]);
    });
    var where = [];
    if (data.sequences.length > 1) { where.push(seq().name); }
    if (data.layers.length > 1) { where.push(data.layers[state.l]); }
    if (data.heads.length > 1) { where.push(data.heads[state.h]); }
    where.push("query \u201c" + seq().queries[state.q] + "\u201d (position "
               + (state.q + @FIRST@) + ")");
    root.querySelector(".ae-status").textContent = where.join(", ");
    plot(row);
  }

  function plot(row) {
    var div = root.querySelector(".ae-plot");
    if (!window.Plotly) {
      div.textContent = "(The charts need plotly.js, which the book's site "
        + "ships; the token shading above shows the same weights.)";
      return;
    }
    var s = seq(), m = matrix();
    var kx = s.keys.map(function (_, j) { return j; });
    var qy = s.queries.map(function (_, i) { return i; });
    var color = getComputedStyle(root).color;
    var traces = [
      {type: "bar", x: kx, y: row, text: row.map(fmt),
       textposition: "outside", cliponaxis: false, marker: {color: "#1f77b4"},
       hovertemplate: "%{customdata}: %{y}<extra></extra>",
       customdata: s.keys, xaxis: "x", yaxis: "y", name: "weights"},
      {type: "heatmap", z: m, x: kx, y: qy, zmin: 0, zmax: 1,
       colorscale: [[0, "rgba(31, 119, 180, 0)"],
                    [1, "rgba(31, 119, 180, 1)"]],
       showscale: false, xaxis: "x2", yaxis: "y2",
       customdata: m.map(function (r, i) {
         return r.map(function (_, j) {
           return [s.queries[i], s.keys[j]];
         });
       }),
       hovertemplate: "%{customdata[0]} \u2192 %{customdata[1]}: "
         + "%{z}<extra></extra>", name: "matrix"}
    ];
    var ticks = function (labels, angle) {
      return {tickmode: "array", tickvals: labels.map(function (_, i) {
        return i; }), ticktext: labels, tickangle: angle, automargin: true};
    };
    var layout = {
      height: 320 + 6 * Math.min(40, s.queries.length),
      margin: {l: 10, r: 10, t: 30, b: 10},
      paper_bgcolor: "rgba(0,0,0,0)", plot_bgcolor: "rgba(0,0,0,0)",
      font: {color: color}, showlegend: false,
      xaxis: Object.assign({domain: [0, 0.55], title: {text: "key"}},
                           ticks(s.keys, -45)),
      yaxis: {range: [0, 1.15], title: {text: "weight"}, automargin: true,
              gridcolor: "rgba(128,128,128,0.3)"},
      xaxis2: Object.assign({domain: [0.65, 1], title: {text: "key"}},
                            ticks(s.keys, -45)),
      yaxis2: Object.assign({anchor: "x2", autorange: "reversed",
                             showgrid: false,
                             title: {text: "query"}},
                            ticks(s.queries, 0)),
      shapes: [{type: "rect", xref: "x2", yref: "y2", x0: -0.5,
                x1: s.keys.length - 0.5, y0: state.q - 0.5,
                y1: state.q + 0.5, line: {color: "#d62728", width: 2}}],
      annotations: [{text: "weights from \u201c" + s.queries[state.q]
                     + "\u201d", xref: "paper", yref: "paper", x: 0,
                     y: 1.08, showarrow: false, xanchor: "left"}]
    };
    var first = !div.dataset.plotted;
    Plotly.react(div, traces, layout,
                 {displayModeBar: false, responsive: true});
    if (first) {
      div.dataset.plotted = "1";
      var pick = function (ev) {
        var p = ev.points && ev.points[0];
        if (p && p.data.type === "heatmap") { select(Number(p.y)); }
      };
      div.on("plotly_hover", pick);
      div.on("plotly_click", pick);
    }
  }

  menu("sequence", data.sequences.map(function (s) { return s.name; }), "s");
  menu("layer", data.layers, "l");
  menu("head", data.heads, "h");
  drawTokens();
  state.q = 0;
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", update);
  } else {
    update();
  }
})();
"""
