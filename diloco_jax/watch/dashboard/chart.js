// Line charts as SVG, shared by the run's dashboard (dashboard.js) and the syncer's status page
// (diloco_jax/learners/page/page.js): no library, nothing fetched from elsewhere, no inline
// style (the syncer's page forbids it). Loaded first, as a plain script: its names are global.
"use strict";

const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b",
                "#e377c2", "#7f7f7f", "#bcbd22"];
const SVG = "http://www.w3.org/2000/svg";

function el(name, attrs, parent) {
  const node = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  parent.appendChild(node);
  return node;
}

function fmt(v) {
  if (v === null || v === undefined || Number.isNaN(v)) return "-";
  const a = Math.abs(v);
  if (a >= 1e9 || (a !== 0 && a < 1e-3)) return v.toExponential(2);
  if (a >= 1000) return Math.round(v).toLocaleString("en-US");
  return Number(v.toPrecision(4)).toString();
}

// A log axis for values that are all positive and span more than a decade (a loss from step
// 0 on: on a linear one its first points set the scale and the end is a flat line); the same
// rule as the run's figures (diloco_jax/watch/drawing.py: log_scale).
function logScale(values) {
  const low = Math.min(...values);
  return values.length > 0 && low > 0 && Math.max(...values) > 10 * low;
}

// series: [{name, points: [[x, y], ...]}]; one polyline each, with data-series and data-n; the
// svg's data-scale says whether the y axis is "log" or "linear"
function draw(svg, series, legendId) {
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const w = svg.clientWidth || 440, h = svg.clientHeight || 220, m = { l: 60, r: 8, t: 8, b: 20 };
  const all = series.flatMap((s) => s.points).filter((p) => Number.isFinite(p[1]));
  if (!all.length) {
    el("text", { x: w / 2, y: h / 2, "text-anchor": "middle" }, svg).textContent = "no data yet";
    return;
  }
  const log = logScale(all.map((p) => p[1]));
  svg.setAttribute("data-scale", log ? "log" : "linear");
  const ty = log ? Math.log10 : (y) => y;
  let [x0, x1] = [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
  let [y0, y1] = [Math.min(...all.map((p) => p[1])), Math.max(...all.map((p) => p[1]))];
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
  const sx = (x) => m.l + ((x - x0) / (x1 - x0)) * (w - m.l - m.r);
  const sy = (y) => h - m.b - ((ty(y) - ty(y0)) / (ty(y1) - ty(y0))) * (h - m.t - m.b);
  el("line", { x1: m.l, y1: h - m.b, x2: w - m.r, y2: h - m.b, stroke: "#999" }, svg);
  el("line", { x1: m.l, y1: m.t, x2: m.l, y2: h - m.b, stroke: "#999" }, svg);
  const ticks = [[y1, m.t + 8], [y0, h - m.b]];
  if (log) {  // each power of ten between, as a faint grid line
    for (let e = Math.ceil(Math.log10(y0)); e <= Math.floor(Math.log10(y1)); e++) {
      const y = sy(10 ** e);
      el("line", { x1: m.l, y1: y, x2: w - m.r, y2: y, stroke: "#eee" }, svg);
      if (y > m.t + 16 && y < h - m.b - 12) ticks.push([10 ** e, y + 4]);
    }
    const middle = { x: (m.l + w - m.r) / 2, y: h - 4, "text-anchor": "middle" };
    el("text", middle, svg).textContent = "y: log scale";
  }
  for (const [v, y] of ticks) {
    el("text", { x: m.l - 4, y, "text-anchor": "end" }, svg).textContent = fmt(v);
  }
  el("text", { x: m.l, y: h - 4 }, svg).textContent = fmt(x0);
  el("text", { x: w - m.r, y: h - 4, "text-anchor": "end" }, svg).textContent = fmt(x1);
  const legend = legendId ? document.getElementById(legendId) : null;
  if (legend) legend.innerHTML = "";
  series.forEach((s, i) => {
    const color = COLORS[i % COLORS.length];
    const pts = s.points.filter((p) => Number.isFinite(p[1]));
    el("polyline", {
      points: pts.map((p) => sx(p[0]).toFixed(1) + "," + sy(p[1]).toFixed(1)).join(" "),
      fill: "none", stroke: color, "stroke-width": 1.5, "data-series": s.name,
      "data-n": pts.length,
    }, svg);
    if (legend) {
      const span = document.createElement("span");
      span.style.color = color;
      span.textContent = s.name;
      legend.appendChild(span);
    }
  });
}
