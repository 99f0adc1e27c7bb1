// The run's dashboard: polls /status and /history and draws them as SVG line charts
// (chart.js's draw; no library, nothing fetched from elsewhere: runs offline).
"use strict";

const $ = (id) => document.getElementById(id);

function token() { return $("token").value || localStorage.getItem("diloco-token") || ""; }

function headers() {
  const t = token();
  return t ? { Authorization: "Bearer " + t } : {};
}

function perReplica(sync, index) {
  const replicas = sync.length ? sync[sync.length - 1][index].length : 0;
  return Array.from({ length: replicas }, (_, r) => ({
    name: "replica " + r, points: sync.map((row) => [row[0], row[index][r]]),
  }));
}

function render(status, history) {
  $("state").textContent = `${status.state}: step ${status.step} / ${status.total_steps}`;
  const facts = {
    "outer step": status.outer_step, "outer lr": fmt(status.outer_lr),
    "train loss": fmt(status.train_loss),
    "eval loss": fmt(status.eval_loss), [status.unit + "s/s"]: fmt(status.tokens_per_s),
    [status.unit + "s"]: status.tokens.toLocaleString(),
    "bytes sent per replica": fmt(status.bytes_sent_per_replica),
    "last checkpoint": status.last_checkpoint ?? "-",
    ETA: status.eta_s === null ? "-" : Math.round(status.eta_s) + " s",
    elapsed: Math.round(status.elapsed_s) + " s",
    "pending controls": status.pending_controls.join(", ") || "-",
  };
  for (const [k, v] of Object.entries(status.aux || {})) facts[k] = fmt(v);
  for (const [k, v] of Object.entries(status.eval_metrics || {})) facts["eval " + k] = fmt(v);
  $("facts").innerHTML = "";
  for (const [k, v] of Object.entries(facts)) {
    const d = document.createElement("div");
    d.innerHTML = `<b>${k}</b>`;
    d.appendChild(document.createTextNode(String(v)));
    $("facts").appendChild(d);
  }
  const x = $("by-tokens").checked ? 1 : 0;
  draw($("chart-loss"), [
    { name: "train", points: history.train.map((p) => [p[x], p[2]]) },
    { name: "eval", points: history.eval.map((p) => [p[x], p[2]]) },
  ], "legend-loss");
  const rate = status.unit + "s/s";
  $("throughput-title").textContent = `Throughput (${rate})`;
  $("by-tokens-label").textContent = ` against ${status.unit}s`;
  draw($("chart-throughput"), [{ name: rate, points: history.train.map((p) => [p[0], p[3]]) }]);
  const names = [...new Set((history.metrics || []).flatMap((p) => Object.keys(p[2])))].sort();
  $("metrics-card").hidden = names.length === 0;
  draw($("chart-metrics"), names.map((name) => ({
    name, points: history.metrics.filter((p) => name in p[2]).map((p) => [p[x], p[2][name]]),
  })), "legend-metrics");
  draw($("chart-drift"), perReplica(history.sync, 2), "legend-drift");
  draw($("chart-cosine"), perReplica(history.sync, 3), "legend-cosine");
  const body = $("replicas").querySelector("tbody");
  body.innerHTML = "";
  for (const row of status.replica_state) {
    const tr = document.createElement("tr");
    tr.className = row.status.replace(" ", "-");
    const loss = (status.replica_loss || [])[row.replica];
    for (const v of [row.replica, fmt(loss), fmt(row.drift), fmt(row.cosine), fmt(row.weight),
                     row.status]) {
      const td = document.createElement("td");
      td.textContent = String(v);
      tr.appendChild(td);
    }
    body.appendChild(tr);
  }
  $("config").textContent = JSON.stringify(status.config, null, 1);
  if (status.sweep) renderSweep(status.sweep);
}

function renderSweep(sweep) {
  $("sweep-card").hidden = false;
  const rows = Object.fromEntries(sweep.table.map((row) => [row.run, row]));
  const body = $("sweep").querySelector("tbody");
  body.innerHTML = "";
  for (const run of sweep.runs) {
    const row = rows[run.run] || {};
    const tr = document.createElement("tr");
    tr.className = "sweep-" + run.state;
    for (const v of [run.run, run.state, fmt(run.final_eval_loss), fmt(row.bytes_per_replica),
                     fmt(row.sim_wallclock_s), fmt(row.utilization)]) {
      const td = document.createElement("td");
      td.textContent = String(v);
      tr.appendChild(td);
    }
    body.appendChild(tr);
  }
}

async function refresh() {
  try {
    const [s, h] = await Promise.all(["status", "history"].map((p) => fetch(p, { headers: headers() })));
    if (!s.ok || !h.ok) throw new Error(`HTTP ${s.ok ? h.status : s.status}`);
    render(await s.json(), await h.json());
  } catch (e) {
    $("state").textContent = "not reachable (" + e.message + "); the run may have ended";
  }
}

async function control(action) {
  if (action === "stop" && !confirm("Stop the run at the next call boundary (with a checkpoint)?")) return;
  localStorage.setItem("diloco-token", $("token").value);
  const body = action === "outer_lr" ? JSON.stringify({ value: Number($("outer-lr").value) }) : "{}";
  const r = await fetch("control/" + action, { method: "POST", headers: headers(), body });
  const text = await r.text();
  $("message").textContent = `${action}: HTTP ${r.status} ${text}`;
  refresh();
}

document.querySelectorAll("button[data-action]").forEach((b) =>
  b.addEventListener("click", () => control(b.dataset.action)));
$("by-tokens").addEventListener("change", refresh);
$("token").value = localStorage.getItem("diloco-token") || "";
refresh();
setInterval(refresh, 2000);
