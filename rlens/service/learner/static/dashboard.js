// rlens live dashboard: polls /api/dashboard and draws SVG charts. No libraries, no network beyond the learner.
"use strict";

const COLORS = ["#2563eb", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#be123c", "#4d7c0f", "#a16207"];
const DRIFT_COLORS = { outcome: "#dc2626", confidence: "#7c3aed", model: "#f59e0b" };
const PAD = { l: 34, r: 8, t: 8, b: 20 };

const pct = (x) => (x === null || x === undefined ? "–" : (100 * x).toFixed(1) + " %");
const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));

// One chart: x = the stream's join count, lines [{name, color, values}], y in [ymin, ymax], vertical markers.
function chart(xs, lines, ymin, ymax, markers, yFormat, W = 540, H = 150) {
  const x0 = xs.length ? xs[0] : 0, x1 = xs.length ? Math.max(xs[xs.length - 1], x0 + 1) : 1;
  const sx = (x) => PAD.l + ((x - x0) / (x1 - x0)) * (W - PAD.l - PAD.r);
  const sy = (y) => PAD.t + (1 - (y - ymin) / (ymax - ymin || 1)) * (H - PAD.t - PAD.b);
  let svg = `<svg viewBox="0 0 ${W} ${H}" role="img">`;
  for (const f of [0, 0.5, 1]) {
    const y = ymin + f * (ymax - ymin);
    svg += `<line x1="${PAD.l}" x2="${W - PAD.r}" y1="${sy(y)}" y2="${sy(y)}" stroke="#e5e7eb"/>`;
    svg += `<text x="${PAD.l - 4}" y="${sy(y) + 4}" font-size="10" text-anchor="end" fill="#6b7280">${yFormat(y)}</text>`;
  }
  svg += `<text x="${PAD.l}" y="${H - 4}" font-size="10" fill="#6b7280">${x0}</text>`;
  svg += `<text x="${W - PAD.r}" y="${H - 4}" font-size="10" text-anchor="end" fill="#6b7280">${x1} joined</text>`;
  for (const m of markers) {
    if (m.n < x0 || m.n > x1) continue;
    svg += `<line class="drift-marker" x1="${sx(m.n)}" x2="${sx(m.n)}" y1="${PAD.t}" y2="${H - PAD.b}" stroke="${m.color}" stroke-width="1.5" stroke-dasharray="4 2"><title>${esc(m.title)}</title></line>`;
  }
  for (const line of lines) {
    const pts = xs.map((x, i) => [x, line.values[i]]).filter(([, y]) => y !== null && y !== undefined);
    if (!pts.length) continue;
    const d = pts.map(([x, y], i) => `${i ? "L" : "M"}${sx(x).toFixed(1)},${sy(y).toFixed(1)}`).join("");
    svg += `<path d="${d}" fill="none" stroke="${line.color}" stroke-width="${line.width || 1.6}"><title>${esc(line.name)}</title></path>`;
  }
  return svg + "</svg>";
}

function legend(items) {
  return `<div class="legend">${items.map(([name, color]) => `<span><i style="background:${color}"></i>${esc(name)}</span>`).join("")}</div>`;
}

function driftMarkers(drift) {
  return drift.map((d) => {
    const kind = d.signal.startsWith("model:") ? "model" : d.signal;
    const before = d.before === null ? "?" : pct(d.before);
    return { n: d.n, color: DRIFT_COLORS[kind] || "#dc2626", title: `drift on ${d.signal} at ${d.n}: ${before} → ${pct(d.after)}` };
  });
}

function streamCard(s, data) {
  const xs = s.points.map((p) => p.n);
  const models = data.models;
  const share = data.strategy === "rlae" ? "mean weight" : "in the Decider's pool";
  const outcome = chart(xs, [
    { name: "accuracy (last 50)", color: "#2563eb", values: s.points.map((p) => p.accuracy), width: 2.2 },
    { name: "confidence (label-free)", color: "#16a34a", values: s.points.map((p) => p.confidence) },
  ], 0, 1, driftMarkers(s.drift), (y) => (100 * y).toFixed(0) + "%");
  const composition = chart(xs, models.map((m, i) => ({ name: m, color: COLORS[i % COLORS.length], values: s.points.map((p) => (p.composition.length ? p.composition[i] : null)) })),
    0, 1, [], (y) => y.toFixed(1));
  const now = s.now;
  const rows = models.map((m, i) => `<tr><td><i style="display:inline-block;width:8px;height:8px;background:${COLORS[i % COLORS.length]}"></i> ${esc(m)}</td>` +
    `<td>${now.composition.length ? now.composition[i].toFixed(2) : "–"}</td><td>${pct(now.model_accuracy[i])}</td></tr>`).join("");
  const delay = now.delay_s === null ? "–" : now.delay_s < 1 ? (1000 * now.delay_s).toFixed(0) + " ms" : now.delay_s.toFixed(1) + " s";
  return `<section class="card" data-stream="${esc(s.stream)}">
    <h2><span>${esc(s.stream)}</span><small>${s.joins} joined · accuracy <b class="accuracy">${pct(now.accuracy)}</b> · feedback delay ${delay} · ${s.drift.length} drift event${s.drift.length === 1 ? "" : "s"}</small></h2>
    ${legend([["accuracy (last 50)", "#2563eb"], ["confidence", "#16a34a"], ["drift: outcome", DRIFT_COLORS.outcome], ["drift: a model", DRIFT_COLORS.model], ["drift: confidence", DRIFT_COLORS.confidence]])}
    ${outcome}
    <div class="legend">each model's part (${share}), last 50 answers</div>
    ${composition}
    <table><tr><th>model</th><th>${share}</th><th>accuracy when called</th></tr>${rows}</table>
  </section>`;
}

// The version in use against the transitions joined: a step at each new policy, held up to the latest join.
function policyCard(data) {
  const ps = data.policies;
  if (!ps.length) return "";
  const steps = [];
  ps.forEach((p, i) => {
    if (i) steps.push([p.joined, ps[i - 1].version]);
    steps.push([p.joined, p.version]);
  });
  steps.push([Math.max(data.joined, ps[ps.length - 1].joined), ps[ps.length - 1].version]);
  const top = Math.max(...ps.map((p) => p.version));
  const label = (y) => (Number.isInteger(y) ? "v" + y : "");
  const svg = chart(steps.map(([x]) => x), [{ name: "policy version", color: "#2563eb", values: steps.map(([, v]) => v), width: 2 }], 0, Math.max(top, 1), [], label, 1120, 110);
  return `<section class="card wide" id="policies"><h2><span>Policy versions</span><small>by transitions joined; newest v${top}</small></h2>${svg}</section>`;
}

// Gated promotion: what is served, the candidate's evidence with candidate − champion so far, and the verdicts.
const KIND_NOTES = {
  probation: " (the replaced champion, on probation)",
  line: " (holdback: the learner's newest, serving at once, judged against the champion)",
};
function gateCard(data) {
  const g = data.gate;
  if (!g && !data.verdicts.length) return "";
  const num = (x) => (x >= 0 ? "+" : "") + x.toFixed(3);
  const shown = (e) => `${num(e.value)} [${num(e.low)}, ${num(e.high)}]`;
  const now = g && g.candidate !== null
    ? `candidate <b>v${g.candidate}</b>${KIND_NOTES[g.kind] || ""}: ${g.events} queries of evidence` +
      (g.estimate ? `, reward − champion's ${shown(g.estimate)}` : "")
    : "no candidate being judged";
  const rows = data.verdicts.slice(-10).reverse().map((v) =>
    `<tr class="verdict ${v.verdict.replace(" ", "-")}"><td>${new Date(v.t * 1000).toLocaleTimeString()}</td><td>v${v.version}</td><td>${esc(v.verdict)}</td><td>${shown(v)} over ${v.n}</td></tr>`).join("");
  return `<section class="card wide" id="gate"><h2><span>Promotion gate</span><small>champion v${g && g.champion !== null ? g.champion : "0"} · ${now}</small></h2>
    <table><tr><th>when</th><th>policy</th><th>verdict</th><th>reward − champion's [95 % interval]</th></tr>${rows}</table></section>`;
}

async function refresh() {
  try {
    const response = await fetch("/api/dashboard", { cache: "no-store" });
    const data = await response.json();
    document.getElementById("strategy").textContent = data.strategy;
    document.getElementById("joined").textContent = data.joined;
    const served = data.gate && data.gate.champion !== null ? data.gate.champion : null;  // gated: the champion
    document.getElementById("version").textContent = "v" + (served !== null ? served : data.policies.length ? data.policies[data.policies.length - 1].version : 0);
    document.getElementById("stream-count").textContent = data.streams.length;
    document.getElementById("updated").textContent = new Date(data.t * 1000).toLocaleTimeString();
    document.getElementById("empty").style.display = data.streams.length ? "none" : "block";
    document.getElementById("streams").innerHTML = gateCard(data) + policyCard(data) + data.streams.map((s) => streamCard(s, data)).join("");
  } catch (error) {
    document.getElementById("updated").textContent = "learner unreachable (" + error + ")";
  }
}

refresh();
setInterval(refresh, 2000);
