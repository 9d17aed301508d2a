// Small canvas charts for the console (no library): time series, and x/y curves (Pareto, history).
// Each chart writes what it drew into its canvas' data attributes (points, last, max, flagged), so
// a test or a curious user can read the numbers behind the pixels.

export const PALETTE = ["#2f6fdf", "#e4572e", "#17a398", "#f3a712", "#8e44ad", "#5d6d7e", "#c0392b", "#27ae60"];

function setup(canvas) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || 400, h = canvas.clientHeight || 200;
  if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
    canvas.width = Math.round(w * dpr);
    canvas.height = Math.round(h * dpr);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  ctx.font = "11px system-ui, sans-serif";
  return { ctx, w, h };
}

// A "nice" upper bound for an axis: 1, 2, 2.5 or 5 times a power of ten.
export function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

export function fmtNum(v, digits = 3) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  const a = Math.abs(v);
  if (a >= 1000) return Math.round(v).toLocaleString("en-US");
  if (a >= 100) return v.toFixed(0);
  return Number(v.toPrecision(digits)).toString();
}

function yAxis(ctx, box, max, fmt) {
  ctx.strokeStyle = "#e3e6ea";
  ctx.fillStyle = "#6b7280";
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (let i = 0; i <= 4; i++) {
    const y = box.y + box.h - (box.h * i) / 4;
    ctx.beginPath();
    ctx.moveTo(box.x, y);
    ctx.lineTo(box.x + box.w, y);
    ctx.stroke();
    ctx.fillText(fmt((max * i) / 4), box.x - 4, y);
  }
}

function legend(ctx, items, x, y) {
  ctx.textAlign = "left";
  ctx.textBaseline = "middle";
  for (const it of items) {
    ctx.fillStyle = it.color;
    ctx.fillRect(x, y - 4, 10, 8);
    ctx.fillStyle = "#374151";
    ctx.fillText(it.label, x + 14, y);
    x += 20 + ctx.measureText(it.label).width;
  }
}

// A time-series chart of the last `span` seconds. series: [{key, label, color, dash}], points: the
// server's SeriesPoint objects (t in Unix seconds); `scale` multiplies values (e.g. 100 for %).
export class TimeChart {
  constructor(canvas, { series, fmt = fmtNum, scale = 1, fixedMax = null, gap = 3 }) {
    Object.assign(this, { canvas, series, fmt, scale, fixedMax, gap });
  }

  draw(points, now, span, interval) {
    const { ctx, w, h } = setup(this.canvas);
    const box = { x: 44, y: 18, w: w - 54, h: h - 36 };
    const t0 = now - span;
    const visible = points.filter((p) => p.t >= t0);
    let max = 0, count = 0, last = null;
    for (const s of this.series) {
      for (const p of visible) {
        const v = p[s.key];
        if (v !== null && v !== undefined) max = Math.max(max, v * this.scale);
      }
    }
    max = this.fixedMax ?? niceMax(max);
    yAxis(ctx, box, max, this.fmt);
    // time labels: minutes (or seconds) before now
    ctx.fillStyle = "#6b7280";
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    const step = span > 240 ? 60 : span > 90 ? 30 : 10;
    for (let s = 0; s <= span; s += step) {
      const x = box.x + box.w - (box.w * s) / span;
      ctx.fillText(s === 0 ? "now" : s >= 60 ? `-${s / 60}m` : `-${s}s`, x, box.y + box.h + 4);
    }
    const X = (t) => box.x + ((t - t0) / span) * box.w;
    const Y = (v) => box.y + box.h - (Math.min(v, max) / max) * box.h;
    this.series.forEach((s, i) => {
      ctx.strokeStyle = s.color || PALETTE[i % PALETTE.length];
      ctx.lineWidth = 1.6;
      ctx.setLineDash(s.dash ? [4, 3] : []);
      ctx.beginPath();
      let prev = null;
      for (const p of visible) {
        const v = p[s.key];
        if (v === null || v === undefined) { prev = null; continue; }
        const x = X(p.t), y = Y(v * this.scale);
        if (prev === null || p.t - prev > this.gap * interval) ctx.moveTo(x, y); else ctx.lineTo(x, y);
        prev = p.t;
        if (i === 0) { count++; last = v * this.scale; }
      }
      ctx.stroke();
    });
    ctx.setLineDash([]);
    const shown = this.series.map((s, i) => ({ label: s.label, color: s.color || PALETTE[i % PALETTE.length],
      has: visible.some((p) => p[s.key] !== null && p[s.key] !== undefined) }));
    legend(ctx, shown.some((s) => s.has) ? shown.filter((s) => s.has) : shown, box.x, 8);
    const d = this.canvas.dataset;
    d.points = String(count);
    d.last = last === null ? "" : String(last);
    const firsts = visible.map((p) => p[this.series[0].key]).filter((v) => v !== null && v !== undefined);
    d.max = firsts.length ? String(Math.max(...firsts) * this.scale) : "";
    d.min = firsts.length ? String(Math.min(...firsts) * this.scale) : "";
    return count;
  }
}

// Vertical markers on a time chart (fleet events), drawn over what is there.
export function markEvents(canvas, events, now, span) {
  const ctx = canvas.getContext("2d");
  const w = canvas.clientWidth, h = canvas.clientHeight;
  const box = { x: 44, y: 18, w: w - 54, h: h - 36 };
  for (const e of events) {
    if (e.t < now - span) continue;
    const x = box.x + ((e.t - (now - span)) / span) * box.w;
    ctx.strokeStyle = e.kind === "scale" ? "#8e44ad" : /→ (down|unhealthy|dead)/.test(e.text) ? "#c0392b" : "#9ca3af";
    ctx.setLineDash([2, 2]);
    ctx.beginPath();
    ctx.moveTo(x, box.y);
    ctx.lineTo(x, box.y + box.h);
    ctx.stroke();
  }
  ctx.setLineDash([]);
}

// An x/y chart: curves [{label, color, points: [{x, y, tag, flag}]}]; xTicks: optional
// [{x, label}] for a categorical x axis (dates); xMax/yMax: share axes between charts. Flagged
// points are drawn as red rings.
export function drawXY(canvas, { curves, xLabel, yLabel, xTicks = null, fmt = fmtNum, xMax = null, yMax = null }) {
  const { ctx, w, h } = setup(canvas);
  const box = { x: 48, y: 20, w: w - 60, h: h - 54 };
  const all = curves.flatMap((c) => c.points).filter((p) => Number.isFinite(p.x) && Number.isFinite(p.y));
  const xs = all.map((p) => p.x);
  const xmin = xTicks ? Math.min(...xs) - 0.5 : 0;
  const xmax = xTicks ? Math.max(...xs) + 0.5 : niceMax(Math.max(1e-9, xMax ?? 0, ...xs));
  const ymax = niceMax(Math.max(1e-9, yMax ?? 0, ...all.map((p) => p.y)));
  yAxis(ctx, box, ymax, fmt);
  const X = (x) => box.x + ((x - xmin) / (xmax - xmin || 1)) * box.w;
  const Y = (y) => box.y + box.h - (y / ymax) * box.h;
  ctx.fillStyle = "#6b7280";
  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  if (xTicks) {
    for (const t of xTicks) ctx.fillText(t.label, X(t.x), box.y + box.h + 4);
  } else {
    for (let i = 0; i <= 4; i++) ctx.fillText(fmt((xmax * i) / 4), X((xmax * i) / 4), box.y + box.h + 4);
  }
  ctx.fillText(xLabel, box.x + box.w / 2, h - 14);
  ctx.save();
  ctx.translate(10, box.y + box.h / 2);
  ctx.rotate(-Math.PI / 2);
  ctx.fillText(yLabel, 0, -4);
  ctx.restore();
  let flagged = 0;
  curves.forEach((c, i) => {
    const color = c.color || PALETTE[i % PALETTE.length];
    const pts = c.points.filter((p) => Number.isFinite(p.x) && Number.isFinite(p.y));
    ctx.strokeStyle = color;
    ctx.fillStyle = color;
    ctx.lineWidth = 1.6;
    ctx.beginPath();
    pts.forEach((p, j) => (j ? ctx.lineTo(X(p.x), Y(p.y)) : ctx.moveTo(X(p.x), Y(p.y))));
    ctx.stroke();
    ctx.textAlign = "left";
    ctx.textBaseline = "bottom";
    for (const p of pts) {
      ctx.fillStyle = color;
      ctx.beginPath();
      ctx.arc(X(p.x), Y(p.y), 3, 0, 2 * Math.PI);
      ctx.fill();
      if (p.tag) { ctx.fillStyle = "#6b7280"; ctx.fillText(p.tag, X(p.x) + 4, Y(p.y) - 2); }
      if (p.flag) {
        flagged++;
        ctx.strokeStyle = "#c0392b";
        ctx.lineWidth = 2;
        ctx.beginPath();
        ctx.arc(X(p.x), Y(p.y), 7, 0, 2 * Math.PI);
        ctx.stroke();
        ctx.strokeStyle = color;
        ctx.lineWidth = 1.6;
      }
    }
  });
  legend(ctx, curves.map((c, i) => ({ label: c.label, color: c.color || PALETTE[i % PALETTE.length] })), box.x, 8);
  canvas.dataset.points = String(all.length);
  canvas.dataset.flagged = String(flagged);
}
