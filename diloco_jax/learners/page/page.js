// The syncer's status page: its summary (rendered by the syncer, /summary) and charts over the
// last rounds (/history: each round's learners' losses, wait and bytes), every 2 s, drawn by
// the run dashboard's chart.js. A session that has ended sends the browser to sign in again.
"use strict";

const $ = (id) => document.getElementById(id);

// history.rounds: [{round, waited, bytes_in, bytes_out, learners, late, losses: {I: loss}}]
function render(rounds) {
  const learners = [...new Set(rounds.flatMap((r) => Object.keys(r.losses)))];
  learners.sort((a, b) => Number(a) - Number(b));
  draw($("chart-loss"), learners.map((i) => ({
    name: "learner " + i,
    points: rounds.filter((r) => i in r.losses).map((r) => [r.round, r.losses[i]]),
  })), "legend-loss");
  draw($("chart-wait"), [{ name: "seconds", points: rounds.map((r) => [r.round, r.waited]) }]);
  draw($("chart-bytes"), [
    { name: "in", points: rounds.map((r) => [r.round, r.bytes_in]) },
    { name: "out", points: rounds.map((r) => [r.round, r.bytes_out]) },
  ], "legend-bytes");
}

async function refresh() {
  try {
    const [s, h] = await Promise.all(["summary", "history"].map((p) => fetch(p)));
    if (s.status === 401 || h.status === 401) {
      location.replace("login");
      return;
    }
    if (!s.ok || !h.ok) throw new Error(`HTTP ${s.ok ? h.status : s.status}`);
    $("summary").innerHTML = await s.text();  // the syncer's own HTML, its values escaped
    render((await h.json()).rounds);
    $("state").textContent = "";
  } catch (e) {
    $("state").textContent = "not reachable (" + e.message + "); the syncer may have ended";
  }
}

refresh();
setInterval(refresh, 2000);
