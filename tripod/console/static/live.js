// The Fleet view (nodes, autoscaler, timeline) and the Live charts, both fed by the server's
// sampled series (GET /ui/api/series?since=T, polled once per sampling interval).

import { getJSON } from "./api.js";
import { TimeChart, fmtNum, markEvents } from "./charts.js";

const pct = (v) => (v === null || v === undefined ? "–" : `${(100 * v).toFixed(0)}%`);
const esc = (s) => String(s ?? "").replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);
const clock = (t) => new Date(t * 1000).toLocaleTimeString([], { hour12: false });

export class Series {
  constructor(info) {
    this.info = info;
    this.points = [];
    this.last = null;
  }

  async poll() {
    const since = this.last === null ? "" : `?since=${this.last}`;
    const s = await getJSON(`/ui/api/series${since}`);
    if (s.points.length) {
      this.points.push(...s.points);
      this.last = s.points[s.points.length - 1].t;
      const keep = this.last - this.info.history_s;
      while (this.points.length && this.points[0].t < keep) this.points.shift();
    }
    return s.points.length;
  }

  now() {
    return this.last ?? Date.now() / 1000;
  }
}

export class FleetView {
  constructor(series) {
    this.series = series;
    this.events = [];
    this.nodesChart = new TimeChart(document.getElementById("chart-nodes"), {
      series: [
        { key: "nodes_up", label: "replicas up", color: "#17a398" },
        { key: "nodes_desired", label: "autoscaler target", color: "#8e44ad", dash: true },
      ],
      fmt: (v) => (Number.isInteger(v) ? String(v) : ""),
    });
  }

  async refresh() {
    const f = await getJSON("/ui/api/fleet");
    this.events = f.events;
    const up = f.nodes.filter((n) => n.state === "healthy").length;
    const stats = [
      ["kind", f.kind === "fleet" ? `fleet (${f.policy})` : "single server"],
      ["replicas up", `${up} / ${f.nodes.length}`],
      ["router pending", f.kind === "fleet" ? f.pending : "–"],
      ["router queue", f.kind === "fleet" ? f.queue_depth : "–"],
    ];
    if (f.pd) {
      stats.push(["prefill hand-overs", `${f.pd.ok + f.pd.retried} ok, ${f.pd.fallback} fallback, ${f.pd.skipped} skipped`],
        ["hand-over time", f.pd.ok + f.pd.retried ? `${fmtNum(1000 * f.pd.seconds / (f.pd.ok + f.pd.retried))} ms mean` : "–"]);
    }
    if (f.autoscaler) {
      const a = f.autoscaler;
      stats.push(["autoscaler", `target ${a.desired} (${a.min_replicas}–${a.max_replicas})`],
        ["in flight per replica", `aim ${a.target_inflight}`]);
    }
    document.getElementById("fleet-summary").innerHTML = stats
      .map(([k, v]) => `<div class="stat"><span class="muted small">${esc(k)}</span><b>${esc(v)}</b></div>`).join("");
    const rows = f.nodes.map((n) => {
      const cached = n.cached_share !== null ? pct(n.cached_share)
        : n.estimated_cached_share !== null ? `~${pct(n.estimated_cached_share)} (est.)` : "–";
      const state = n.state !== "down" || n.restart_in_s === null ? n.state
        : n.restart_in_s < 0.5 ? "down (relaunching)" : `down (restart in ${n.restart_in_s.toFixed(0)} s)`;
      return `<tr data-node="${esc(n.name)}" data-state="${esc(n.state)}">
        <td>${esc(n.name)}</td><td><span class="badge ${esc(n.state)}">${esc(state)}</span></td>
        <td>${n.circuit ? `<span class="badge ${n.circuit}">${n.circuit}</span>` : "–"}</td>
        <td class="num">${n.inflight}</td><td class="num">${n.inflight_tokens === null ? "–" : fmtNum(n.inflight_tokens)}</td>
        <td class="num">${n.running} / ${n.waiting}</td><td class="num">${cached}</td>
        <td class="num">${tierHits(n)}</td><td class="num">${handedOver(n)}</td><td class="num">${pct(n.kv_usage)}</td>
        <td class="num">${n.routed ?? "–"}</td><td class="num">${n.failures ?? "–"}</td><td class="num">${n.restarts}</td>
        <td class="num">${n.pid ?? "–"}</td><td class="small">${esc(n.url ?? "")}</td></tr>`;
    });
    document.querySelector("#fleet-table tbody").innerHTML = rows.join("");
    document.getElementById("fleet-events").innerHTML = f.events.slice().reverse().slice(0, 100)
      .map((e) => `<li data-kind="${esc(e.kind)}"><time>${clock(e.t)}</time>${esc(e.text)}</li>`).join("");
    await this.refreshTenants();
  }

  async refreshTenants() {
    const v = await getJSON("/ui/api/tenants");
    const ms = (a, b) => (a === null && b === null ? "–" : `${a === null ? "–" : fmtNum(a)} / ${b === null ? "–" : fmtNum(b)}`);
    const limits = (r) => Object.entries(r).map(([k, n]) => `${esc(k)}: ${n}`).join(", ") || "–";
    document.getElementById("tenants-note").textContent = v.tenants.length
      ? `since the ${v.source === "router" ? "router" : "server"} started (its per-tenant series)`
      : "no tenant has sent a request yet";
    document.querySelector("#tenants-table tbody").innerHTML = v.tenants.map((t) => `<tr data-tenant="${esc(t.name)}">
      <td>${esc(t.name)}</td><td class="num">${t.requests}</td><td class="num">${t.errors}</td>
      <td class="num">${fmtNum(t.prompt_tokens)}</td><td class="num">${fmtNum(t.output_tokens)}</td>
      <td class="num">${ms(t.ttft_p50_ms, t.ttft_p99_ms)}</td><td class="num">${ms(t.tpot_p50_ms, t.tpot_p99_ms)}</td>
      <td class="small">${limits(t.rejections)}</td></tr>`).join("");
  }

  draw() {
    const s = this.series;
    const span = 300;
    this.nodesChart.draw(s.points, s.now(), span, s.info.interval_s);
    markEvents(this.nodesChart.canvas, this.events, s.now(), span);
  }
}

export class LiveView {
  constructor(series) {
    this.series = series;
    const c = (id, opts) => new TimeChart(document.getElementById(id), opts);
    this.charts = {
      tok: c("chart-tok_s", { series: [{ key: "output_tok_s", label: "output tok/s" },
        { key: "prompt_tok_s", label: "prompt tok/s", color: "#9ca3af", dash: true }] }),
      ttft: c("chart-ttft", { series: [{ key: "ttft_p50_ms", label: "p50" }, { key: "ttft_p99_ms", label: "p99", color: "#e4572e" }] }),
      queue: c("chart-queue", { series: [{ key: "queue_depth", label: "queued" }, { key: "running", label: "running", color: "#17a398" }] }),
      kv: c("chart-kv", { series: [{ key: "kv_usage", label: "mean" }, { key: "kv_usage_max", label: "max", color: "#e4572e", dash: true }], scale: 100, fixedMax: 100 }),
      hit: c("chart-hit", { series: [{ key: "prefix_hit_rate", label: "cached / prompt tokens" }], scale: 100, fixedMax: 100 }),
      accept: c("chart-accept", { series: [{ key: "jump_forward_acceptance", label: "jump-forward" },
        { key: "spec_acceptance", label: "speculative", color: "#8e44ad" }], scale: 100, fixedMax: 100 }),
    };
    this.span = document.getElementById("live-span");
    this.span.onchange = () => this.draw();
  }

  draw() {
    const s = this.series;
    const span = Number(this.span.value);
    for (const chart of Object.values(this.charts)) chart.draw(s.points, s.now(), span, s.info.interval_s);
    const anyAccept = s.points.some((p) => p.jump_forward_acceptance !== null || p.spec_acceptance !== null);
    document.getElementById("live-note").textContent = `sampled by the server every ${s.info.interval_s} s; rates and ` +
      `percentiles over the last ${s.info.window_s} s` + (anyAccept ? "" : "; no jump-forward or speculative drafts seen yet");
  }
}

// A node's prompt tokens served from each cache tier (a disk tier: --kv-disk), and its KV hand-overs
// (prefill/decode disaggregation: bytes sent or received, seconds spent).
function tierHits(n) {
  if (n.tier_hits_pool == null && n.tier_hits_disk == null) return "–";
  return `${fmtNum(n.tier_hits_pool ?? 0)} / ${fmtNum(n.tier_hits_disk ?? 0)}`;
}

function handedOver(n) {
  const bytes = n.kv_sent_bytes ?? n.kv_received_bytes;
  if (bytes == null) return n.role && n.role !== "both" ? esc(n.role) : "–";
  const dir = n.kv_sent_bytes != null ? "sent" : "received";
  return `${esc(n.role ?? "")} ${dir} ${fmtNum(bytes / 2 ** 20)} MiB in ${fmtNum(n.kv_transfer_s ?? 0)} s`;
}
