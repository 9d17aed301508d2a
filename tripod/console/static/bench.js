// The Benchmarks view: the runs tripod bench wrote under --bench-dir, their Pareto curves side by
// side, and the history of each setting across dated runs with the server's regression flags.

import { getJSON } from "./api.js";
import { drawXY, fmtNum } from "./charts.js";

const $ = (id) => document.getElementById(id);
const esc = (s) => String(s ?? "").replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);
const pctChange = (c) => `${c >= 0 ? "+" : ""}${(100 * c).toFixed(1)}%`;

export class BenchView {
  constructor() {
    this.index = null;
    this.selected = new Set();
    $("history-key").onchange = () => this.drawHistory();
  }

  async refresh() {
    const idx = await getJSON("/ui/api/bench");
    this.index = idx;
    $("bench-dir").textContent = idx.message ?? `${idx.runs.length} run(s) in ${idx.dir}` +
      (idx.skipped.length ? ` (${idx.skipped.length} skipped: ${idx.skipped.map((s) => `${s.path}: ${s.why}`).join("; ")})` : "");
    if (!this.selected.size) idx.runs.slice(0, 2).forEach((r) => this.selected.add(r.id));
    const flaggedRuns = new Set(idx.history.flatMap((s) => s.points.filter((p) => p.slower).map((p) => p.run)));
    $("bench-runs").querySelector("tbody").innerHTML = idx.runs.map((r) => {
      const best = Math.max(...r.levels.map((l) => l.output_throughput));
      const costs = r.levels.map((l) => l.cost_per_million_output_tokens).filter((c) => c !== null);
      const datasets = [...new Set(r.levels.map((l) => l.dataset))].join(", ");
      return `<tr data-run="${esc(r.id)}" class="${flaggedRuns.has(r.id) ? "flagged" : ""}">
        <td><input type="checkbox" ${this.selected.has(r.id) ? "checked" : ""}></td>
        <td>${esc(r.started_text)}</td><td>${esc(r.id)}${flaggedRuns.has(r.id) ? ' <span class="badge down">slower</span>' : ""}</td>
        <td>${esc(r.targets.join(", "))}</td><td>${esc(datasets)}</td><td class="num">${r.levels.length}</td>
        <td class="num">${fmtNum(best)}</td><td class="num">${costs.length ? "$" + fmtNum(Math.min(...costs)) : "–"}</td></tr>`;
    }).join("");
    for (const tr of $("bench-runs").querySelectorAll("tr[data-run]")) {
      tr.querySelector("input").onchange = (ev) => {
        if (ev.target.checked) this.selected.add(tr.dataset.run); else this.selected.delete(tr.dataset.run);
        this.drawPareto();
      };
    }
    const keys = idx.history.map((s, i) => [i, s]);
    // Show first a setting that was flagged, else one measured more than once.
    keys.sort(([, a], [, b]) => (b.points.some((p) => p.slower) - a.points.some((p) => p.slower)) || (b.points.length - a.points.length));
    const before = $("history-key").value;
    $("history-key").innerHTML = keys.map(([i, s]) => `<option value="${i}">${esc(s.label)} (${s.points.length} runs)</option>`).join("");
    if (before && idx.history[before]) $("history-key").value = before;
    $("history-how").textContent = "A run is flagged slower when its output tok/s fell below the previous run's at the " +
      "same settings by more than 2·√(a² + b²), a and b each run's relative noise (its per-request spread: " +
      "standard error of the mean decode rate; at least 2%).";
    this.drawPareto();
    this.drawHistory();
  }

  drawPareto() {
    const box = $("bench-pareto");
    const runs = this.index.runs.filter((r) => this.selected.has(r.id));
    box.innerHTML = runs.map((r) => `<figure><figcaption>${esc(r.started_text)} · ${esc(r.id)}</figcaption>` +
      `<canvas data-run="${esc(r.id)}"></canvas></figure>`).join("");
    // One scale for all of them, so side by side means comparable.
    const levels = runs.flatMap((r) => r.levels);
    const xMax = Math.max(0, ...levels.map((l) => l.interactivity ?? 0));
    const yMax = Math.max(0, ...levels.map((l) => l.output_throughput_per_machine));
    runs.forEach((r) => {
      const byTarget = new Map();
      for (const l of r.levels) {
        if (!byTarget.has(l.target)) byTarget.set(l.target, []);
        byTarget.get(l.target).push(l);
      }
      const curves = [...byTarget].map(([target, ls]) => ({
        label: target,
        points: ls.slice().sort((a, b) => (a.concurrency ?? a.request_rate ?? 0) - (b.concurrency ?? b.request_rate ?? 0))
          .map((l) => ({ x: l.interactivity, y: l.output_throughput_per_machine,
            tag: l.concurrency !== null ? `C=${l.concurrency}` : l.request_rate !== null ? `${l.request_rate}/s` : l.mode })),
      }));
      drawXY(box.querySelector(`canvas[data-run="${CSS.escape(r.id)}"]`), {
        curves, xMax, yMax, xLabel: "tok/s per user", yLabel: `output tok/s per machine${r.machines > 1 ? ` (${r.machines} machines)` : ""}`,
      });
    });
  }

  drawHistory() {
    const s = this.index.history[Number($("history-key").value)];
    const tput = $("chart-history-tput"), ttft = $("chart-history-ttft");
    if (!s) {
      $("history-flags").innerHTML = "<li>no runs yet</li>";
      return;
    }
    const ticks = s.points.map((p, i) => ({ x: i, label: new Date(p.started * 1000).toLocaleDateString([], { month: "short", day: "numeric" }) }));
    drawXY(tput, { curves: [{ label: "output tok/s", points: s.points.map((p, i) => ({ x: i, y: p.output_throughput, flag: p.slower })) }],
      xLabel: "run (date)", yLabel: "tok/s", xTicks: ticks });
    drawXY(ttft, { curves: [{ label: "TTFT p50", color: "#e4572e", points: s.points.map((p, i) => ({ x: i, y: p.ttft_p50_ms ?? NaN, flag: p.ttft_worse })) }],
      xLabel: "run (date)", yLabel: "ms", xTicks: ticks });
    const lines = [];
    for (const series of this.index.history) {
      for (const p of series.points) {
        if (p.slower) {
          lines.push(`<li class="flag" data-run="${esc(p.run)}">${esc(p.run)} is ${pctChange(p.change)} in output tok/s vs ` +
            `${esc(p.previous)} at ${esc(series.label)} (the noise of both allows −${(100 * p.threshold).toFixed(1)}%)</li>`);
        }
        if (p.ttft_worse) {
          lines.push(`<li class="flag ttft" data-run="${esc(p.run)}">${esc(p.run)}: TTFT p50 ${pctChange(p.ttft_change)} vs ` +
            `${esc(p.previous)} at ${esc(series.label)}</li>`);
        }
      }
    }
    $("history-flags").innerHTML = lines.join("") ||
      `<li>no run is slower than the one before it beyond their noise (${this.index.history.length} setting(s))</li>`;
  }
}
