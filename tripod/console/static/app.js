// The console page: tabs (#fleet, #live, #playground, #bench), and the polling loops that feed them.

import { getJSON } from "./api.js";
import { BenchView } from "./bench.js";
import { FleetView, LiveView, Series } from "./live.js";
import { Playground } from "./playground.js";

const TABS = ["fleet", "live", "playground", "bench"];

function status(text) {
  document.getElementById("status").textContent = text;
}

async function main() {
  const info = await getJSON("/ui/api/info");
  document.getElementById("whoami").textContent = `${info.kind === "fleet" ? "fleet" : "server"}` +
    `${info.model ? " · " + info.model : ""} · tripod ${info.version}`;
  const series = new Series(info);
  const fleet = new FleetView(series);
  const live = new LiveView(series);
  const playground = new Playground();
  const bench = new BenchView();
  let tab = "fleet";

  const show = async () => {
    tab = TABS.includes(location.hash.slice(1)) ? location.hash.slice(1) : "fleet";
    for (const t of TABS) {
      document.getElementById(`view-${t}`).hidden = t !== tab;
      document.querySelector(`nav a[data-tab="${t}"]`).classList.toggle("active", t === tab);
    }
    try {
      if (tab === "playground") await playground.load();
      if (tab === "bench") await bench.refresh();
      if (tab === "fleet") { await fleet.refresh(); fleet.draw(); }
      if (tab === "live") live.draw();
    } catch (e) {
      status(String(e.message || e));
    }
  };
  window.addEventListener("hashchange", show);
  window.addEventListener("resize", () => { fleet.draw(); live.draw(); });

  // One loop: the sampled series (for the fleet timeline and the live charts) and, on the fleet
  // tab, the nodes; once per the server's sampling interval.
  const loop = async () => {
    try {
      await series.poll();
      if (tab === "fleet") { await fleet.refresh(); fleet.draw(); }
      if (tab === "live") live.draw();
      status(`updated ${new Date().toLocaleTimeString([], { hour12: false })}`);
    } catch (e) {
      status(`cannot reach the server: ${e.message || e}`);
    }
    setTimeout(loop, info.interval_s * 1000);
  };
  await series.poll().catch(() => {});
  await show();
  loop();
  document.body.dataset.ready = "1";
}

main().catch((e) => status(String(e.message || e)));
